"""Context parallelism (attngen/distributed.py, docs/distributed.md) on real process groups: W = 2, 3
and 4 gloo processes on CPU tensors (each rank runs the emitted kernels on the CPU model), spawned
once per test with many cases inside (tests/cp_worker.py). Each case's out, LSE, dq, dk and dv,
reassembled by unshard_sequence, are held to the fp64 reference under reference's and
reference.backward's tolerance rules (check_close, check_lse, check_grads). The exact step algebra and
the merge are checked in-process against brute force; the test-only mutants show the checks fail
for a merge without the LSE rescale, zigzag chunks in the wrong order, a dK/dV missing a ring
step and a wrong causal flag."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

from attngen.interfaces import distributed as cp
from attngen import tiles
from attngen.reference.forward import InputError, check_close, check_lse
from attngen.reference.backward import check_grads
from attngen.spec import SpecError

import cp_worker

VARIANTS = [  # (causal, window): none, causal, a window, both
    (False, (-1, -1)), (True, (-1, -1)), (False, (4, 2)), (True, (5, -1))]


def grid(world: int, size: int, variants=VARIANTS, heads=(2, 1), **extra) -> list[dict]:
    """method x load balance x variants, GQA (2 query heads on 1 KV head), chunks of `size` rows."""
    cases = []
    for method in cp.METHODS:
        for lb in cp.LOAD_BALANCES:
            for causal, window in variants:
                seq = cp.num_chunks(world, lb) * size
                cases.append(dict(method=method, load_balance=lb, causal=causal, window=window, seq=seq,
                                  heads=heads[0], kv_heads=heads[1], seed=len(cases), **extra))
    return cases


def failures(case: dict, result: dict) -> dict:
    """{name: verdict} of every check that fails (out, lse, dq, dk, dv); a raised error is one."""
    if "error" in result:
        return {"error": result["error"]}
    q, k, v, dout = cp_worker.inputs(case)
    variant = dict(window=tuple(case.get("window", (-1, -1))), softcap=case.get("softcap", 0.0)) | reference_mask(case)
    causal, dtype, scale = case.get("causal", False), case.get("dtype", "float16"), case.get("scale")
    checks = {"out": check_close(result["out"], q, k, v, causal, dtype=dtype, scale=scale, **variant),
              "lse": check_lse(result["lse"], q, k, v, causal, dtype=dtype, scale=scale, **variant)}
    grads = {n: result[n] for n in ("dq", "dk", "dv")}
    dlse = cp_worker.lse_cotangent(case).numpy().astype(np.float64) if case.get("lse_grad") else None
    checks |= check_grads(grads, q, k, v, dout, causal, dtype=dtype, scale=scale, out=result["out"], dlse=dlse,
                          **variant)
    return {n: str(c) for n, c in checks.items() if not c.ok}


def reference_mask(case: dict) -> dict:
    """The reference's mask_mod and tensors for a case: its global mask_mod, and for cu_seqlens each
    position's document (written here with np.repeat, not from distributed.py) kept to its own."""
    masks, tensors = [], {n: np.asarray(t, np.float64) for n, t in case.get("tensors", {}).items()}
    if "cu_seqlens" in case:
        tensors["document"] = np.repeat(np.arange(len(case["cu_seqlens"]) - 1), np.diff(case["cu_seqlens"])).astype(float)
        masks.append("document[q_idx] == document[kv_idx]")
    if "mask_mod" in case:
        masks.append(case["mask_mod"])
    return {"mask_mod": " and ".join(f"({m})" for m in masks), "tensors": tensors} if masks else {}


def assert_all_pass(cases, results):
    bad = {i: (cases[i], f) for i, r in enumerate(results) if (f := failures(cases[i], r))}
    assert not bad, bad


# -- in-process: the step algebra, the layout, the merge ----------------------------------------------


