"""The mutation score in CI size: systematic mutants of the default preset must be caught.

bench/mutation_score.py runs every mutant of three presets (docs/emulator.md, "Mutation
score"); here a deterministic half of the default preset's mutants runs through the same
runner, and each must be caught (hazard, deadlock, numeric or error) or be a documented
equivalent. The generator and the equivalence list are checked without emulating.
"""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import attngen
from attngen.emulator.mutants import ARRIVES, BARRIERS, EQUIVALENT, FENCES, PARITY_WAITS, equivalent, generate, strengthens

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ["examples/default.toml", "examples/hd64_bf16_gqa4_c3.toml", "examples/hd64_f16_full_nopp.toml"]


def bench_module():
    spec = importlib.util.spec_from_file_location("mutation_score", ROOT / "bench" / "mutation_score.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def preset(path):
    spec = attngen.load_spec(ROOT / path)
    return spec, attngen.render_source(spec)


@pytest.fixture(scope="module")
def default():
    return preset(PRESETS[0])


def backward_preset(path):
    from attngen.kernels.bwd.render import render_backward_source

    spec = attngen.load_spec(ROOT / path)
    return spec, render_backward_source(spec)


@pytest.fixture(scope="module")
def all_mutants():
    out = {path: (spec, generate(src)) for path in PRESETS for spec, src in [preset(path)]}
    out[PRESETS[0] + " (backward)"] = (lambda spec, src: (spec, generate(src)))(*backward_preset(PRESETS[0]))
    return out


def t_calls(source, names):
    """Lines of `T.<name>(...)` statements for the given names."""
    tree = ast.parse(source)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.Attribute) and n.value.func.attr in names]


def test_every_synchronization_statement_and_bound_is_mutated(default):
    _, source = default
    mutants = generate(source)
    by_op = {}
    for m in mutants:
        by_op.setdefault(m.op, []).append(m)
    drops = t_calls(source, ARRIVES | BARRIERS | FENCES)
    assert sorted(m.line for m in by_op["drop"]) == sorted(drops) and len(drops) >= 14
    parities = t_calls(source, PARITY_WAITS)
    assert sorted(m.line for m in by_op["parity"]) == sorted(parities) and len(parities) >= 7
    wgmma_waits = t_calls(source, {"wait_wgmma"})
    assert sorted(m.line for m in by_op["depth+1"]) == sorted(wgmma_waits)
    assert len(by_op["depth-1"]) == sum(1 for ln in wgmma_waits if "wait_wgmma(0)" not in source.splitlines()[ln - 1])
    # every sync statement that has a neighbour in its block is moved across it, both ways
    lines = source.splitlines()
    moved = set()
    for m in by_op["move-up"] + by_op["move-down"]:
        moved |= {i + 1 for i, (a, b) in enumerate(zip(lines, m.source.splitlines())) if a != b}
    with_neighbours = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and len(body) > 1:
            with_neighbours |= {s.lineno for s in body}
    syncs = set(t_calls(source, ARRIVES | BARRIERS | FENCES | PARITY_WAITS | {"wait_wgmma"}))
    assert syncs & with_neighbours <= moved and len(syncs - with_neighbours) <= 1  # the primer is alone in its `if`
    bounds = [m.id for m in by_op["bound"]]
    assert any(">= j -> " in b for b in bounds) and any("bound n_tiles - 1" in b for b in bounds)
    assert any("bound k >= full_tiles -> k > full_tiles" in b for b in bounds) and any("bound full_tiles" in b for b in bounds)
    # ids are unique, every mutant parses, differs from the original, and keeps the line count
    assert len({m.id for m in mutants}) == len(mutants)
    for m in mutants:
        ast.parse(m.source)
        assert m.source != source and len(m.source.splitlines()) == len(source.splitlines())


def test_a_move_swaps_whole_statements_in_place(default):
    _, source = default
    m = next(m for m in generate(source) if m.id.startswith("move-up T.wait_wgmma(0) over T.reduce_sum("))
    old, new = source.splitlines(), m.source.splitlines()
    changed = [i for i, (a, b) in enumerate(zip(old, new)) if a != b]
    assert len(changed) == 2 and changed[1] == changed[0] + 1
    assert new[changed[0]] == old[changed[1]] and new[changed[1]] == old[changed[0]]
    assert "T.wait_wgmma(0)" in new[changed[0]] and "T.reduce_sum" in new[changed[1]]


