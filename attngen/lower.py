"""Emitted source -> TileLang prim_func -> lowered CUDA C++ for sm_90a (no GPU needed).

The emitted file is an ordinary Python module; it is loaded from its text (not
from a path on sys.path) so a hand-edited copy can be lowered the same way.
"""

from __future__ import annotations

import dataclasses
import types

TARGET = {"kind": "cuda", "arch": "sm_90a"}


class LowerError(RuntimeError):
    """TileLang could not lower the emitted source; says which kernel and why."""


def load_module(source: str, name: str = "attngen_kernel") -> types.ModuleType:
    """Execute emitted source as a fresh module (TileLang's parser needs real source lines)."""
    import linecache

    filename = f"<attngen:{name}>"
    # TileLang's eager parser reads the function's source through inspect/linecache.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
    return module


@dataclasses.dataclass
class Lowered:
    cuda_source: str
    artifact: object  # tilelang CompiledArtifact: device module attributes (dynamic smem size)


def lower_source(source: str, name: str = "attngen_kernel") -> Lowered:
    """Lower emitted TileLang source to CUDA C++ for sm_90a."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    module = load_module(source, name)
    target = Target(TARGET)
    try:
        with target:
            prim_func = module.build_kernel()
            with tvm.transform.PassContext(opt_level=3, config=module.PASS_CONFIGS):
                artifact = tilelang.lower(prim_func, target=target)
    except Exception as e:  # TileLang/TVM raise many types; name the kernel and keep the cause
        raise LowerError(f"TileLang could not lower {name}: {type(e).__name__}: {str(e).strip()[-2000:]}") from e
    return Lowered(cuda_source=artifact.kernel_source, artifact=artifact)
