"""Cold-build time: TileLang lowering of the hand-written seed kernel beside the default preset, in one run.

    python bench/build_time.py                       # seed, default static, default dynamic; 3 rounds
    python bench/build_time.py --rounds 5 --profile  # plus the top passes of each kernel
    python bench/build_time.py --variant hoist-row-max --variant ...   # emitted-source edits, measured
    python bench/build_time.py --nvcc                # also nvcc on each lowered kernel
    python bench/build_time.py --list                # the variants and what each edits

Kernels, lowered the same way (TIR built under the sm_90a target, then tilelang.lower under a
PassContext with the kernel's own PASS_CONFIGS):
  seed     `fa3_prefill` of the seed notes (shared/seeds/fa3-tilelang-notes.md), read from the
           markdown at run time (no seed code lives in this repository), at its static shape
           B,H,HKV,SQ,SKV = 1,8,8,1024,1024, head_dim 128, float16, 128x128 tiles, 2+2 stages
  static   the default preset (examples/default.toml) rendered for that same static shape
  dynamic  the default preset as `attngen build` builds it (dynamic shapes)

Each measurement runs in a fresh process (a cold build is a fresh process), after TileLang's
import, which is timed apart; rounds interleave the kernels so that load from other processes
on the machine spreads over all of them. The table gives each kernel's lowering seconds (min
and median over rounds) and its ratio to the seed's, both taken from this run.

Variants are textual edits (old -> new) of the rendered source, or spec fields to render with
(split-masked-loop: steady_loop = "split", the generator's own two-loop form): the template is
edited elsewhere, so a winning edit is reported here, with its measurement, and moved into the
template at merge time. Each edit must match exactly once (marked "all": at least once), or
the run stops; a variant is measured on a kernel only where all its edits (but those marked
"optional") apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# ../shared beside a clone (the default), or shared/ inside one (as the device machine lays it out)
_NOTES = [base / "shared" / "seeds" / "fa3-tilelang-notes.md" for base in (ROOT.parent, ROOT)]
DEFAULT_NOTES = next((p for p in _NOTES if p.is_file()), _NOTES[0])
SEED_SHAPE = (1, 8, 8, 1024, 1024)
KERNELS = ("seed", "static", "dynamic")

# Emitted-source edits to measure. Every edit keeps the kernel's meaning (same masks, same
# guards); only the form changes. name -> (what, [(old, new), ...]); an edit whose old text
# is absent from a kernel (the static render drops the -inf guards) is skipped for that kernel.
_GUARD = "T.if_then_else(m_cur[i] == -T.infinity(ACCUM), 0.0, m_cur[i] * scale_log2)"
_MASK0 = ("        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile\n"
          "            diag0 = q0 + row0 + causal_offset  # row i of tile 0 sees keys j <= i + diag0\n"
          "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
          "                acc_s[i, j] = T.if_then_else(i + diag0 >= j, acc_s[i, j], -T.infinity(ACCUM))\n")
_REDUCE0 = "        T.reduce_max(acc_s, m_cur, dim=1, clear=True)  # the first tile: nothing to carry (-inf for a row that sees no key)\n"
_M_OLD = ("            T.copy(m_cur, m_prev)\n"
          "            T.reduce_max(acc_s, m_cur, dim=1, clear=False)\n"
          "            for i in T.Parallel(WG_ROWS):\n")
_M_NEW = ("            T.reduce_max(acc_s, m_prev, dim=1, clear=True)  # this tile's row max\n"
          "            for i in T.Parallel(WG_ROWS):\n                m_prev[i] = T.max(m_prev[i], m_cur[i])  # the new running max\n")


# A variant's edit is a text edit (old, new, flags...) of the rendered source, or a dict of spec
# fields to render with: the generator's own choices (steady_loop = "split") are not rewritten here.
_SPLIT = {"steady_loop": "split"}  # first edit of the variants measured on the two-loop text


VARIANTS: dict[str, tuple[str, list[tuple]]] = {
    "baseline": ("the rendered source as it is", []),
    "split-masked-loop": (
        "DIAGNOSTIC, the same values: the spec with steady_loop = \"split\" (an unmasked copy of the steady loop over "
        "the whole tiles, then a masked copy; the seed's form), to measure the one loop against it in the same run; "
        "the variants below that start with it were measured on that text",
        [_SPLIT],
    ),
    "undo-cold-build-edits": (
        "DIAGNOSTIC, the same values: the prologue and the causal masks as emitted before issue 9's last edits "
        "(fills of row_sum and m_cur, clear=False, a copy loop; q0 + row0 + i + causal_offset in every element), "
        "to measure those edits in the same run",
        [
            _SPLIT,
            ("        T.fill(alpha, 1.0)  # the first carried rescale is a no-op\n",
             "        T.fill(row_sum, 0)\n"
             "        T.fill(alpha, 1.0)  # the first carried rescale is a no-op\n"
             "        T.fill(m_cur, -T.infinity(ACCUM))\n"),
            (_MASK0,
             "        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile\n"
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(q0 + row0 + i + causal_offset >= j, acc_s[i, j], -T.infinity(ACCUM))\n"),
            (_REDUCE0, "        T.reduce_max(acc_s, m_cur, dim=1, clear=False)\n"),
            ("        T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's\n",
             "        T.reduce_sum(acc_s, row_sum_tile, dim=1)\n"
             "        for i in T.Parallel(WG_ROWS):\n"
             "            row_sum[i] = row_sum_tile[i]\n"),
            ("            diag = q0 + row0 + causal_offset - k * BLOCK_N  # row i of tile k sees keys j <= i + diag\n"
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(i + diag >= j, acc_s[i, j], -T.infinity(ACCUM))\n",
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(q0 + row0 + i + causal_offset >= k * BLOCK_N + j, acc_s[i, j], "
             "-T.infinity(ACCUM))\n"),
        ],
    ),
    "hoist-row-max": (
        "the -inf guard on the row max, computed once per row into a fragment instead of per element",
        [
            _SPLIT,
            ("        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)\n",
             "        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)\n"
             "        m_scaled = T.alloc_fragment([WG_ROWS], ACCUM)  # m_cur * scale_log2, 0 for a row that saw no key\n"),
            (f"{_REDUCE0}"
             f"        for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             f"            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - {_GUARD})\n",
             f"{_REDUCE0}"
             f"        for i in T.Parallel(WG_ROWS):\n"
             f"            m_scaled[i] = {_GUARD}\n"
             f"        for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             f"            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_scaled[i])\n"),
            (f"            for i in T.Parallel(WG_ROWS):\n"
             f"                alpha[i] = T.exp2(m_prev[i] * scale_log2 - {_GUARD})\n"
             f"            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             f"                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - {_GUARD})\n",
             f"            for i in T.Parallel(WG_ROWS):\n"
             f"                m_scaled[i] = {_GUARD}\n"
             f"                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_scaled[i])\n"
             f"            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             f"                acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - m_scaled[i])\n"),
        ],
    ),
    "prologue-mask-always": (
        "the prologue masks tile 0 unconditionally (a no-op where full_tiles >= 1) instead of under `if full_tiles < 1`",
        [
            (_MASK0,
             "        diag0 = q0 + row0 + causal_offset\n"
             "        for i, j in T.Parallel(WG_ROWS, BLOCK_N):  # tile 0: a no-op unless it is a diagonal or partial tile\n"
             "            acc_s[i, j] = T.if_then_else(i + diag0 >= j, acc_s[i, j], -T.infinity(ACCUM))\n"),
        ],
    ),
    "diag-no-prologue-mask": (
        "DIAGNOSTIC, changes the kernel (wrong for rows whose tile 0 is diagonal): no prologue mask at all",
        [
            (_MASK0,
             ""),
        ],
    ),
    "diag-no-epilogue-fence": (
        "DIAGNOSTIC, changes the kernel (races the TMA store): no fence_proxy_async and no epilogue barrier",
        [
            ("        T.fence_proxy_async()  # each thread's O_shared stores must be visible to the TMA engine...\n", ""),
            ("        T.sync_threads(EPILOGUE_BAR + g, WARPGROUP_THREADS)  # ...and all 128 done before one thread issues the store\n", ""),
        ],
    ),
    "mask-key-limit": (
        "the last key each row sees, in a per-row int32 fragment computed once; both masks compare key_limit[i] >= k * BLOCK_N + j",
        [
            _SPLIT,
            ("        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)\n",
             "        row_sum = T.alloc_fragment([WG_ROWS], ACCUM)\n"
             "        key_limit = T.alloc_fragment([WG_ROWS], \"int32\")  # row i sees keys j <= key_limit[i]\n"),
            (_MASK0,
             "        for i in T.Parallel(WG_ROWS):\n"
             "            key_limit[i] = q0 + row0 + i + causal_offset\n"
             "        if full_tiles < 1:  # tile 0 is itself a diagonal or partial tile\n"
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(key_limit[i] >= j, acc_s[i, j], -T.infinity(ACCUM))\n"),
            ("            diag = q0 + row0 + causal_offset - k * BLOCK_N  # row i of tile k sees keys j <= i + diag\n"
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(i + diag >= j, acc_s[i, j], -T.infinity(ACCUM))\n",
             "            for i, j in T.Parallel(WG_ROWS, BLOCK_N):\n"
             "                acc_s[i, j] = T.if_then_else(key_limit[i] >= k * BLOCK_N + j, acc_s[i, j], -T.infinity(ACCUM))\n"),
        ],
    ),
    "fuse-max-copy": (
        "steady state: the tile's row max reduces into m_prev (clear=True) and one loop makes the new max, alpha and m_cur; "
        "no T.copy(m_cur, m_prev) (max is exact: same values bit for bit)",
        [
            _SPLIT,
            (f"{_M_OLD}                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_cur[i] * scale_log2)\n",
             f"{_M_NEW}                alpha[i] = T.exp2(m_cur[i] * scale_log2 - m_prev[i] * scale_log2)\n"
             "                m_cur[i] = m_prev[i]\n", "all"),
            (f"{_M_OLD}                alpha[i] = T.exp2(m_prev[i] * scale_log2 - {_GUARD})\n",
             f"{_M_NEW}                alpha[i] = T.exp2(m_cur[i] * scale_log2 - {_GUARD.replace('m_cur', 'm_prev')})\n"
             "                m_cur[i] = m_prev[i]\n",
             "optional"),  # the dynamic kernel's masked loop guards a row that saw no key
        ],
    ),
    "cfg-io-aware": (
        "pass config: tl.layout_cost_model = \"io-aware\" (default \"register-count\")",
        [("    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,\n",
          "    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,\n    tilelang.PassConfigKey.TL_LAYOUT_COST_MODEL: \"io-aware\",\n")],
    ),
    "cfg-no-unswitch": (
        "pass config: tl.disable_loop_unswitching = True",
        [("    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,\n",
          "    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,\n    tilelang.PassConfigKey.TL_DISABLE_LOOP_UNSWITCHING: True,\n")],
    ),
    "plain-n-tiles": (
        "n_tiles without the T.max(..., 1) clamp in the ceildiv: min(ceildiv(kv_len), max(ceildiv(q0 + BLOCK_M + offset), 1))",
        [
            ("n_tiles = T.min(T.ceildiv(kv_len, BLOCK_N), T.ceildiv(T.max(q0 + BLOCK_M + causal_offset, 1), BLOCK_N))",
             "n_tiles = T.min(T.ceildiv(kv_len, BLOCK_N), T.max(T.ceildiv(q0 + BLOCK_M + causal_offset, BLOCK_N), 1))"),
        ],
    ),
    "row-sum-in-reduce": (
        "the carried row sum is rescaled in the alpha loop and the tile's sum reduces straight into it "
        "(reduce_sum clear=False adds the tile's sum, as the update loop did); no row_sum_tile, no update loop",
        [
            _SPLIT,
            ("        row_sum_tile = T.alloc_fragment([WG_ROWS], ACCUM)\n", ""),
            ("                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_cur[i] * scale_log2)\n",
             "                alpha[i] = T.exp2(m_prev[i] * scale_log2 - m_cur[i] * scale_log2)\n"
             "                row_sum[i] *= alpha[i]\n", "all", "optional"),
            (f"                alpha[i] = T.exp2(m_prev[i] * scale_log2 - {_GUARD})\n",
             f"                alpha[i] = T.exp2(m_prev[i] * scale_log2 - {_GUARD})\n"
             "                row_sum[i] *= alpha[i]\n", "all", "optional"),
            ("            T.reduce_sum(acc_s, row_sum_tile, dim=1)\n",
             "            T.reduce_sum(acc_s, row_sum, dim=1, clear=False)\n", "all"),
            ("            for i in T.Parallel(WG_ROWS):\n"
             "                row_sum[i] = row_sum[i] * alpha[i] + row_sum_tile[i]\n", "", "all"),
        ],
    ),
    "prologue-cast-in-exp": (
        "the prologue's exp loop also writes P into p_reg (no PV reads p_reg yet); no T.copy(acc_s, p_reg) there",
        [
            _SPLIT,
            ("        T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's\n"
             "        T.copy(acc_s, p_reg)\n",  # the line before is the body of the prologue's exp loop
             "            p_reg[i, j] = acc_s[i, j]\n"
             "        T.reduce_sum(acc_s, row_sum, dim=1)  # the running sum starts at tile 0's\n"),
        ],
    ),
    "epilogue-divide": (
        "the epilogue's zero-row guard as a per-row reciprocal fragment",
        [
            ("        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):\n"
             "            acc_o[i, j] = T.if_then_else(row_sum[i] == 0, 0, acc_o[i, j] / row_sum[i])  # a row that sees no key gives 0\n",
             "        for i in T.Parallel(WG_ROWS):\n"
             "            row_sum[i] = T.if_then_else(row_sum[i] == 0, 0, 1 / row_sum[i])  # a row that sees no key gives 0\n"
             "        for i, j in T.Parallel(WG_ROWS, HEAD_DIM):\n"
             "            acc_o[i, j] *= row_sum[i]\n"),
        ],
    ),
}


# Extra nvcc flags to measure on the default kernel's CUDA (--nvcc-variants): name -> flags added
# to the build's own command (attngen.build.nvcc.nvcc_command). The SASS must stay identical.
NVCC_VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "split-compile": ["--split-compile=0"],
}


def nvcc_variants(cu: Path, flags: list, rounds: int) -> None:
    """nvcc CPU seconds (children's rusage) per variant, interleaved; SASS compared with the baseline's."""
    import resource

    from attngen.build import toolchain
    from attngen.build.nvcc import nvcc_command

    tc = toolchain.current()
    sass, cpu = {}, {name: [] for name in NVCC_VARIANTS}
    for _ in range(rounds):
        for name, extra in NVCC_VARIANTS.items():
            cmd = nvcc_command(cu, cu.with_suffix(f".{name}.cubin"), flags)
            cmd[1:1] = extra
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=tc.subprocess_env())
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if proc.returncode != 0:
                print(f"  nvcc {name}: failed: {proc.stderr.strip()[-300:]}")
                continue
            cpu[name].append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
            dump = subprocess.run([tc.cuobjdump, "--dump-sass", str(cu.with_suffix(f".{name}.cubin"))],
                                  capture_output=True, text=True, env=tc.subprocess_env()).stdout
            sass[name] = hashlib.sha256(dump.encode()).hexdigest()[:12]
    print("\n| nvcc variant | extra flags | CPU min (s) | CPU median (s) | SASS same as baseline |")
    print("| --- | --- | --- | --- | --- |")
    for name, extra in NVCC_VARIANTS.items():
        if cpu[name]:
            print(f"| {name} | {' '.join(extra) or '-'} | {min(cpu[name]):.2f} | {statistics.median(cpu[name]):.2f} "
                  f"| {sass.get(name) == sass.get('baseline')} |")


def extract_seed(notes: Path) -> str:
    """The seed kernel's code from the notes: from its module docstring to `return main`."""
    lines = notes.read_text(encoding="utf-8").splitlines(True)
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith('"""') and "FA3" in line)
        end = next(i for i in range(start, len(lines)) if lines[i].rstrip() == "    return main")
    except StopIteration:
        raise SystemExit(f"build_time.py: no seed kernel (a docstring mentioning FA3 ... `return main`) in {notes}") from None
    return "".join(lines[start:end + 1])


