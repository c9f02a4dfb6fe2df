"""The kernel cache on disk: where it lives, how an entry is keyed, how one is written.

`$ATTNGEN_CACHE` (default ~/.cache/attngen) holds two kinds of entries, each keyed by a hash
of the emitted source, the tool versions and the nvcc flags, and never by a path, so a cache
directory can be copied to another machine or folder and still hit:

    <kernel>-<key>/           attngen build's: report.json, kernel.cu, kernel.cubin, ptxas.txt
    runtime/<kernel>-<key>/   the GPU runtime's (attngen precompile, or a first call): TileLang's
                              compiled library and what loads it without lowering or nvcc

Entries appear by an atomic rename of a finished folder: a reader sees a whole entry or none.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from attngen.build import toolchain
from attngen.version import __version__

ENV = "ATTNGEN_CACHE"
RUNTIME = "runtime"  # the subfolder of the GPU runtime's entries


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get(ENV, Path.home() / ".cache" / "attngen"))


@functools.lru_cache(maxsize=1)
def package_versions() -> dict:
    """attngen's and TileLang's versions: no subprocess (a runtime cache hit starts none)."""
    # importlib.metadata, not `import tilelang`: a cache hit must not pay TileLang's import (seconds)
    return {"attngen": __version__, "tilelang": importlib.metadata.version("tilelang")}


@functools.lru_cache(maxsize=1)
def tool_versions() -> dict:
    """package_versions and the CUDA toolkit's nvcc (`nvcc --version`, run once per process)."""
    return {**package_versions(), "nvcc": "V" + toolchain.current().version}


def cache_key(source: str, versions: dict, flags: list) -> str:
    blob = json.dumps({"source": source, "versions": versions, "flags": flags}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock file: one process builds an entry while the others wait for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
