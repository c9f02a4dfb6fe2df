"""Emitted source -> lowered CUDA -> sm_90a cubin -> resource report. No GPU needed.

The report is what an engineer checks before spending GPU time: registers,
spills, local memory, shared memory, whether setmaxnreg took effect, and a
SASS census. Builds are cached under a key that hashes the emitted source and
the tool versions; entries are written atomically, so a second build of the
same spec is a file read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from attngen.version import __version__
from attngen.lower import lower_source
from attngen.plan import Plan, Shape, as_plan
from attngen.render import render_source
from attngen.spec import Spec

SASS_OPS = ("HGMMA", "USETMAXREG", "UTMALDG", "UTMASTG", "LDL", "STL")
ARCH_FLAGS = ["-gencode", "arch=compute_90a,code=sm_90a"]


class BuildError(RuntimeError):
    """nvcc or cuobjdump failed: names the kernel, the command and the tool's message."""


@dataclasses.dataclass
class BuildResult:
    report: dict
    cuda_source: str
    cubin_path: Path
    cached: bool


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("ATTNGEN_CACHE", Path.home() / ".cache" / "attngen"))


def nvcc_path() -> str:
    path = shutil.which("nvcc")
    if path is None:
        raise BuildError("nvcc not found on PATH: attngen build needs the CUDA toolkit's nvcc (12.4 or newer) for sm_90a")
    return path


def cuobjdump_path() -> str | None:
    path = shutil.which("cuobjdump")
    if path:
        return path
    try:  # the `nvidia-cuda-cuobjdump` wheel ships the binary inside site-packages
        import nvidia

        for root in nvidia.__path__:
            for candidate in Path(root).glob("*/bin/cuobjdump"):
                return str(candidate)
    except ImportError:
        pass
    return None


@functools.lru_cache(maxsize=1)
def tool_versions() -> dict:
    # importlib.metadata, not `import tilelang`: a cache hit must not pay TileLang's import (seconds)
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return {"attngen": __version__, "tilelang": importlib.metadata.version("tilelang"), "nvcc": release.group(2) if release else out.strip()[-40:]}