def variant_edits(variant: str) -> list:
    """The edits of a variant; "a+b" applies a's edits, then b's."""
    return [e for name in variant.split("+") for e in VARIANTS[name][1]]


def variant_spec(spec, variant: str):
    """The spec a variant renders: its spec-field edits applied (the spec itself for text-only variants)."""
    fields = {k: v for edit in variant_edits(variant) if isinstance(edit, dict) for k, v in edit.items()}
    return dataclasses.replace(spec, **fields) if fields else spec


def apply_variant(source: str, variant: str) -> tuple[str, int]:
    """The source with the variant's text edits; also how many applied (0 where none matched)."""
    applied = 0
    for edit in variant_edits(variant):
        if isinstance(edit, dict):  # spec fields: render_variant renders with them
            continue
        old, new, *flags = edit
        count = source.count(old)
        if count > 1 and "all" not in flags:
            raise SystemExit(f"build_time.py: variant {variant}: an edit matches {count} times; make it unique")
        if count:
            source, applied = source.replace(old, new), applied + ("optional" not in flags)
    return source, applied


def render_variant(spec, shape, variant: str) -> tuple[str, int]:
    """The variant's source for `spec` at `shape` (None: dynamic), and how many of its edits applied:
    a spec-field edit applies where it changes the planned kernel (make_plan folds a split of a loop
    that has no masked tile back into one loop)."""
    from attngen.kernels.fwd.plan import make_plan
    from attngen.kernels.fwd.render import render_source

    edited = variant_spec(spec, variant)
    applied = int(make_plan(edited).spec != make_plan(spec).spec)
    source, text_applied = apply_variant(render_source(edited, shape), variant)
    return source, applied + text_applied


