"""Runtime cache entries (docs/build.md, "Kernels before the first call"), where the forward,
backward and append kernels (run/forward.py, backward.py, append.py) are built and found.

Caching: `compile_kernel` memoizes per (spec, shape) in this process; across processes the
attngen cache ($ATTNGEN_CACHE, default ~/.cache/attngen; attngen.build.cache) keeps a runtime entry
per kernel, runtime/<kernel>-<key>/ (key: the emitted source, the nvcc flags, attngen's and
TileLang's versions), holding TileLang's compiled library, its parameters and the prim_func as
JSON. A hit loads it the way TileLang loads its own disk cache: no lowering, no nvcc, no process
started, no emitted code run. A miss lowers and compiles with `tilelang.compile` (which also
fills TileLang's cache under $TILELANG_CACHE_DIR) and stores the entry. `precompile(spec)` (and
`attngen precompile`) makes entries ahead of the first call; an entry holds no absolute path, so
a cache folder built on one machine serves another (docs/build.md, "Kernels before the first call").
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

from attngen.build.cache import RUNTIME, cache_key, cache_root, locked, package_versions, tool_versions
from attngen.build.lower import TARGET, load_module
from attngen.kernels.fwd.plan import Plan
from attngen.kernels.fwd.render import render_source
from attngen.run import serving


class KernelBuildError(RuntimeError):
    """TileLang or nvcc could not build a kernel: the tail of the error, and where the whole log is."""


_memo_lock = threading.Lock()
_key_locks: dict[object, threading.Lock] = {}  # a lock per memo key (forward, backward, append)
ERROR_TAIL = 1500  # characters of a build error shown; TileLang's message embeds the whole CUDA source


def _once(memo: dict, key, build):
    """memo[key], made by build() at most once per key in this process, even when threads race
    (a lock per key: a build of one kernel does not hold up a lookup of another)."""
    with _memo_lock:
        if key in memo:
            return memo[key]
        lock = _key_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in memo:
            value = build()
            with _memo_lock:
                memo[key] = value
        return memo[key]


def _failure_message(plan: Plan, err: Exception) -> str:
    """The error's tail, with the whole text written to a log file ($ATTNGEN_LOG_DIR or the temp dir)."""
    import tempfile

    text = f"{type(err).__name__}: {err}"
    log_dir = os.environ.get("ATTNGEN_LOG_DIR") or os.path.join(tempfile.gettempdir(), "attngen-build-failures")
    where = ""
    try:
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"{plan.name}{'_static' if plan.shape else ''}.log")
        with open(path, "w") as f:
            f.write(text)
        where = f" (whole log: {path})"
    except OSError:
        pass
    tail = text if len(text) <= ERROR_TAIL else "..." + text[-ERROR_TAIL:]
    return f"building {plan.name} failed{where}:\n{tail}"


RUNTIME_FORMAT = "tilelang-jit-1"  # what a runtime entry holds; a change of layout changes every key


def runtime_key(plan: Plan, source: str) -> str:
    """The runtime entry's key: the emitted source, the nvcc flags, attngen's and TileLang's versions.
    Not the local nvcc's version (unlike `attngen build`'s reports): a deployment that ships a
    precompiled cache needs no CUDA toolkit, and a hit must start no process at all."""
    import platform
    import sys

    # the library is a host shared object: an entry serves the OS and CPU architecture it was built on
    versions = {**package_versions(), "format": RUNTIME_FORMAT, "platform": f"{sys.platform}-{platform.machine()}"}
    return cache_key(source, versions, list(plan.compile_flags))


def runtime_entry(plan: Plan, source: str | None = None, cache_dir=None) -> Path:
    """Where the runtime entry of the plan's kernel (or of an edited `source`) lives, built or not:
    `<cache>/runtime/<kernel>-<key>`, under $ATTNGEN_CACHE unless `cache_dir` is given."""
    text = source or render_source(plan)
    name = plan.name if plan.shape is None else f"{plan.name}_static"
    return cache_root(cache_dir) / RUNTIME / f"{name}-{runtime_key(plan, text)}"


@dataclasses.dataclass
class Precompiled:
    """A runtime entry `precompile` made or found: its folder, whether it was there already, the seconds spent."""

    path: Path
    cached: bool
    seconds: float


def _built_entry(plan: Plan, source: str, entry: Path, *, module_name: str | None = None, require: bool = False,
                 kernels: dict | None = None):
    """Build (under the entry's lock: one build per entry across processes) and store the entry;
    returns (jit, combine jit, origin). `require`: a kernel whose entry cannot be stored is an error
    (precompile's whole point), where a first call would still run it. `kernels`: part -> the
    module's builder (default: build_kernel, and build_combine_kernel for a split spec)."""
    parts = kernels
    if parts is None:
        parts = {"main": "build_kernel"}
        if serving.serving_fields(plan).split:  # the split-KV kernel's partials are merged by a second prim_func
            parts["combine"] = "build_combine_kernel"
    jits, origin = _built_parts(plan, source, entry, parts, module_name=module_name, require=require)
    return jits["main"], jits.get("combine"), origin