def cache_key(source: str, versions: dict, flags: list) -> str:
    blob = json.dumps({"source": source, "versions": versions, "flags": flags}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def nvcc_command(cu: Path, cubin: Path, compile_flags: list) -> list:
    from tilelang.contrib.nvcc import default_compile_options

    return [nvcc_path(), "--cubin", *ARCH_FLAGS, *default_compile_options(list(compile_flags)), "-Xptxas", "-v", "-o", str(cubin), str(cu)]


def parse_ptxas(text: str, kernel: str) -> dict:
    """Registers, spills, stack and static smem of `kernel` from `ptxas -v` output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Compiling entry function" in line and kernel in line), 0)
    block = "\n".join(lines[start:])

    def grab(pattern, default=0):
        m = re.search(pattern, block)
        return int(m.group(1)) if m else default

    return {
        "registers": grab(r"Used (\d+) registers", None),
        "stack_frame_bytes": grab(r"(\d+) bytes stack frame"),
        "spill_store_bytes": grab(r"(\d+) bytes spill stores"),
        "spill_load_bytes": grab(r"(\d+) bytes spill loads"),
        "static_smem_bytes": grab(r"(\d+) bytes smem"),
        # ptxas reports an ignored setmaxnreg as C7508, printed as info, not as a warning
        "setmaxnreg_ignored": "C7508" in text,
    }


def sass_census(cubin: Path) -> dict:
    tool = cuobjdump_path()
    if tool is None:
        raise BuildError("cuobjdump not found: `pip install nvidia-cuda-cuobjdump` (or put the CUDA toolkit's cuobjdump on PATH)")
    env = dict(os.environ)
    env["PATH"] = f"{Path(tool).parent}{os.pathsep}{env.get('PATH', '')}"  # cuobjdump runs nvdisasm found on PATH
    proc = subprocess.run([tool, "--dump-sass", str(cubin)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise BuildError(f"cuobjdump --dump-sass {cubin} failed:\n{proc.stderr.strip()}")
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", proc.stdout)
    census = {op: sum(1 for o in opcodes if o == op) for op in SASS_OPS}
    # HGMMA with A from registers (register-P): the first source operand is a register, not a descriptor
    census["HGMMA_A_FROM_REGISTERS"] = len(re.findall(r"HGMMA\.\S+\s+R\d+, R\d+, gdesc", proc.stdout))
    return census


def dyn_smem_bytes(lowered) -> int | None:
    """Dynamic shared memory TileLang allocated, read from the lowered device module."""
    for _, func in lowered.device_mod.functions.items():
        if func.attrs and "dyn_shared_memory_buf" in func.attrs:
            return int(func.attrs["dyn_shared_memory_buf"])
    return None


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_source(source: str, name: str, flags, *, plan_smem: int | None = None, cache_dir=None, extra: dict | None = None) -> BuildResult:
    """Lower, compile (nvcc `flags`) and report one emitted source; cached by content and tool versions."""
    flags = list(flags)
    versions = tool_versions()
    key = cache_key(source, versions, flags)
    entry = cache_root(cache_dir) / f"{name}-{key}"
    if (entry / "report.json").exists():
        return _load_entry(entry, cached=True)

    with _locked(cache_root(cache_dir) / f".{name}-{key}.lock"):
        if (entry / "report.json").exists():  # another process built it while we waited
            return _load_entry(entry, cached=True)
        t0 = time.perf_counter()
        lowered = lower_source(source, name)
        t_lower = time.perf_counter() - t0
        work = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{name}-"))
        try:
            cu, cubin = work / "kernel.cu", work / "kernel.cubin"
            cu.write_text(lowered.cuda_source)
            cmd = nvcc_command(cu, cubin, flags)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            t_nvcc = time.perf_counter() - t0
            ptxas_text = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise BuildError(f"nvcc failed for {name} (exit {proc.returncode}):\n{ptxas_text.strip()[-3000:]}\ncommand: {' '.join(cmd)}")
            (work / "ptxas.txt").write_text(ptxas_text)
            ptxas = parse_ptxas(ptxas_text, f"{name}_kernel")
            sass = sass_census(cubin)
            report = {
                "kernel": name,
                **(extra or {}),
                **ptxas,
                "dynamic_smem_bytes": dyn_smem_bytes(lowered.artifact),
                "plan_smem_bytes": plan_smem,
                "setmaxnreg_applied": sass["USETMAXREG"] > 0 and not ptxas["setmaxnreg_ignored"],
                "sass": sass,
                "versions": versions,
                "seconds": {"lower": round(t_lower, 2), "nvcc": round(t_nvcc, 2)},
                "cache_key": key,
            }
            (work / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
            os.replace(work, entry)  # atomic: readers see a whole entry or none
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return _load_entry(entry, cached=False)


def _load_entry(entry: Path, cached: bool) -> BuildResult:
    report = json.loads((entry / "report.json").read_text())
    return BuildResult(report=report, cuda_source=(entry / "kernel.cu").read_text(), cubin_path=entry / "kernel.cubin", cached=cached)


def build(spec_or_plan: Spec | Plan, shape: Shape | None = None, cache_dir=None) -> BuildResult:
    """Build the planned kernel (dynamic shapes, or specialized to the plan's static shape)."""
    plan = as_plan(spec_or_plan, shape)
    extra = {"spec_hash": plan.hash, "shape": str(plan.shape) if plan.shape else "dynamic", "threads": plan.threads}
    return build_source(render_source(plan), plan.name, plan.compile_flags, plan_smem=plan.smem_bytes,
                        cache_dir=cache_dir, extra=extra)


def format_report(r: dict) -> str:
    s = r["sass"]
    rows = [
        ("kernel", r["kernel"]),
        ("shape", r.get("shape", "?")),
        ("registers / thread", f"{r['registers']} at launch ({r.get('threads', '?')} threads)"),
        ("spills", f"{r['spill_store_bytes']} B stored, {r['spill_load_bytes']} B loaded"),
        ("local memory", f"{r['stack_frame_bytes']} B stack frame"),
        ("shared memory", f"{r['dynamic_smem_bytes']} B dynamic (plan {r['plan_smem_bytes']}), {r['static_smem_bytes']} B static"),
        ("setmaxnreg", "applied" if r["setmaxnreg_applied"] else "IGNORED (ptxas C7508)" if r["setmaxnreg_ignored"] else "absent"),
        ("SASS", ", ".join(f"{op} {s[op]}" for op in SASS_OPS) + f" (HGMMA with A in registers: {s['HGMMA_A_FROM_REGISTERS']})"),
        ("tools", ", ".join(f"{k} {v}" for k, v in r["versions"].items())),
        ("build seconds", f"lower {r['seconds']['lower']}, nvcc {r['seconds']['nvcc']}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
