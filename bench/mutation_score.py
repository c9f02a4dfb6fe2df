"""Mutation score of the CPU emulator: how many systematic mutants of a preset's kernel it catches.

    python bench/mutation_score.py [SPEC.toml ...] [--list] [--only SUBSTRING] [-v] [--backward]

For each preset (default: examples/default.toml, examples/hd64_bf16_gqa4_c3.toml,
examples/hd64_f16_full_nopp.toml) the emitted source is mutated by
`attngen.emulator.mutants.generate` (moves, drops, wgmma depths, parities, mask and
tile-count bounds), and each mutant runs on the CPU model under RUNS (two odd shapes, three
schedules) until something catches it: a hazard report, a deadlock, a numeric mismatch with
the fp64 reference, or an error (the mutant does not run, e.g. a name used before it is
assigned). The unmodified kernel must pass every run first. Prints a table per preset,
the survivors with their edit, and which of them are documented equivalents
(docs/emulator.md, "Mutation score"). Figures only: nothing here asserts.

`--backward` scores the spec's backward module instead (render_backward_source; default preset
examples/default.toml): each mutant runs emulate_backward under BACKWARD_RUNS and is caught by a
hazard, a deadlock, an error, or a gradient failing reference.backward.check_grads.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attngen  # noqa: E402
from attngen.emulator import EmulationError, emulate  # noqa: E402
from attngen.emulator.mutants import REASONS, equivalent, generate  # noqa: E402
from attngen.reference.forward import check_close, random_inputs, variant_of  # noqa: E402

PRESETS = ["examples/default.toml", "examples/hd64_bf16_gqa4_c3.toml", "examples/hd64_f16_full_nopp.toml"]
# Runs, in order, until one catches the mutant: ((kv heads, q_len, kv_len), inputs, policy, seed).
# - 256 x 700: several K tiles per block and a partial last one, so every stage is reused and
#   every pipeline barrier goes round more than once; all three schedule policies.
# - 333 x 203: more queries than keys and neither a tile multiple. Causal: block 0's rows see no
#   key at all (the offset is -130 <= -BLOCK_M), and for block 1's second consumer the first row
#   sees keys up to 126 mod 128, two short of a tile end, where an off-by-one in the count of
#   full tiles shows. All three policies.
# - "leak" inputs (q >= 0, k <= 0: every real score is negative, so a zero-filled key beyond
#   kv_len that escapes its mask scores 0 and takes most of the softmax) at 333 x 203 and at
#   77 x 3 (kv_len < BLOCK_N: only the prologue's mask runs). With random inputs one leaked zero
#   key among hundreds moves the output by less than the tolerance.
RUNS = [((1, 256, 700), "random", policy, 0) for policy in ("random", "producer-first", "consumers-first")] \
    + [((1, 333, 203), "random", policy, 0) for policy in ("random", "producer-first", "consumers-first")] \
    + [((1, 333, 203), "leak", "random", 1), ((1, 77, 3), "leak", "random", 1)]
OUTCOMES = ("hazard", "deadlock", "numeric", "error")
BACKWARD_PRESETS = ["examples/default.toml"]
# The backward (BLOCK_M 64, BLOCK_N 128 at hd128): 300 x 330 gives each KV tile up to 5 Q tiles (both
# Q stages reused, every pipeline barrier round more than once) and a partial last KV tile;
# 333 x 203 more queries than keys (causal: the first Q tiles see nothing, n_q = 0 for the last KV
# tile's... none; the diagonal crosses tiles off their boundaries); 77 x 3 one partial KV tile.
# - "ramp" inputs (q >= 0, k >= 0 growing with the key index: each row's weight peaks at its last
#   visible key, so a key just past it that escapes the mask takes much of P); with random inputs
#   one leaked entry among hundreds moves the gradients by less than the tolerance.
BACKWARD_RUNS = [((1, 300, 330), "random", policy, 0) for policy in ("random", "producer-first", "consumers-first")] \
    + [((1, 333, 203), "random", policy, 0) for policy in ("random", "producer-first", "consumers-first")] \
    + [((1, 77, 3), "random", "random", 1), ((1, 333, 203), "ramp", "random", 1), ((1, 300, 330), "ramp", "random", 1)]


def load(path):
    return attngen.load_spec(path)


def render(spec):
    return attngen.render_source(spec)


class Runner:
    """Runs sources of one spec on fixed inputs per shape."""

    def __init__(self, spec, runs=RUNS):
        self.spec, self.runs = spec, runs
        self.inputs = {}
        for shape, kind, _, _ in runs:
            if (shape, kind) not in self.inputs:
                hkv, sq, skv = shape
                q, k, v = random_inputs(spec.dtype, spec.head_dim, 1, hkv * spec.gqa_group, hkv, sq, skv, seed=5)
                if kind == "leak":
                    q, k = np.abs(q), -np.abs(k)
                self.inputs[shape, kind] = q, k, v

    def run_once(self, source, run):
        """'pass' or (outcome, first report line)."""
        shape, kind, policy, seed = run
        q, k, v = self.inputs[shape, kind]
        try:
            out = emulate(self.spec, q, k, v, source=source, policy=policy, seed=seed)
        except EmulationError as e:
            kind = e.kind if e.kind in ("hazard", "deadlock") else "error"
            return kind, e.report.splitlines()[0]
        except Exception as e:  # noqa: BLE001 - a mutant may break anything; that is a catch, not a crash
            return "error", f"{type(e).__name__}: {e}"
        res = check_close(out, q, k, v, self.spec.causal, dtype=self.spec.dtype)
        return "pass" if res.ok else ("numeric", str(res))

    def classify(self, source):
        """(outcome, detail, run) for the first run that catches the source; ('survived', '', None) if none."""
        for run in self.runs:
            got = self.run_once(source, run)
            if got != "pass":
                return got[0], got[1], run
        return "survived", "", None


class BackwardRunner(Runner):
    """Runs backward module sources of one spec (emulate_backward) and checks the gradients."""

    def __init__(self, spec, runs=BACKWARD_RUNS):
        from attngen.emulator.driver import variant_inputs
        from attngen.kernels.fwd.plan import make_plan

        self.spec, self.runs = spec, runs
        self.inputs = {}
        plan = make_plan(spec)
        for shape, kind, _, _ in runs:
            hkv, sq, skv = shape
            q, k, v, tensors = variant_inputs(plan, 1, hkv * spec.gqa_group, hkv, sq, skv, 5)
            if kind == "ramp":
                q, k = np.abs(q), np.abs(k) * np.linspace(0.5, 1.5, skv, dtype=np.float32)[None, :, None, None]
            dout = np.random.default_rng(6).standard_normal(q.shape[:3] + (v.shape[3],)).astype(np.float32)
            variant = variant_of(spec, tensors.get("alibi_slopes"), tensors.get("sinks"),
                                 {n: x for n, x in tensors.items() if n not in ("alibi_slopes", "sinks")})
            self.inputs[shape, kind] = (q, k, v, dout), tensors, variant

    def run_once(self, source, run):
        from attngen.emulator import emulate_backward
        from attngen.reference.backward import check_grads

        shape, kind, policy, seed = run
        args, tensors, variant = self.inputs[shape, kind]
        try:
            grads = emulate_backward(self.spec, *args, source=source, policy=policy, seed=seed, **tensors)
        except EmulationError as e:
            kind = e.kind if e.kind in ("hazard", "deadlock") else "error"
            return kind, e.report.splitlines()[0]
        except Exception as e:  # noqa: BLE001 - a mutant may break anything; that is a catch, not a crash
            return "error", f"{type(e).__name__}: {e}"
        checks = check_grads(dict(zip(("dq", "dk", "dv", "dsinks"), grads)), *args, self.spec.causal,
                             dtype=self.spec.dtype, **variant)
        bad = {n: str(c) for n, c in checks.items() if not c.ok}
        return "pass" if not bad else ("numeric", str(bad))


_RUNNER = None


def _classify(source):  # worker side of --jobs
    return _RUNNER.classify(source)


def score(path, runs=None, only=None, verbose=False, jobs=1, backward=False):
    global _RUNNER
    spec = load(path)
    if backward:
        from attngen.kernels.bwd.render import render_backward_source

        source = render_backward_source(spec)
        runner = _RUNNER = BackwardRunner(spec, runs or BACKWARD_RUNS)
    else:
        source = render(spec)
        runner = _RUNNER = Runner(spec, runs or RUNS)
    runs = runner.runs
    t0 = time.perf_counter()
    for run in runs:  # no false positives: the unmodified kernel passes every run
        got = runner.run_once(source, run)
        if got != "pass":
            raise SystemExit(f"{path}: the unmodified kernel fails {run}: {got}")
    mutants = [m for m in generate(source) if only is None or only in m.id]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            outcomes = pool.map(_classify, [m.source for m in mutants], chunksize=1)
    else:
        outcomes = map(runner.classify, (m.source for m in mutants))
    results = []
    for m, (outcome, detail, run) in zip(mutants, outcomes):
        results.append((m, outcome, detail, run))
        if verbose:
            print(f"  {outcome:9} {m.describe()}" + (f"\n            {detail}  [{run}]" if detail else ""), flush=True)
    return spec, results, time.perf_counter() - t0


def table(rows):
    head = f"{'preset':42} {'mutants':>7} {'hazard':>6} {'deadlock':>8} {'numeric':>7} {'error':>5} " \
           f"{'survived':>8} {'equiv.':>6} {'caught':>7} {'of non-equiv.':>13} {'seconds':>7}"
    print(head)
    for name, results, secs, spec in rows:
        counts = {o: sum(1 for _, out, _, _ in results if out == o) for o in OUTCOMES + ("survived",)}
        caught = sum(counts[o] for o in OUTCOMES)
        equiv = sum(1 for m, out, _, _ in results if out == "survived" and equivalent(m, spec))
        total = len(results)
        raw = 100.0 * caught / max(total, 1)
        adj = 100.0 * caught / max(total - equiv, 1)
        print(f"{name:42} {total:7d} {counts['hazard']:6d} {counts['deadlock']:8d} {counts['numeric']:7d} "
              f"{counts['error']:5d} {counts['survived']:8d} {equiv:6d} {raw:6.1f}% {adj:12.1f}% {secs:7.1f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("specs", nargs="*", default=PRESETS)
    ap.add_argument("--list", action="store_true", help="only list the mutants")
    ap.add_argument("--only", help="only mutants whose id contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every mutant's outcome")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--backward", action="store_true", help="score the backward module (emulate_backward, check_grads)")
    args = ap.parse_args()
    if args.backward and args.specs == PRESETS:
        args.specs = BACKWARD_PRESETS
    print(f"# attngen {attngen.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs, {args.jobs} job(s)")
    print("# runs per mutant, until one catches it: ((kv heads, q_len, kv_len), inputs, policy, seed)")
    for run in BACKWARD_RUNS if args.backward else RUNS:
        print(f"#   {run}")
    if args.list:
        from attngen.kernels.bwd.render import render_backward_source

        for path in args.specs:
            for m in generate((render_backward_source if args.backward else render)(load(path))):
                print(f"{path}: {m.op:9} {m.describe()}")
        return
    rows, survivors = [], []
    for path in args.specs:
        print(f"## {path}", flush=True)
        spec, results, secs = score(path, only=args.only, verbose=args.verbose, jobs=args.jobs, backward=args.backward)
        rows.append((Path(path).name, results, secs, spec))
        survivors += [(path, m, equivalent(m, spec)) for m, out, _, _ in results if out == "survived"]
    print()
    table(rows)
    print()
    print("survivors (documented equivalent: reason key; UNEXPLAINED: a gap in the model or the list):")
    for path, m, reason in survivors:
        print(f"  {Path(path).name}: {m.describe()}\n      -> {reason or 'UNEXPLAINED'}")
    used = sorted({r for _, _, r in survivors if r})
    if used:
        print("\nreasons:")
        for r in used:
            print(f"  {r}: {REASONS[r]}")


if __name__ == "__main__":
    main()