def globally_visible(i, j, causal, window):
    """Row i sees key j of the whole sequence: i - left <= j <= i + right, causal: j <= i (written
    here from the definition, not from distributed.py)."""
    left, right = window
    vis = np.ones(np.broadcast_shapes(np.shape(i), np.shape(j)), bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    if causal:
        vis &= j <= i
    return vis


def call_cover(calls, rows: int, keys: int) -> np.ndarray:
    """How many times each (local row, block key) is visible to the kernel calls, each call's mask
    being the kernel's own (tiles.visible: bottom-right aligned causal and window)."""
    cover = np.zeros((rows, keys), int)
    for c in calls:
        m, n = c.q1 - c.q0, c.k1 - c.k0
        cover[c.q0:c.q1, c.k0:c.k1] += tiles.visible(np.arange(m)[:, None], np.arange(n)[None, :], m, n,
                                                     tiles.edges(c.causal, c.window))
    return cover


WINDOWS = [(-1, -1), (0, 0), (1, 0), (0, 2), (3, -1), (-1, 2), (2, 1), (5, 5), (12, 0)]


def test_each_step_sees_exactly_the_global_mask():
    """For W = 1..5, both balances, every (rank, source) step and each causal/window: the step's calls
    see each (row, key) of the two ranks' chunks exactly once where the global mask has it, else never;
    a wholly hidden pair has no call, a wholly visible one no mask."""
    for world in range(1, 6):
        for lb in cp.LOAD_BALANCES:
            for causal in (False, True):
                for window in WINDOWS:
                    size = 3
                    for rank in range(world):
                        for src in range(world):
                            qs = cp.segments(cp.chunk_ids(rank, world, lb), size)
                            ks = cp.segments(cp.chunk_ids(src, world, lb), size)
                            calls = cp.step_calls(qs, ks, causal, window)
                            rows = np.concatenate([np.arange(s.start, s.start + s.length) for s in qs])
                            keys = np.concatenate([np.arange(s.start, s.start + s.length) for s in ks])
                            want = globally_visible(rows[:, None], keys[None, :], causal, window)
                            cover = call_cover(calls, len(rows), len(keys))
                            assert np.array_equal(cover, want.astype(int)), (world, lb, causal, window, rank, src, calls)
                            for c in calls:
                                part = want[c.q0:c.q1, c.k0:c.k1]
                                assert part.any(axis=1).all() and part.any(axis=0).all(), c  # trimmed to what is seen
                                if part.all():
                                    assert not c.causal and c.window == (-1, -1), c  # no mask where none is needed


@given(st.integers(1, 9), st.integers(1, 9), st.integers(0, 20), st.integers(0, 20), st.booleans(),
       st.sampled_from(WINDOWS))
def test_a_pair_of_unequal_segments_sees_the_global_mask(m, n, q_start, k_start, causal, window):
    """One (query, key) segment pair of any lengths and offsets (the all-gather's are a chunk against
    the whole sequence)."""
    qs, ks = cp.Segment(q_start, m, 0), cp.Segment(k_start, n, 0)
    call = cp._pair_call(qs, ks, causal, window)
    want = globally_visible(np.arange(q_start, q_start + m)[:, None], np.arange(k_start, k_start + n)[None, :],
                            causal, window)
    assert np.array_equal(call_cover([call] if call else [], m, n), want.astype(int)), call
    from_start = cp._pair_call(qs, ks, causal, window, keys_from_start=True)  # a mask_mod's call: keys from 0
    assert np.array_equal(call_cover([from_start] if from_start else [], m, n), want.astype(int)), from_start
    assert from_start is None or (from_start.k0 == 0 and from_start.q_pos == q_start + from_start.q0)


def causal_work(rank: int, world: int, lb: str, size: int = 4) -> int:
    """The (row, key) pairs rank `rank` computes over all its ring steps under causal."""
    rows = len(cp.chunk_ids(rank, world, lb)) * size
    return sum(int(call_cover(cp.step_calls(cp.segments(cp.chunk_ids(rank, world, lb), size),
                                            cp.segments(cp.chunk_ids(src, world, lb), size), True, (-1, -1)),
                              rows, rows).sum()) for src in range(world))


def test_zigzag_balances_causal_work():
    """Zigzag: rank r holds chunks r and 2W-1-r (odd W too), and under causal every rank computes
    the same number of (row, key) pairs; under contiguous the last rank computes the most."""
    for world in (2, 3, 5):
        assert [cp.chunk_ids(r, world, "zigzag") for r in range(world)] == [[r, 2 * world - 1 - r] for r in range(world)]
        assert len({causal_work(r, world, "zigzag") for r in range(world)}) == 1
        contiguous = [causal_work(r, world, "contiguous") for r in range(world)]
        assert contiguous == sorted(contiguous) and contiguous[0] < contiguous[-1]


def merged(parts):
    """(out, lse) from partial results by _merge, starting from no key (out 0, lse -inf)."""
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    for part_out, part_lse in parts:
        cp._merge(out, lse, slice(0, 3), part_out, part_lse)
    return out, lse


def test_the_merge_is_the_softmax_of_the_union():
    """Against the fp64 direct form (weights exp(lse_i - logsumexp)), with LSEs far past exp's
    range, a row no part sees (0 and -inf, no NaN) and a row only one part sees."""
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(1, 3, 1, 2, generator=g) for _ in range(3)]
    inf = float("-inf")
    lses = [torch.tensor([[[900.0, inf, 3.0]]]), torch.tensor([[[905.0, inf, inf]]]), torch.tensor([[[-2.0, inf, inf]]])]
    out, lse = merged(zip(outs, lses))
    l64 = torch.stack(lses).double()
    want_lse = torch.logsumexp(l64, 0)
    w = torch.nan_to_num(torch.exp(l64 - want_lse), nan=0.0)  # [parts, 1, 1, 3]
    want = sum(w[i].transpose(1, 2).unsqueeze(-1) * outs[i].double() for i in range(3))
    assert torch.allclose(lse.double()[:, :, [0, 2]], want_lse[:, :, [0, 2]], rtol=0, atol=1e-4)
    assert lse[0, 0, 1] == inf and torch.equal(out[:, 1], torch.zeros(1, 1, 2))
    assert torch.allclose(out.double(), want, atol=1e-6) and torch.isfinite(out).all()
    assert torch.equal(out[:, 2], outs[0][:, 2])  # the only part that sees row 2