def _built_parts(plan, source: str, entry: Path, parts: dict, *, module_name: str | None = None,
                 require: bool = False) -> tuple[dict, str]:
    """Build each prim_func of the emitted module (`parts`: part -> its builder, e.g. main ->
    build_kernel) and store them as one entry; returns ({part: jit}, origin). `plan` is a forward
    Plan, a BackwardPlan or an AppendPlan (name, shape, compile_flags)."""
    with locked(entry.parent / f".{entry.name}.lock"):
        if (entry / "meta.json").exists():  # another process built it while we waited
            return _load_parts(entry, plan), "disk"
        import tilelang
        from tvm.target import Target

        name = plan.name if plan.shape is None else f"{plan.name}_static"
        module = load_module(source, module_name or name)
        target = Target(TARGET)
        built, start = {}, time.time()
        for part, builder in parts.items():
            with target:  # T.tma_copy and the sm_90a intrinsics need the arch while the TIR is built
                prim_func = getattr(module, builder)()
            # out_idx=None (not [3]): the caller's `out` buffer is passed in, so tests can poison it;
            # with out_idx=[3] TileLang would allocate O itself and ignore any buffer given.
            jit = tilelang.compile(prim_func, out_idx=None, target=target, pass_configs=module.PASS_CONFIGS,
                                   compile_flags=list(plan.compile_flags))
            built[part] = (prim_func, jit)
        stored = _store_entry(entry, built, module.PASS_CONFIGS)
        if require and not stored:
            raise RuntimeError(f"{name}: TileLang wrote no kernel-cache entry to copy into {entry.parent} "
                               "(is TileLang's cache disabled? unset TILELANG_DISABLE_CACHE)")
        # TileLang's entry appears by an atomic rename during its build: one older than this call was loaded
        first = next(iter(parts))
        tl_entry = getattr(built[first][1], "_tilelang_cache_path", None)
        origin = "disk" if tl_entry and os.path.isdir(tl_entry) and os.stat(tl_entry).st_mtime < start else "compiled"
        return {part: jit for part, (_, jit) in built.items()}, origin


def _store_entry(entry: Path, built: dict, pass_configs: dict) -> bool:
    """Copy TileLang's cache entry of each built kernel (its library, parameters and sources) into
    `entry`/<part>/, with the prim_func as JSON (what TileLang's loader needs beside them, so a hit
    runs no emitted code) and meta.json (last: its presence marks a whole entry). No absolute path
    is stored. Returns False when TileLang kept no entry to copy."""
    import shutil
    import tempfile

    import tilelang  # noqa: F401  (first: it puts its bundled tvm on the path)
    import tvm

    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}-"))
    try:
        parts = {}
        for part, (prim_func, jit) in built.items():
            src = getattr(jit, "_tilelang_cache_path", None)
            library = next((n for n in LIBRARIES if src and os.path.isfile(os.path.join(src, n))), None)
            if library is None or not os.path.isfile(os.path.join(src, "params.json")):
                return False
            (work / part).mkdir()
            for n in (library, "params.json", "device_kernel.cu", "host_kernel.cu"):
                if os.path.isfile(os.path.join(src, n)):
                    shutil.copyfile(os.path.join(src, n), work / part / n)
            (work / part / "prim_func.json").write_text(tvm.ir.save_json(prim_func))
            parts[part] = {"library": library, "execution_backend": jit.execution_backend}
        meta = {"format": RUNTIME_FORMAT, "parts": parts, "versions": tool_versions(),
                "pass_configs": {str(getattr(k, "value", k)): v for k, v in pass_configs.items()},
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (work / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        os.replace(work, entry)  # atomic: readers see a whole entry or none
        return True
    finally:
        shutil.rmtree(work, ignore_errors=True)


LIBRARIES = ("executable.so", "kernel_lib.so")  # TileLang's library file, by execution backend (tvm_ffi, cython)


def _load_entry(entry: Path, plan: Plan) -> tuple:
    """(jit, combine jit or None) from a runtime entry, the way TileLang loads its own disk cache:
    no lowering, no nvcc, no emitted code run."""
    jits = _load_parts(entry, plan)
    return jits["main"], jits.get("combine")


def _load_parts(entry: Path, plan) -> dict:
    """{part: jit} of a runtime entry (a forward Plan's or a BackwardPlan's compile flags)."""
    import tilelang  # noqa: F401  (first: it puts its bundled tvm on the path)
    import tvm
    from tilelang.engine.param import load_kernel_params
    from tilelang.jit import JITKernel
    from tilelang.jit.adapter.base import CachedTextSource
    from tvm.target import Target

    meta = json.loads((entry / "meta.json").read_text())
    jits = {}
    for part, info in meta["parts"].items():
        folder = entry / part
        jits[part] = JITKernel.from_database(
            func=tvm.ir.load_json((folder / "prim_func.json").read_text()),
            host_kernel_source=CachedTextSource(path=str(folder / "host_kernel.cu")),
            device_kernel_source=CachedTextSource(path=str(folder / "device_kernel.cu")),
            kernel_lib_path=str(folder / info["library"]),
            params=load_kernel_params((folder / "params.json").read_text()),
            target=Target(TARGET), target_host=None, out_idx=None, execution_backend=info["execution_backend"],
            pass_configs=meta["pass_configs"], compile_flags=list(plan.compile_flags),
        )
    return jits


__all__ = ["KernelBuildError", "Precompiled", "RUNTIME_FORMAT", "runtime_entry", "runtime_key"]