def required_edits(variant: str) -> int:
    return sum(isinstance(edit, dict) or "optional" not in edit[2:] for edit in variant_edits(variant))


def default_spec():
    from attngen.spec import load

    return load(ROOT / "examples" / "default.toml")


def rendered(kind: str, variant: str) -> tuple[str, int]:
    from attngen.kernels.common.plan import Shape

    return render_variant(default_spec(), Shape(*SEED_SHAPE) if kind == "static" else None, variant)


def worker(kind: str, variant: str, notes: Path, profile: bool, cu_out: str | None) -> dict:
    """One cold lowering in this (fresh) process; prints nothing, returns the figures."""
    from attngen.build.lower import import_tilelang, load_module, lower_prim_func, TARGET

    t_import = import_tilelang()
    from tvm.target import Target

    if kind == "seed":
        module = load_module(extract_seed(notes), "fa3_seed")
        pass_configs, flags, applied = module._pc, module._cf, 0
        build = lambda: module.fa3_prefill.get_tir(*SEED_SHAPE, 128, "float16")  # noqa: E731
    else:
        source, applied = rendered(kind, variant)
        module = load_module(source, f"default_{kind}")
        pass_configs, flags, build = module.PASS_CONFIGS, list(module.COMPILE_FLAGS), module.build_kernel
    c0, t0 = time.process_time(), time.perf_counter()
    with Target(TARGET):
        prim_func = build()
    t1 = time.perf_counter()
    artifact, passes = lower_prim_func(prim_func, pass_configs, profile=profile)
    c2, t2 = time.process_time(), time.perf_counter()
    cuda = artifact.kernel_source
    if cu_out:
        Path(cu_out).write_text(cuda)
    return {"kernel": kind, "variant": variant, "edits": applied, "import_s": t_import, "tir_s": t1 - t0, "passes_s": t2 - t1,
            "lower_s": t2 - t0, "lower_cpu_s": c2 - c0,
            "cuda_sha": hashlib.sha256(cuda.encode()).hexdigest()[:12], "cuda_lines": cuda.count("\n"),
            "passes": passes, "compile_flags": flags}


