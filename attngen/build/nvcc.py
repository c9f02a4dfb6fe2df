"""Emitted source -> lowered CUDA -> sm_90a cubin -> resource report. No GPU needed.

The report is what an engineer checks before spending GPU time: registers,
spills, local memory, shared memory, whether setmaxnreg took effect, and a
SASS census. Builds are cached (attngen.build.cache) under a key that hashes the emitted source and
the tool versions; entries are written atomically, so a second build of the
same spec is a file read, and its report says so ("cached": true, with the
seconds and the toolkit of the build that made the entry).

The CUDA toolkit comes from attngen.build.toolchain (CUDA_HOME, nvcc on PATH, or the
nvidia-cuda-nvcc wheels). `build_many` builds several kernels in worker processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from attngen.build import toolchain
from attngen.build.cache import cache_key, cache_root, locked, tool_versions
from attngen.build.lower import lower_source
from attngen.kernels.append.plan import AppendPlan
from attngen.kernels.common.plan import Shape
from attngen.kernels.fwd.plan import Plan, as_plan
from attngen.kernels.append.render import render_append_source
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec

SASS_OPS = ("HGMMA", "USETMAXREG", "UTMALDG", "UTMASTG", "LDL", "STL")
# Hopper's fp8 wgmma is QGMMA in SASS (QGMMA.64x128x32.F32.E4M3.E4M3), counted by its input types;
# HMMA is mma.sync, what a GEMM becomes when it does not reach wgmma (an fp8 one then runs through fp16).
QGMMA_TYPES = ("E4M3", "E5M2")
ARCH_FLAGS = ["-gencode", "arch=compute_90a,code=sm_90a"]


class BuildError(RuntimeError):
    """nvcc or cuobjdump failed: names the kernel, the command and the tool's message."""


@dataclasses.dataclass
class BuildResult:
    report: dict
    cuda_source: str
    cubin_path: Path
    cached: bool
    combine: "BuildResult | None" = None  # a split-KV kernel's combine kernel


