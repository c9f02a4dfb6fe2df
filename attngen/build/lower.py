"""Emitted source -> TileLang prim_func -> lowered CUDA C++ for sm_90a (no GPU needed).

The emitted file is an ordinary Python module; it is loaded from its text (not
from a path on sys.path) so a hand-edited copy can be lowered the same way.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import types

from attngen.build import toolchain

TARGET = {"kind": "cuda", "arch": "sm_90a"}

# Before anything imports TileLang (which reads CUDA_HOME once, at import): the runtime's
# tilelang.compile then runs the nvcc that `attngen build` runs, the pip one included.
toolchain.hand_to_tilelang()


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
    seconds: dict  # "import": importing TileLang (0 when already imported), "lower": TIR + passes + codegen
    passes: list | None = None  # [(pass name, seconds)] in run order, when profiled


def import_tilelang() -> float:
    """Import TileLang (seconds it took; 0 when it was already imported)."""
    if "tilelang" in sys.modules:
        return 0.0
    t0 = time.perf_counter()
    import tilelang  # noqa: F401

    return time.perf_counter() - t0


def lower_prim_func(prim_func, pass_configs: dict, *, profile: bool = False):
    """tilelang.lower for sm_90a: returns (artifact, [(pass, cpu seconds, wall seconds)] or None).

    profile=True times every top-level pass (nested passes count in their parent) by the
    process's CPU time, which load from other processes disturbs far less than wall time.
    """
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    timer = _pass_timer() if profile else None
    with Target(TARGET) as target:
        with tvm.transform.PassContext(opt_level=3, config=pass_configs, instruments=[timer] if timer else []):
            artifact = tilelang.lower(prim_func, target=target)
    return artifact, (timer.passes if timer else None)


def _pass_timer():
    from tvm.ir.instrument import pass_instrument

    @pass_instrument
    class PassTimer:
        def __init__(self):
            self.passes, self.stack = [], []

        def run_before_pass(self, mod, info):
            self.stack.append((time.process_time(), time.perf_counter()))

        def run_after_pass(self, mod, info):
            c0, w0 = self.stack.pop()
            if not self.stack:
                self.passes.append((info.name, time.process_time() - c0, time.perf_counter() - w0))

    return PassTimer()


def lower_source(source: str, name: str = "attngen_kernel", *, profile: bool = False, builder: str = "build_kernel") -> Lowered:
    """Lower emitted TileLang source to CUDA C++ for sm_90a. `builder`: the module's function that
    returns the prim_func (build_combine_kernel for a split-KV kernel's combine step)."""
    t_import = import_tilelang()
    from tvm.target import Target

    t0 = time.perf_counter()
    try:
        module = load_module(source, name)
        with Target(TARGET):  # T.tma_copy and the sm_90a intrinsics need the arch while the TIR is built
            prim_func = getattr(module, builder)()
        artifact, passes = lower_prim_func(prim_func, module.PASS_CONFIGS, profile=profile)
    except Exception as e:  # TileLang/TVM raise many types; name the kernel and keep the cause
        raise LowerError(f"TileLang could not lower {name}: {type(e).__name__}: {str(e).strip()[-2000:]}") from e
    seconds = {"import": round(t_import, 2), "lower": round(time.perf_counter() - t0, 2)}
    return Lowered(cuda_source=artifact.kernel_source, artifact=artifact, seconds=seconds, passes=passes)
