"""What a load from a warm kernel cache must not do, counted in a child process (the precompile
tests of tests/test_precompile.py and tests/test_ops_backward.py): lowering, TileLang's compile,
attngen's source loading, and compiler processes (nvcc; the host compiler TileLang links its
library with). Other processes are not counted: dependencies start their own that compile nothing
(with torch 2.14.1+cu130, cuda-pathfinder's import runs `/sbin/ldconfig -p` through
ctypes.util.find_library, whose fallback runs gcc).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# nvcc, what nvcc runs (cicc, ptxas, fatbinary, nvlink, cudafe++) and host compilers (gcc-12, x86_64-linux-gnu-g++...)
COMPILER = re.compile(r"(.*-)?(nvcc|cicc|ptxas|fatbinary|nvlink|cudafe\+\+|gcc|g\+\+|cc|c\+\+|clang|clang\+\+)(-[\d.]+)?")


def child_env(**env) -> dict:
    """The environment of a child that imports attngen from this checkout and this module."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]), **env)


def compiler_in(args) -> str | None:
    """The compiler a process's command line runs (a shell's too), or None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = [args]
    words = re.split(r"[\s'\";&|()]+", " ".join(os.fsdecode(a) for a in args))
    return next((os.path.basename(w) for w in words if COMPILER.fullmatch(os.path.basename(w))), None)


def _library_lookup() -> bool:
    """Started by ctypes.util.find_library (ldconfig, or gcc as its fallback): a lookup, no build."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "ctypes.util":
            return True
        frame = frame.f_back
    return False


def count_compiles() -> list:
    """Start counting, before TileLang is imported: returns the list that each lowering, compile or
    source load ("module.name") and each compiler process ("process nvcc") is appended to."""
    calls = []
    real_init = subprocess.Popen.__init__

    def popen(self, args, *rest, **kwargs):
        compiler = compiler_in(args)
        if compiler and not _library_lookup():
            calls.append(f"process {compiler}")
        return real_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = popen

    import tilelang
    import tilelang.contrib.nvcc
    import tilelang.engine.lower  # (the package's `lower` attribute is the function: sys.modules below)
    from tilelang.jit import JITKernel

    import attngen.build.lower
    from attngen.run import entries

    def count(owner, name):
        real = getattr(owner, name)
        label = f"{getattr(owner, '__module__', None) or owner.__name__}.{name}"

        def counted(*args, **kwargs):
            calls.append(label)
            return real(*args, **kwargs)

        setattr(owner, name, counted)

    for owner, name in [(sys.modules["tilelang.engine.lower"], "lower_with_context"), (tilelang, "lower"),
                        (tilelang, "compile"), (tilelang.contrib.nvcc, "compile_cuda"),
                        (JITKernel, "_compile_and_create_adapter"), (attngen.build.lower, "load_module"),
                        (attngen.build.lower, "lower_source")]:
        count(owner, name)
    entries.load_module = attngen.build.lower.load_module  # the runtime's own reference, counted too
    return calls