def test_every_equivalence_entry_is_used_and_stronger_ones_only_add_ordering(all_mutants):
    used = set()
    for spec, mutants in all_mutants.values():
        for m in mutants:
            for pattern, reason, cond in EQUIVALENT:
                if re.search(pattern, m.id):
                    used.add(pattern)
                    if reason == "stronger":  # checked on the code, not just claimed
                        assert strengthens(m), m.id
                    break
    assert used == {p for p, _, _ in EQUIVALENT}, "stale entries"


def test_conditions_of_equivalence_follow_the_spec(all_mutants):
    spec, mutants = all_mutants[PRESETS[0]]
    early_k = next(m for m in mutants if m.id == "move-down T.wait_wgmma(0) under T.mbarrier_arrive(k_empty[0])")
    assert equivalent(early_k, spec) is None  # K_STAGES = V_STAGES: the prologue's early release is a race
    nopp_spec, nopp = all_mutants[PRESETS[2]]
    early_k = next(m for m in nopp if m.id == "move-down T.wait_wgmma(0) under T.mbarrier_arrive(k_empty[0])")
    assert equivalent(early_k, nopp_spec) == "k-release-ordered-by-v"  # K_STAGES = 2 > V_STAGES = 1


@pytest.mark.expensive
def test_ci_subset_of_default_mutants_is_caught_or_documented_equivalent(default):
    """Half of the default preset's mutants (every second one, in source order), on the
    bench's runs; the unmodified kernel passes them all first."""
    spec, source = default
    ms = bench_module()
    runner = ms.Runner(spec)
    for run in runner.runs:
        assert runner.run_once(source, run) == "pass", run
    subset = generate(source)[::2]
    assert len(subset) >= 35
    outcomes = {}
    for m in subset:
        outcome, detail, _ = runner.classify(m.source)
        outcomes[m.id] = outcome
        if outcome == "survived":
            assert equivalent(m, spec), f"survived and not a documented equivalent: {m.describe()}"
        else:
            assert not detail.startswith("KERNEL ERROR: TypeError"), detail  # a broken generator, not a caught mutant
    caught = [i for i, o in outcomes.items() if o != "survived"]
    assert {"hazard", "deadlock", "numeric"} <= set(outcomes.values()) and len(caught) >= 20


def test_the_backward_modules_tile_ranges_are_mutated():
    """The backward's q_first, n_q, full_first and full_stop count as tile counts (mutants.TILE_NAME)."""
    _, source = backward_preset(PRESETS[0])
    ids = [m.id for m in generate(source) if m.op == "bound"]
    for name in ("q_first", "n_q", "full_first", "full_stop"):
        assert any(i.startswith(f"bound {name} + 1 in {name} = ") for i in ids), name
    assert any("q_tile < full_first -> q_tile <= full_first" in i for i in ids)


@pytest.mark.expensive
def test_ci_subset_of_backward_mutants_is_caught_or_documented_equivalent():
    """Every third mutant of the default preset's backward module on the bench's backward runs
    (emulate_backward, check_grads); the unmodified module passes them all first."""
    spec, source = backward_preset(PRESETS[0])
    ms = bench_module()
    runner = ms.BackwardRunner(spec)
    for run in runner.runs:
        assert runner.run_once(source, run) == "pass", run
    subset = generate(source)[::3]
    assert len(subset) >= 20
    outcomes = {}
    for m in subset:
        outcome, detail, _ = runner.classify(m.source)
        outcomes[m.id] = outcome
        if outcome == "survived":
            assert equivalent(m, spec), f"survived and not a documented equivalent: {m.describe()}"
        else:
            assert not detail.startswith("KERNEL ERROR: TypeError"), detail
    caught = [i for i, o in outcomes.items() if o != "survived"]
    assert {"hazard", "deadlock"} <= set(outcomes.values()) and len(caught) >= 12