COMBINE_REPORT = ("kernel", "registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "cached")


def nvcc_path() -> str:
    return toolchain.current().nvcc


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
    tc = toolchain.current()
    if tc.cuobjdump is None:
        raise BuildError("cuobjdump not found: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` "
                         "(or put the CUDA toolkit's cuobjdump on PATH)")
    # cuobjdump runs nvdisasm found on PATH: the toolkit's bin folders come first
    proc = subprocess.run([tc.cuobjdump, "--dump-sass", str(cubin)], capture_output=True, text=True, env=tc.subprocess_env())
    if proc.returncode != 0:
        raise BuildError(f"cuobjdump --dump-sass {cubin} failed:\n{proc.stderr.strip()}")
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", proc.stdout)
    census = {op: sum(1 for o in opcodes if o == op) for op in SASS_OPS}
    # HGMMA with A from registers (register-P): the first source operand is a register, not a descriptor
    census["HGMMA_A_FROM_REGISTERS"] = len(re.findall(r"HGMMA\.\S+\s+R\d+, R\d+, gdesc", proc.stdout))
    census.update(mma_census(proc.stdout))
    return census


def mma_census(sass: str) -> dict:
    """QGMMA by element types (QGMMA_E4M3: both inputs e4m3) and HMMA (mma.sync), from cuobjdump's SASS text."""
    qgmma = re.findall(r"\bQGMMA\.\d+x\d+x\d+\.\w+\.(\w+)\.(\w+)", sass)
    census = {"QGMMA": len(qgmma), "HMMA": len(re.findall(r"\bHMMA\.", sass))}
    census.update({f"QGMMA_{t}": sum(1 for a, b in qgmma if a == b == t) for t in QGMMA_TYPES})
    return census


def dyn_smem_bytes(lowered) -> int | None:
    """Dynamic shared memory TileLang allocated, read from the lowered device module."""
    for _, func in lowered.device_mod.functions.items():
        if func.attrs and "dyn_shared_memory_buf" in func.attrs:
            return int(func.attrs["dyn_shared_memory_buf"])
    return None


def build_source(source: str, name: str, flags, *, plan_smem: int | None = None, cache_dir=None, extra: dict | None = None,
                 builder: str = "build_kernel") -> BuildResult:
    """Lower, compile (nvcc `flags`) and report one emitted source; cached by content and tool versions.
    `builder` names the module function that returns the prim_func; `name` is that prim_func's name."""
    flags = list(flags)
    versions = tool_versions()
    key = cache_key(source, versions, flags)
    entry = cache_root(cache_dir) / f"{name}-{key}"
    if (entry / "report.json").exists():
        return _load_entry(entry, cached=True)

    with locked(cache_root(cache_dir) / f".{name}-{key}.lock"):
        if (entry / "report.json").exists():  # another process built it while we waited
            return _load_entry(entry, cached=True)
        tc = toolchain.current()
        tc.require_host_compiler()
        lowered = lower_source(source, name, builder=builder)
        work = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{name}-"))
        try:
            cu, cubin = work / "kernel.cu", work / "kernel.cubin"
            cu.write_text(lowered.cuda_source)
            cmd = nvcc_command(cu, cubin, flags)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=tc.subprocess_env())
            t_nvcc = time.perf_counter() - t0
            ptxas_text = proc.stdout + proc.stderr
            if proc.returncode != 0:
                raise BuildError(f"nvcc failed for {name} (exit {proc.returncode}):\n{ptxas_text.strip()[-3000:]}\n"
                                 f"command: {' '.join(cmd)}")
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
                "toolchain": tc.describe(),
                # import: TileLang's import (0 when already imported); lower: TIR, passes and CUDA codegen
                "seconds": {**lowered.seconds, "nvcc": round(t_nvcc, 2)},
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cache_key": key,
            }
            (work / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
            os.replace(work, entry)  # atomic: readers see a whole entry or none
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return _load_entry(entry, cached=False)


def smem_as_planned(report: dict, slack: int = 0, planned: int | None = None) -> bool:
    """A report's dynamic shared memory is the plan's (`planned`, else the report's), or up to `slack`
    bytes under it (plan.smem_slack: a persistent kernel's tile slot takes 16 B to 1 KiB)."""
    planned = report["plan_smem_bytes"] if planned is None else planned
    built = report["dynamic_smem_bytes"]
    return built == planned or (built is not None and planned is not None and planned - slack <= built <= planned)


def _load_entry(entry: Path, cached: bool) -> BuildResult:
    report = json.loads((entry / "report.json").read_text())
    report["cached"] = cached  # not stored: whether THIS call built it
    return BuildResult(report=report, cuda_source=(entry / "kernel.cu").read_text(), cubin_path=entry / "kernel.cubin", cached=cached)


def build(spec_or_plan: Spec | Plan, shape: Shape | None = None, cache_dir=None) -> BuildResult:
    """Build the planned kernel (dynamic shapes, or specialized to the plan's static shape)."""
    plan = as_plan(spec_or_plan, shape)
    extra = {"spec_hash": plan.hash, "shape": str(plan.shape) if plan.shape else "dynamic", "threads": plan.threads}
    source = render_source(plan)
    result = build_source(source, plan.name, plan.compile_flags, plan_smem=plan.smem_bytes, cache_dir=cache_dir, extra=extra)
    if plan.split_kv:  # the combine kernel lives in the same emitted file
        combine = build_source(source, f"{plan.name}_combine", plan.compile_flags, cache_dir=cache_dir,
                               extra={"spec_hash": plan.hash}, builder="build_combine_kernel")
        result.report["combine"] = {k: combine.report[k] for k in COMBINE_REPORT}
        result.combine = combine
    return result


def build_append(plan: AppendPlan, cache_dir=None) -> BuildResult:
    """Build the KV-cache append kernel (its own emitted module; flash_attn_with_kvcache's k=, v=)."""
    extra = {"shape": "dynamic", "threads": plan.threads}
    return build_source(render_append_source(plan), plan.name, plan.compile_flags, plan_smem=0, cache_dir=cache_dir,
                        extra=extra, builder="build_append_kernel")


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
        ("SASS", ", ".join(f"{op} {s[op]}" for op in SASS_OPS) + f" (HGMMA with A in registers: {s['HGMMA_A_FROM_REGISTERS']})"
         + ("".join(f", {op} {s[op]}" for op in ("QGMMA", "QGMMA_E4M3", "HMMA")) if s.get("QGMMA") or s.get("HMMA") else "")),
        ("tools", ", ".join(f"{k} {v}" for k, v in r["versions"].items())),
        ("toolchain", format_toolchain(r)),
        ("build", format_build(r)),
    ]
    if "combine" in r:
        c = r["combine"]
        rows.insert(5, ("combine kernel", f"{c['kernel']}: {c['registers']} registers, spills {c['spill_store_bytes']} B stored, "
                                          f"{c['spill_load_bytes']} B loaded"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def format_toolchain(r: dict) -> str:
    tc = r.get("toolchain")
    return f"{tc['kind']} nvcc {tc['version']} ({tc['nvcc']})" if tc else "?"


def format_build(r: dict) -> str:
    """"lower 12.1 s, nvcc 8.0 s" for a build that ran now; "from cache (built in ...)" for a cache hit."""
    sec = r["seconds"]
    parts = [f"import {sec['import']} s"] if sec.get("import") else []
    parts += [f"lower {sec['lower']} s", f"nvcc {sec['nvcc']} s"]
    ran = ", ".join(parts)
    if not r.get("cached"):
        return ran
    when = r.get("built_at", "an earlier run").replace("T", " ").replace("Z", " UTC")
    return f"from cache (built in {round(sum(sec.values()), 1)} s on {when}: {ran})"


# -- several kernels in parallel ---------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """One kernel of `build_many`: its report, or a one-line error."""

    label: str  # what the user named: the spec file (and shape)
    report: dict | None = None
    error: str | None = None
    user_error: bool = False  # a bad spec or shape (exit 2), not a failed build (exit 1)


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message, cut to 300 characters."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _build_job(path: str, shape: str | None, cache_dir) -> Outcome:
    """Build one spec file; never raises (a worker's failure must not lose the others)."""
    from attngen.kernels.fwd.plan import make_plan
    from attngen.spec import SpecError, load

    label = path if shape is None else f"{path} --shape {shape}"
    try:
        result = build(make_plan(load(path), Shape.parse(shape) if shape else None), cache_dir=cache_dir)
    except SpecError as e:
        return Outcome(label, error=one_line(e), user_error=True)
    except Exception as e:  # noqa: BLE001 - reported per kernel, one line
        return Outcome(label, error=one_line(e))
    return Outcome(label, report=result.report)


def _worker_init() -> None:
    """A build worker: its own process group (its nvcc and ptxas children join it), deaf to SIGINT.

    A terminal's Ctrl-C then reaches only the parent, which stops the workers itself
    (worker_pool): no worker prints a KeyboardInterrupt traceback of its own, and
    killing a worker's group stops the nvcc it was running too."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgrp()


@contextlib.contextmanager
def worker_pool(jobs: int):
    """A pool of `jobs` spawned build processes that an exception (a KeyboardInterrupt above all)
    stops at once: pending builds are cancelled and each worker's process group is killed,
    where leaving the `with` would otherwise wait for every running build to finish."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import signal

    # spawn, not fork: TVM's thread pools do not survive a fork, and each worker imports TileLang once
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"), initializer=_worker_init)
    try:
        yield pool
    except BaseException:
        workers = list((getattr(pool, "_processes", None) or {}).values())  # the executor has no public list
        pool.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, signal.SIGKILL)  # the worker and the nvcc/ptxas it started
        for w in workers:
            w.join(timeout=5)
        raise
    pool.shutdown(wait=True)


def build_many(paths: list, shape: str | None = None, cache_dir=None, jobs: int = 1, progress=None, job=None) -> list[Outcome]:
    """Build several spec files, `jobs` at a time in worker processes; results in the order given.

    `progress(done, total, outcome)` is called as each kernel finishes (outcome None for a
    periodic tick while waiting). A kernel that fails is reported, the others still build.
    `job(path, shape, cache_dir) -> Outcome`, a module-level function that never raises, is
    what each kernel runs (default: `attngen build`'s; `attngen precompile` passes its own).
    """
    import concurrent.futures as cf

    job = job or _build_job
    progress = progress or (lambda done, total, outcome: None)
    outcomes: list[Outcome | None] = [None] * len(paths)
    if jobs <= 1 or len(paths) == 1:
        for i, path in enumerate(paths):
            outcomes[i] = job(str(path), shape, cache_dir)
            progress(i + 1, len(paths), outcomes[i])
        return outcomes
    with worker_pool(min(jobs, len(paths))) as pool:
        futures = {pool.submit(job, str(p), shape, cache_dir): i for i, p in enumerate(paths)}
        pending, done = set(futures), 0
        while pending:
            finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for f in finished:
                i = futures[f]
                try:
                    outcomes[i] = f.result()
                except Exception as e:  # noqa: BLE001 - a worker died (killed, out of memory): that kernel fails
                    outcomes[i] = Outcome(str(paths[i]), error=f"worker process failed: {one_line(e)}")
                done += 1
                progress(done, len(paths), outcomes[i])
            if not finished:
                progress(done, len(paths), None)
    return outcomes


class Progress:
    """Progress of `build_many` on stderr: a redrawn bar on a terminal, else one line per kernel."""

    def __init__(self, stream, tty: bool | None = None, width: int = 30):
        self.stream, self.width = stream, width
        self.tty = stream.isatty() if tty is None else tty
        self.t0 = time.monotonic()
        self.failed = self.cached = 0

    def __call__(self, done: int, total: int, outcome: Outcome | None) -> None:
        elapsed = time.monotonic() - self.t0
        if outcome is not None:
            self.failed += outcome.error is not None
            self.cached += bool(outcome.report and outcome.report.get("cached"))
            line = f"[{done}/{total}] {self._verdict(outcome)}"
            if self.tty:
                self.stream.write("\r\033[K" + line + "\n")
            else:
                self.stream.write(line + "\n")
        if self.tty:
            fill = self.width * done // total
            bar = "#" * fill + "-" * (self.width - fill)
            self.stream.write(f"\r\033[K[{bar}] {done}/{total} done, {self.cached} cached, {self.failed} failed, {elapsed:.0f} s")
            if done == total:
                self.stream.write("\n")
        self.stream.flush()

    @staticmethod
    def _verdict(o: Outcome) -> str:
        if o.error is not None:
            return f"FAILED {o.label}: {o.error}"
        r = o.report
        how = "from cache" if r.get("cached") else f"built in {round(sum(r['seconds'].values()), 1)} s"
        registers = f"{r['registers']} registers, " if "registers" in r else ""  # a precompile reports no resources
        return f"ok {r['kernel']} ({o.label}): {registers}{how}"


def format_summary(outcomes: list) -> str:
    """One row per kernel (the multi-kernel text report)."""
    rows = [("kernel", "registers", "spills (B)", "smem (B)", "setmaxnreg", "build")]
    for o in outcomes:
        if o.error is not None:
            rows.append((o.label, "FAILED", o.error, "", "", ""))
            continue
        r = o.report
        rows.append((
            r["kernel"] + ("" if r.get("shape", "dynamic") == "dynamic" else f" [{r['shape']}]"),
            str(r["registers"]),
            f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
            str(r["dynamic_smem_bytes"]),
            "applied" if r["setmaxnreg_applied"] else "IGNORED" if r["setmaxnreg_ignored"] else "absent",
            "cached" if r.get("cached") else f"{round(sum(r['seconds'].values()), 1)} s",
        ))
    widths = [max(len(row[i]) for row in rows if row[1] != "FAILED" or i < 2) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        if row[1] == "FAILED":
            lines.append(f"{row[0].ljust(widths[0])}  FAILED: {row[2]}")
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def build_backward(spec, shape: Shape | None = None, cache_dir=None) -> dict:
    """Build every kernel of the spec's backward module (docs/backward.md): {part: BuildResult}, the
    parts named by their builders (preprocess, main, postprocess or dq, postprocess_kv with GQA)."""
    from attngen.kernels.bwd.render import as_backward_plan, entries, render_backward_source

    bp = as_backward_plan(spec, shape)
    source = render_backward_source(bp)
    out = {}
    for builder in entries(bp):
        part = "main" if builder == "build_kernel" else builder.removeprefix("build_").removesuffix("_kernel")
        name = bp.name if part == "main" else f"{bp.name}_{part}"
        extra = {"spec_hash": bp.hash, "shape": str(bp.shape) if bp.shape else "dynamic", "pass": "backward", "part": part}
        out[part] = build_source(source, name, bp.compile_flags, plan_smem=bp.smem_bytes if part == "main" else None,
                                 cache_dir=cache_dir, extra=extra, builder=builder)
    return out
