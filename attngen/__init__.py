"""attngen: FlashAttention-3 forward kernels for Hopper (sm_90a), generated from a spec.

Flow (each step a module; data flows one way, each entry point plans once):
    spec -> plan -> render (templates/) -> emitted TileLang source
         -> build (lower + nvcc) | emulate (CPU model) | runtime (GPU)
hw holds the target's facts beneath all of them; reference is the fp64 oracle.
"""

from attngen.version import __version__  # noqa: E402

from attngen.spec import Spec, SpecError, load as load_spec  # noqa: E402
from attngen.plan import Plan, Shape, make_plan  # noqa: E402
from attngen.render import render_source, generate  # noqa: E402
from attngen.emulator import emulate  # noqa: E402
from attngen.runtime import compile_kernel, attention  # noqa: E402

__all__ = [
    "Spec", "SpecError", "load_spec", "Plan", "Shape", "make_plan", "render_source", "generate",
    "emulate", "compile_kernel", "attention", "__version__",
]
