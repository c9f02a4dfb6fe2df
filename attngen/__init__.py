"""attngen: FlashAttention-3 kernels for Hopper (sm_90a), forward and backward, generated from a spec.

Flow (data flows one way, each entry point plans once; tests/test_architecture.py):
    spec -> kernels/<family>: plan -> render (templates/<family>/) -> emitted TileLang source
         -> build (lower + nvcc) | emulator (CPU model) | run (GPU) -> interfaces (torch ops, doors) -> cli
The families: fwd (the forward pass), combine (split-KV's merge, emitted in the forward's file),
bwd (the backward pass, planned from the forward's plan), append (the KV-cache append);
kernels/common holds what they share. hw, expr and tiles hold the chip's facts and the algebra
beneath all of them; reference is the fp64 oracle of both passes.
`attngen.attention` is attngen.interfaces.ops.attention (torch.ops.attngen.fwd, .bwd for autograd),
imported on first use: `import attngen` alone does not import torch. The front doors
(docs/interfaces.md) load the same way: `attngen.flex_attention`, `attngen.create_block_mask`,
the module `attngen.flash_attn_interface` (FlashAttention-3's names) and `attngen.distributed` (context
parallelism, docs/distributed.md).
Errors: `attngen.SpecError` (a spec field that cannot become a kernel) and `attngen.InputError`
(a call's argument the kernel cannot take), both ValueErrors with one line naming the field or
argument, the value and what is valid.
"""

from attngen.version import __version__  # noqa: E402

from attngen.spec import Spec, SpecError, load as load_spec  # noqa: E402
from attngen.reference.forward import InputError  # noqa: E402
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan, make_plan  # noqa: E402
from attngen.kernels.fwd.render import generate, render_source  # noqa: E402
from attngen.emulator import emulate, emulate_backward  # noqa: E402
from attngen.run.forward import compile_kernel  # noqa: E402


def __getattr__(name):
    if name == "attention":  # registers the torch ops; kept in the module's dict after the first use
        from attngen.interfaces.ops import attention

        globals()["attention"] = attention
        return attention
    if name == "distributed":  # context parallelism (docs/distributed.md): imports torch, so on first use
        import importlib

        return importlib.import_module("attngen.distributed")
    if name in ("flex_attention", "create_block_mask", "BlockMask"):
        import importlib

        module = importlib.import_module("attngen.interfaces.flex" if name == "flex_attention" else "attngen.interfaces.flex_blocks")
        globals()[name] = getattr(module, name)
        return globals()[name]
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")


__all__ = [
    "Spec", "SpecError", "InputError", "load_spec", "Plan", "Shape", "make_plan", "render_source", "generate",
    "emulate", "emulate_backward", "compile_kernel", "attention", "flex_attention", "create_block_mask", "BlockMask",
    "distributed", "__version__",
]