def run_worker(kind, variant, args, cu_out=None) -> dict:
    cmd = [sys.executable, __file__, "--worker", kind, "--variant", variant, "--notes", str(args.notes)]
    cmd += ["--profile"] if args.profile else []
    cmd += ["--cu-out", cu_out] if cu_out else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build_time.py: lowering {kind}/{variant} failed:\n{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_nvcc(cu: Path, flags: list) -> float:
    from attngen.build.nvcc import nvcc_command
    from attngen.build import toolchain

    t0 = time.perf_counter()
    proc = subprocess.run(nvcc_command(cu, cu.with_suffix(".cubin"), flags),
                          capture_output=True, text=True, env=toolchain.current().subprocess_env())
    if proc.returncode != 0:
        raise SystemExit(f"build_time.py: nvcc failed on {cu}:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


VERIFY_SHAPES = [(200, 333), (333, 200), (1, 1), (128, 217), (239, 1)]  # (q_len, kv_len): Sq < Skv, Sq > Skv, odd


def verify(variant: str, cache_dir: Path) -> bool:
    """A variant is worth moving into the template only if it builds to the same resources and
    the CPU model still matches the fp64 reference: build it (dynamic) beside the text it edits
    (the emitted one, or the two-loop text for a variant that starts from it) and compare the
    reports, then emulate it at odd shapes (causal offsets both ways)."""
    from attngen.build.nvcc import build_source
    from attngen.emulator import emulate
    from attngen.kernels.fwd.plan import make_plan
    from attngen.reference.forward import check_close, random_inputs
    from attngen.spec import load

    spec = load(ROOT / "examples" / "default.toml")
    keys = ("registers", "spill_store_bytes", "spill_load_bytes", "stack_frame_bytes", "dynamic_smem_bytes", "static_smem_bytes",
            "setmaxnreg_applied", "sass")
    edits = variant_edits(variant)
    base = "split-masked-loop" if edits and edits[0] is _SPLIT and variant != "split-masked-loop" else "baseline"
    reports = {}
    for v in (base, variant):
        plan = make_plan(variant_spec(spec, v))  # the prim_func's name: a spec-field edit renames it
        r = build_source(rendered("dynamic", v)[0], plan.name, plan.compile_flags, cache_dir=cache_dir).report
        reports[v] = {k: r[k] for k in keys}
        print(f"  {v}: {reports[v]}")
    same = reports[base] == reports[variant]
    print(f"  build report {'identical' if same else 'DIFFERS'}")
    ok = same
    source = rendered("dynamic", variant)[0]
    for q_len, kv_len in VERIFY_SHAPES:
        q, k, v = random_inputs(spec.dtype, spec.head_dim, 1, 2, 2, q_len, kv_len, 0)
        out = emulate(variant_spec(spec, variant), q, k, v, seed=0, source=source)
        res = check_close(out, q, k, v, spec.causal, dtype=spec.dtype)
        print(f"  CPU model Sq={q_len} Skv={kv_len}: {res}")
        ok &= res.ok
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notes", type=Path, default=DEFAULT_NOTES, help=f"the seed notes (default: {DEFAULT_NOTES})")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each kernel (fresh processes, interleaved)")
    ap.add_argument("--variant", action="append", help="emitted-source variant(s) to measure besides baseline (repeatable)")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of seed,static,dynamic")
    ap.add_argument("--profile", action="store_true", help="print the slowest passes of each kernel (TVM pass timing)")
    ap.add_argument("--nvcc", action="store_true", help="also time nvcc (the build's command) on each kernel's CUDA")
    ap.add_argument("--verify", metavar="VARIANT",
                    help="build VARIANT beside the baseline, compare resources, run it on the CPU model; stop")
    ap.add_argument("--nvcc-variants", action="store_true", help="time nvcc flag variants on the dynamic kernel (NVCC_VARIANTS) and stop")
    ap.add_argument("--json", type=Path, help="write every measurement here")
    ap.add_argument("--list", action="store_true", help="list the variants and stop")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cu-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.list:
        for name, (what, edits) in VARIANTS.items():
            print(f"{name}: {what} ({len(edits)} edit(s))")
        return 0
    variants = ["baseline"] + [v for v in (args.variant or []) if v != "baseline"]
    for v in (name for variant in variants for name in variant.split("+")):
        if v not in VARIANTS:
            raise SystemExit(f"build_time.py: unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    if args.worker:
        print(json.dumps(worker(args.worker, args.variant[0] if args.variant else "baseline", args.notes, args.profile, args.cu_out)))
        return 0
    if args.verify:
        import tempfile

        ok = verify(args.verify, Path(tempfile.mkdtemp(prefix="build_time-verify-")))
        print(f"{args.verify}: {'same resources, CPU model matches the reference' if ok else 'REJECTED'}")
        return 0 if ok else 1
    if args.nvcc_variants:
        import tempfile

        cu = Path(tempfile.mkdtemp(prefix="build_time-")) / "dynamic.cu"
        res = run_worker("dynamic", "baseline", args, str(cu))
        nvcc_variants(cu, res["compile_flags"], args.rounds)
        return 0
    if not args.notes.is_file():
        raise SystemExit(f"build_time.py: seed notes not found: {args.notes} (give --notes PATH)")
    kernels = [k for k in args.kernels.split(",") if k]
    jobs = [(k, v) for k in kernels for v in (["baseline"] if k == "seed" else variants)]
    for k, v in list(jobs):  # a variant is measured on a kernel only where all its edits apply
        if k != "seed" and rendered(k, v)[1] != required_edits(v):
            print(f"variant {v} does not apply to the {k} kernel (its old text is not there): skipped")
            jobs.remove((k, v))

    import tempfile

    from attngen.build import toolchain

    tmp = Path(tempfile.mkdtemp(prefix="build_time-"))
    results: list[dict] = []
    print(f"seed notes: {args.notes}; {args.rounds} round(s) of {len(jobs)} cold lowering(s), one fresh process each", flush=True)
    for r in range(args.rounds):
        for kind, variant in jobs:
            cu = str(tmp / f"{kind}-{variant}.cu") if args.nvcc and r == 0 else None
            res = run_worker(kind, variant, args, cu)
            res["round"] = r
            if cu:
                res["nvcc_s"] = time_nvcc(Path(cu), res["compile_flags"])
            results.append(res)
            print(f"  round {r + 1}: {kind:8s} {variant:16s} lower {res['lower_s']:6.2f} s wall, {res['lower_cpu_s']:6.2f} s CPU "
                  f"(TIR {res['tir_s']:.2f}, passes+codegen {res['passes_s']:.2f}; import {res['import_s']:.2f})"
                  + (f", nvcc {res['nvcc_s']:.2f} s" if "nvcc_s" in res else ""), flush=True)

    def figures(kind, variant, key):
        return [x[key] for x in results if x["kernel"] == kind and x["variant"] == variant]

    print()
    print("Lowering seconds (TIR + passes + CUDA codegen; import excluded). CPU time is the process's own,")
    print("which load from other processes disturbs far less than wall time; ratios are to the seed of this run.")
    print()
    print("| kernel | variant | wall min | wall median | CPU min | CPU median | CPU median / seed | wall min / seed | CUDA sha | edits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    seed_cpu, seed_wall = figures("seed", "baseline", "lower_cpu_s"), figures("seed", "baseline", "lower_s")
    for kind, variant in jobs:
        wall, cpu = figures(kind, variant, "lower_s"), figures(kind, variant, "lower_cpu_s")
        first = next(x for x in results if x["kernel"] == kind and x["variant"] == variant)
        r_cpu = f"{statistics.median(cpu) / statistics.median(seed_cpu):.2f}" if seed_cpu else "-"
        r_wall = f"{min(wall) / min(seed_wall):.2f}" if seed_wall else "-"
        print(f"| {kind} | {variant} | {min(wall):.2f} | {statistics.median(wall):.2f} | {min(cpu):.2f} | {statistics.median(cpu):.2f} "
              f"| {r_cpu} | {r_wall} | {first['cuda_sha']} | {first['edits']} |")
    nv = [(x["kernel"], x["variant"], x["nvcc_s"]) for x in results if "nvcc_s" in x]
    if nv:
        print("\nnvcc (the build's command, round 1): " + ", ".join(f"{k}/{v} {t:.2f} s" for k, v, t in nv))
    imports = [x["import_s"] for x in results]
    print(f"\nimport tilelang (every cold process pays it, not counted above): "
          f"min {min(imports):.2f} s, median {statistics.median(imports):.2f} s")
    try:
        tc = toolchain.current()
        print(f"toolchain: {tc.kind} nvcc {tc.version}; {os.cpu_count()} CPUs; load average at the end {os.getloadavg()[0]:.2f}")
    except toolchain.ToolchainError as e:
        print(f"toolchain: {e}")
    if args.profile:
        print("\nSlowest passes, CPU seconds (median over rounds; a pass that runs several times is summed;")
        print("'other' is the rest of the lowering: building the TIR and CUDA codegen):")
        for kind, variant in jobs:
            runs = [x for x in results if x["kernel"] == kind and x["variant"] == variant and x["passes"]]
            totals: dict[str, list] = {}
            for x in runs:
                per: dict[str, float] = {}
                for name, cpu, _wall in x["passes"]:
                    per[name] = per.get(name, 0.0) + cpu
                per["other"] = x["lower_cpu_s"] - sum(c for _, c, _ in x["passes"])
                for name, sec in per.items():
                    totals.setdefault(name, []).append(sec)
            top = sorted(((statistics.median(v), k) for k, v in totals.items()), reverse=True)[:9]
            print(f"  {kind}/{variant}: " + ", ".join(f"{k} {sec:.2f}" for sec, k in top))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