def test_the_merge_without_the_rescale_is_caught(monkeypatch):
    monkeypatch.setattr(cp, "_TEST_ONLY_MUTANT", "merge_no_rescale")
    outs = [torch.ones(1, 3, 1, 2), 3 * torch.ones(1, 3, 1, 2)]
    out, _ = merged(zip(outs, [torch.zeros(1, 1, 3), torch.zeros(1, 1, 3)]))
    assert not torch.allclose(out, 2 * torch.ones_like(out))  # equal LSEs: the mean, 2


# -- real process groups -------------------------------------------------------------------------------


@pytest.mark.expensive
def test_two_ranks():
    """W = 2: method x balance x (none, causal, window, causal + window), GQA, odd chunks (3 rows),
    batch 2 in one case, a scale and softcap in another; the layout and unshard's gradient."""
    cases = grid(2, 3)
    cases += [dict(method="ring", load_balance="zigzag", causal=True, seq=12, heads=2, kv_heads=2, batch=2, seed=90),
              dict(method="allgather", load_balance="zigzag", causal=True, window=(3, -1), seq=20, heads=1, kv_heads=1,
                   softcap=5.0, scale=0.2, dtype="bfloat16", seed=91)]
    # a loss through the LSE too: each call folds the merged LSE's gradient into its rows
    cases += [dict(method=m, load_balance="zigzag", causal=True, seq=12, heads=2, kv_heads=1, lse_grad=True, seed=92)
              for m in cp.METHODS]
    layouts = [dict(kind="layout", load_balance=lb, seq=cp.num_chunks(2, lb) * 2) for lb in cp.LOAD_BALANCES]
    compiled = [dict(kind="compile", method=m, causal=True, seq=8, heads=2, kv_heads=1, grad=g)
                for m, g in (("ring", False), ("allgather", True))]
    dropped = [cases[-1] | dict(mutant="dlse_dropped")]  # the LSE's gradient ignored: dq and dk are wrong
    results = cp_worker.run(2, cases + layouts + compiled + dropped)
    assert_all_pass(cases, results[:len(cases)])
    check_layouts(2, layouts, results[len(cases):len(cases) + len(layouts)])
    check_compiled(compiled, results[len(cases) + len(layouts):-1])
    assert {"dq", "dk"} <= set(failures(dropped[0], results[-1])), failures(dropped[0], results[-1])


