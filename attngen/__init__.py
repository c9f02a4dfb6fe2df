"""attngen: FlashAttention-3 forward kernels for Hopper (sm_90a), generated from a spec.

Flow: spec -> plan -> render (templates/) -> emitted TileLang source -> build (lower + nvcc)
      -> run on a GPU (runtime) or on the CPU (emulate); `reference` is the fp64 oracle.
"""

__version__ = "0.1.0"

from attngen.spec import Spec, SpecError, load as load_spec  # noqa: E402
from attngen.plan import Plan, Shape, make_plan  # noqa: E402
from attngen.render import render, generate  # noqa: E402
from attngen.emulator import emulate  # noqa: E402
from attngen.runtime import compile, attention  # noqa: E402

__all__ = [
    "Spec", "SpecError", "load_spec", "Plan", "Shape", "make_plan", "render", "generate",
    "emulate", "compile", "attention", "__version__",
]
