"""steady_loop = "split": the seed's two copies of the steady loop, on the CPU model, and the field itself.

Each kernel below is the emitted split-form source run on the CPU model (attngen.emulate's
check_emulated) against the fp64 reference: causal with rows that see no key, unaligned lengths,
windows (with the left edge's masked copy first), variants, serving layouts. The mutants show that
those runs notice a masked copy that lost its mask or a split one tile off.
"""

import re
from pathlib import Path

import pytest

import attngen
from attngen.emulator.driver import check_emulated
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec, SpecError, load

ROOT = Path(__file__).resolve().parent.parent
WHOLE = ", split):  # tiles every row sees whole"  # from 1, or from split_lo after a window's cut tiles
MASKED = "for k in T.serial(split, n_tiles):  # diagonal and partial tiles: masked"
LEAD = "for k in T.serial(1, split_lo):  # tiles the window's left edge cuts: masked"

CASES = [
    # spec fields, (batch, heads, kv_heads, q_len, kv_len)
    ({"causal": True}, (1, 2, 2, 300, 200)),  # Sq > Skv: leading rows see no key
    ({"causal": True, "gqa_group": 3, "head_dim": 64, "consumers": 3}, (1, 6, 2, 150, 257)),
    ({"block_n": 64, "k_stages": 3, "v_stages": 1}, (1, 1, 1, 128, 333)),  # not causal: a partial last tile
    ({"causal": True, "window": (100, -1), "head_dim": 64, "block_n": 32}, (1, 1, 1, 200, 400)),  # three loops
    ({"window": (70, 30), "head_dim": 64, "block_n": 32}, (1, 1, 1, 130, 301)),
    ({"causal": True, "softcap": 30.0, "lse": True}, (1, 2, 2, 200, 333)),
    ({"causal": True, "alibi": True, "head_dim": 64, "pingpong": False}, (1, 2, 2, 129, 200)),
    ({"causal": True, "sinks": True, "dtype": "bfloat16", "head_dim": 64}, (1, 2, 2, 77, 190)),
    ({"layout": "varlen", "causal": True, "head_dim": 64}, (1, 2, 2, 150, 257)),
    ({"paged_kv": True, "splits": 3, "causal": True, "gqa_group": 8, "consumers": 1, "dtype": "bfloat16"}, (1, 8, 1, 3, 700)),
    ({"aligned": True, "causal": True, "block_m": 128, "block_n": 128}, (1, 1, 1, 256, 384)),  # the seed's configuration
]


def split_plan(fields):
    return make_plan(Spec(**fields, steady_loop="split"))


@pytest.mark.parametrize("fields, shape", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_split_form_matches_the_reference_on_the_cpu_model(fields, shape):
    plan = split_plan(fields)
    source = render_source(plan)
    assert "_splitloop" in plan.name and plan.name.replace("_splitloop", "") == make_plan(Spec(**fields)).name
    assert WHOLE in source and MASKED in source and "if k >= full_tiles" not in source
    assert (LEAD in source) == ("window" in fields and fields["window"][0] >= 0)
    ok, text, _ = check_emulated(plan, *shape, seed=1)
    assert ok, text


def test_the_split_form_is_the_one_loop_where_there_is_nothing_to_split():
    """No masked tile (aligned, not causal) or every tile masked (mask_mod): both forms are one loop,
    so a split spec plans to the one-loop kernel, with its name and hash."""
    for fields in ({"aligned": True}, {"causal": True, "mask_mod": "kv_idx <= q_idx"}):
        split, one = make_plan(Spec(**fields, steady_loop="split")), make_plan(Spec(**fields))
        assert split.spec.steady_loop == "one" and (split.name, split.hash) == (one.name, one.hash)
        assert render_source(split) == render_source(one)
    plan = make_plan(Spec(causal=True, mask_mod="kv_idx <= q_idx", steady_loop="split"))
    ok, text, _ = check_emulated(plan, 1, 2, 2, 200, 333, seed=1)
    assert ok, text


def drop_mask_after(header):
    """Remove the first mask loop (and its diagonal's binding) after `header`: that copy runs unmasked."""
    def edit(source):
        head, tail = source.split(header, 1)
        tail, n = re.subn(r"( +diag = [^\n]*\n)?( +)for i, j in T\.Parallel\(WG_ROWS, BLOCK_N\):\n\2    acc_s\[i, j\] = "
                          r"T\.if_then_else\([^\n]*\n", "", tail, count=1)
        assert n == 1, "edit no longer applies"
        return head + header + tail
    return edit


def replace(old, new):
    def edit(source):
        assert source.count(old) == 1, "edit no longer applies"
        return source.replace(old, new)
    return edit


MUTANTS = [
    ("causal, the masked copy unmasked", {"causal": True}, (1, 2, 2, 300, 200), drop_mask_after(MASKED)),
    ("a partial last tile unmasked", {"block_n": 64}, (1, 1, 1, 128, 333), drop_mask_after(MASKED)),
    ("the window's cut tiles unmasked", {"causal": True, "window": (100, -1), "head_dim": 64, "block_n": 32},
     (1, 1, 1, 200, 400), drop_mask_after(LEAD)),
    ("the first diagonal tile counted whole", {"causal": True}, (1, 1, 1, 256, 256),
     replace("split = T.max(1, T.min(n_tiles, full_tiles))", "split = T.max(1, T.min(n_tiles, full_tiles + 1))")),
]


@pytest.mark.parametrize("what, fields, shape, edit", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_a_broken_split_fails_on_the_cpu_model(what, fields, shape, edit):
    plan = split_plan(fields)
    ok, text, _ = check_emulated(plan, *shape, seed=1, source=edit(render_source(plan)))
    assert not ok, f"{what}: {text}"


# -- the field ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["two", "Split", 2, True, None])
def test_steady_loop_takes_one_or_split(value):
    with pytest.raises(SpecError) as e:
        Spec(steady_loop=value)
    assert e.value.field == "steady_loop" and '"one"' in str(e.value) and '"split"' in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_the_default_form_changes_no_name_hash_or_header():
    spec = Spec(causal=True)
    assert make_plan(Spec(causal=True, steady_loop="one")).hash == make_plan(spec).hash
    assert "steady_loop" not in render_source(spec)
    split = make_plan(Spec(causal=True, steady_loop="split"))
    assert split.name == make_plan(spec).name + "_splitloop" and split.hash != make_plan(spec).hash
    assert '#   steady_loop = "split"' in render_source(split)


def test_the_seed_parity_preset_is_the_split_form():
    spec = load(ROOT / "examples" / "seed_parity.toml")
    assert spec.steady_loop == "split" and attngen.Spec(**{**spec.to_dict(), "steady_loop": "one"}).steady_loop == "one"
    assert (ROOT / "generated" / f"{make_plan(spec).name}.py").is_file()