def check_compiled(cases, results):
    """Under torch.compile every kernel call of the forward sits in a graph (rank 0, W = 2, zigzag
    causal: the diagonal step's 3 calls and the other step's 1; the all-gather's 2, and with a
    gradient its 2 backward calls in the traced autograd.Function's backward subgraph), out and
    the gradients equal eager's, and the all-gather compiles with no graph break (its collectives
    trace). The ring's breaks (P2P; docs/distributed.md) are reported, not asserted."""
    for case, res in zip(cases, results):
        assert "error" not in res, res
        assert res["same_as_eager"], (case, res)
        want = {"ring": 4, "allgather": 4 if case["grad"] else 2}[case["method"]]
        assert sum(res["attngen_ops_per_graph"]) == want, (case, res)
        if case["method"] == "allgather":
            assert res["breaks"] == 0, res


def masked_cases(world: int, size: int) -> list[dict]:
    """All-gather with a document mask over global positions (a tensor of document ids) and with
    cu_seqlens (documents of lengths that cut the chunks anywhere, one empty), causal or not, a window;
    and a mask that leaves two rows with no key."""
    seq = 2 * world * size

    def cu(n):  # documents that cut the chunks anywhere; one empty (a repeated offset)
        return [0, 1, n // 3, n // 3, n // 2 + 1, n]

    doc = [float(i // 4 % 3) for i in range(seq)]  # documents that come back (ids 0, 1, 2, 0, ...)
    base = dict(method="allgather", load_balance="zigzag", seq=seq, heads=2, kv_heads=1)
    return [base | dict(causal=True, mask_mod="doc[q_idx] == doc[kv_idx]", tensors={"doc": doc}, seed=50),
            base | dict(causal=False, window=(3, 2), mask_mod="(q_idx // 4) % 2 == (kv_idx // 4) % 2", seed=51),
            base | dict(causal=True, cu_seqlens=cu(seq), seed=52),
            # rows 7 and 8 see no key: out 0, LSE -inf, no NaN, gradient 0 (the reference's own rules)
            base | dict(causal=True, mask_mod="q_idx != 7 and q_idx != 8", seed=54),
            base | dict(causal=False, cu_seqlens=cu(world * size), mask_mod="kv_idx != 5", load_balance="contiguous",
                        seq=world * size, seed=53)]


def check_layouts(world, cases, results):
    """Rank r's shard holds chunks r and 2W-1-r (zigzag) or chunk r (contiguous), written out here;
    unshard gives the positions back, and each part's gradient is W x (position + 1)."""
    for case, res in zip(cases, results):
        size = case["seq"] // cp.num_chunks(world, case["load_balance"])
        for r in range(world):
            ids = [r, 2 * world - 1 - r] if case["load_balance"] == "zigzag" else [r]
            want = torch.cat([torch.arange(c * size, (c + 1) * size, dtype=torch.float32) for c in ids])
            assert torch.equal(res["parts"][r], want), (case, r)
            assert torch.equal(res["grads"][r], world * (want + 1)), (case, r)
        assert torch.equal(res["full"], torch.arange(case["seq"], dtype=torch.float32))


@pytest.mark.expensive
def test_three_ranks_and_the_mutants():
    """W = 3 (odd: zigzag's 6 chunks), chunks of 5 rows, the grid with MQA, the all-gather's document
    masks and cu_seqlens; then each test-only mutant fails the checks it should: the merge without the
    LSE rescale (out), zigzag chunks in the wrong order (out, lse), a dK/dV missing the last ring step
    (dk, dv), the causal flag wrong (out, lse), a global mask_mod read at local rows (out, lse)."""
    cases = grid(3, 5, heads=(2, 1)) + masked_cases(3, 5)
    layouts = [dict(kind="layout", load_balance=lb, seq=cp.num_chunks(3, lb)) for lb in cp.LOAD_BALANCES]
    mutants = {"merge_no_rescale": {"out"}, "zigzag_order": {"out", "lse"}, "dkdv_skip_step": {"dk", "dv"},
               "causal_flag": {"out", "lse"}, "mask_offset": {"out", "lse"}}
    mutant_cases = [dict(method="ring", load_balance="zigzag", causal=True, seq=12, heads=2, kv_heads=1, mutant=m, seed=7)
                    for m in mutants if m != "mask_offset"]
    mutant_cases.append(masked_cases(3, 5)[0] | dict(mutant="mask_offset"))
    results = cp_worker.run(3, cases + layouts + mutant_cases)
    assert_all_pass(cases, results[:len(cases)])
    check_layouts(3, layouts, results[len(cases):len(cases) + len(layouts)])
    for case, res in zip(mutant_cases, results[len(cases) + len(layouts):]):
        failed = set(failures(case, res))
        assert mutants[case["mutant"]] <= failed, (case["mutant"], failed)


@pytest.mark.expensive
def test_four_ranks():
    """W = 4: causal and causal + window (the variants whose steps differ most per rank), chunks of 3."""
    cases = grid(4, 3, variants=[(True, (-1, -1)), (True, (5, -1)), (False, (2, 6))])
    assert_all_pass(cases, cp_worker.run(4, cases))


@pytest.mark.expensive
@settings(max_examples=max(2, settings.default.max_examples // 10))  # a process group per example: ci draws 2
@given(st.data())
def test_drawn_groups(data):
    """Hypothesis draws W, the chunk length, heads (GQA), method, balance, causal, window, dtype and,
    for the all-gather, documents (cu_seqlens); three cases per process group."""
    world = data.draw(st.sampled_from([2, 3]), label="world")
    cases = []
    for i in range(3):
        kv_heads = data.draw(st.sampled_from([1, 2]))
        lb = data.draw(st.sampled_from(cp.LOAD_BALANCES))
        case = dict(
            method=data.draw(st.sampled_from(cp.METHODS)), load_balance=lb, causal=data.draw(st.booleans()),
            window=data.draw(st.sampled_from([(-1, -1), (0, 0), (3, 1), (7, -1), (-1, 2)])),
            seq=cp.num_chunks(world, lb) * data.draw(st.integers(1, 6)), heads=kv_heads * data.draw(st.sampled_from([1, 2])),
            kv_heads=kv_heads, dtype=data.draw(st.sampled_from(["float16", "bfloat16"])), seed=i)
        if case["method"] == "allgather" and data.draw(st.booleans(), label="documents"):
            cuts = data.draw(st.lists(st.integers(0, case["seq"]), max_size=4))
            case["cu_seqlens"] = [0, *sorted(cuts), case["seq"]]
        cases.append(case)
    assert_all_pass(cases, cp_worker.run(world, cases))


# -- what is refused ----------------------------------------------------------------------------------


@pytest.fixture
def one_rank():
    """A one-process gloo group in this process (W = 1: the ring has one step, no transfer)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cp_worker.free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def qkv(seq=4, heads=2, kv_heads=1):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, seq, n, 64, generator=g).half() for n in (heads, kv_heads, kv_heads)]


def test_without_a_process_group_the_error_says_so():
    assert not dist.is_initialized()
    with pytest.raises(InputError, match="init_process_group"):
        cp.context_parallel_attention(*qkv())
    with pytest.raises(InputError, match="init_process_group"):
        cp.shard_sequence(torch.zeros(1, 4, 1, 1))


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="ulysses"), "method = 'ulysses': expected one of 'ring', 'allgather'"),
    (dict(load_balance="striped"), "load_balance = 'striped'"),
    (dict(mask_mod="q_idx >= kv_idx"), "method='allgather' for mask_mod"),
    (dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)), "method='allgather' for cu_seqlens"),
    (dict(method="allgather", cu_seqlens=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens = \[0, 5\]: expected "
                                                                                    "non-decreasing offsets from 0 to 4"),
    (dict(method="allgather", cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens = a torch.float32 tensor"),
    (dict(method="allgather", mask_mod="doc[q_idx]", doc=torch.zeros(4)), "mask_mod"),
    (dict(method="allgather", doc=torch.zeros(4)), "doc is an unknown keyword"),
    (dict(score_mod="score * 2"), "no score_mod with context parallelism"),
    (dict(sinks=torch.zeros(2)), "no sinks with context parallelism"),
    (dict(lse=True), "lse is a spec field set by the call"),
    (dict(consumer=2), "consumer is an unknown keyword"),
    (dict(window_size=(-2, 0)), "window_size"),
])
def test_refusals_are_one_line(one_rank, kwargs, match):
    with pytest.raises((InputError, SpecError), match=match) as e:
        cp.context_parallel_attention(*qkv(), **kwargs)
    assert "\n" not in str(e.value)


def test_a_call_the_kernels_refuse_is_refused_before_any_collective(one_rank, monkeypatch):
    """The op's own checks run on the local tensors first (a rank raising mid-ring would strand the
    others): a float32 q, a negative softcap, a schedule field out of range, each before the steps start."""
    def started(*args):
        raise AssertionError("the steps started before the call was checked")

    monkeypatch.setattr(cp, "_forward", started)
    q, k, v = qkv()
    with pytest.raises(InputError, match="q.dtype"):
        cp.context_parallel_attention(q.float(), k.float(), v.float())
    with pytest.raises(SpecError, match="softcap"):
        cp.context_parallel_attention(q, k, v, softcap=-1.0)
    with pytest.raises(SpecError, match="consumers"):
        cp.context_parallel_attention(q, k, v, consumers=9)


def test_lengths_that_do_not_divide_are_refused(one_rank):
    """zigzag needs an even local length (2 chunks per rank); shard_sequence needs 2W chunks."""
    with pytest.raises(InputError, match=r"q.shape\[1\] = 3: expected a positive multiple of 2"):
        cp.context_parallel_attention(*qkv(seq=3))
    with pytest.raises(InputError, match=r"x.shape\[1\] = 5: expected a positive multiple of 2"):
        cp.shard_sequence(torch.zeros(1, 5, 1, 1))
    out = cp.context_parallel_attention(*qkv(seq=3), load_balance="contiguous")  # one chunk per rank: any length
    assert out.shape == (1, 3, 2, 64)


def test_one_rank_is_attngen_attention(one_rank):
    """W = 1: one step, the causal kernel on the diagonal pairs; equal to attngen.attention's values
    within the tolerance rule (both are checked against the reference)."""
    q, k, v = qkv(seq=6)
    out, lse = cp.context_parallel_attention(q, k, v, causal=True, return_lse=True)
    assert check_close(out, q, k, v, True).ok and check_lse(lse, q, k, v, True).ok


# -- the cost model (bench/context_parallel_model.py) ---------------------------------------------------


def load_model():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "context_parallel_model.py"
    spec = importlib.util.spec_from_file_location("context_parallel_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_cost_model_counts_the_calls_distributed_makes(capsys):
    """Zigzag is balanced (1.00) and contiguous is not ((2W-1) x nearly, the last rank's full blocks
    against the first's one triangle), counted from step_calls; a step's transfer stops hiding when
    the sequence per rank shrinks (compute grows as its square, bytes linearly)."""
    model = load_model()
    for world in (2, 3, 8):
        assert model.balance(world, "zigzag", 16) == 1.0
        assert 2 * world - 2 < model.balance(world, "contiguous", 16) < 2 * world - 1
    args = ["--worlds", "8", "--seqs", "4096", "1048576", "--ib", "50"]
    model.main(args)
    printed = capsys.readouterr().out
    assert "MODEL (not measured)" in printed
    short, long = model.rows(model.parse(args))
    assert not short["ib_hides"] and long["ib_hides"] and long["nvl_hides"]
