"""flash_attn_with_kvcache(q, k_cache, v_cache, k=, v=, cache_seqlens=, page_table=): the append
companion kernel (templates/append/fa3_kv_append.py.j2) on the CPU model, then the attention over
cache_seqlens + seqlen_new keys (docs/interfaces.md).

- The cache after a call equals the expected cache byte for byte: every row outside the appended
  ones is filled with random 16-bit patterns (NaN and inf payloads included), which must survive
  untouched; the appended rows hold k and v exactly. Computed here, independently of attngen's
  page arithmetic.
- The attention output matches the fp64 reference (reference.check_close) on the keys of the
  expected cache, per sequence, causal bottom-right at cache_seqlens + seqlen_new (FA3's rule).
- Mutants of the emitted append kernel (a row off, the page table ignored, a row too many) are
  caught by the CPU model's ownership rule and, with that rule switched off, by the byte compare.
- Bad inputs are one-line InputErrors naming the argument.
"""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from attngen.interfaces import flash_attn_interface as fa
from attngen.interfaces import ops
from attngen.emulator import KernelError
from attngen.emulator import driver
from attngen.kernels.append.plan import append_plan
from attngen.reference.forward import InputError, check_close
from attngen.kernels.append.render import render_append_source
from attngen.kernels.fwd.render import render_source
from attngen.spec import SpecError
from gpu_marks import GPU_ONLY, NEEDS_TOOLKIT

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def noise(shape, dtype, gen, finite=True):
    """Random 16-bit patterns of a float16/bfloat16 tensor: subnormals, -0, any sign and mantissa;
    finite ones have the exponent's top bit cleared (|x| < 2), else NaNs and infs come too. Rows
    the attention may read in a tile it masks are finite (the kernel's 0 x NaN would be NaN, as
    on the GPU); pages no sequence lists hold any pattern."""
    bits = torch.randint(-2**15, 2**15, shape, generator=gen, dtype=torch.int32)
    if finite:
        bits &= ~0x4000
    return bits.to(torch.int16).view(dtype)


def normal(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def same_bytes(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Case:
    """One drawn call: a dense or paged cache whose rows before cache_seqlens[b] hold sequence b's
    keys and whose every other row holds noise; new keys k, v; the expected cache after the append
    and each sequence's keys after it (dense [L + S_new, HKV, D] tensors)."""

    def __init__(self, *, batch, heads, kv_heads, head_dim, head_dim_v, q_len, s_new, lens, paged, page_size,
                 s_cache, dtype, seed, spare_pages=3):
        gen = torch.Generator().manual_seed(seed)
        dt = DTYPES[dtype]
        self.dtype, self.lens, self.s_new, self.batch, self.paged = dtype, lens, s_new, batch, paged
        self.q = normal((batch, q_len, heads, head_dim), dt, gen)
        self.k = normal((batch, s_new, kv_heads, head_dim), dt, gen)
        self.v = normal((batch, s_new, kv_heads, head_dim_v), dt, gen)
        if paged:
            per = [-(-(n + s_new) // page_size) for n in lens]
            width = max(per) + 1  # a spare column, pointing at a spare page
            num_pages = sum(per) + spare_pages
            order = torch.randperm(num_pages, generator=gen).tolist()
            table = torch.empty((batch, width), dtype=torch.int32)
            nxt = 0
            for b in range(batch):
                table[b, :per[b]] = torch.tensor(order[nxt:nxt + per[b]])
                nxt += per[b]
                table[b, per[b]:] = order[-1]  # unused entries: a page no sequence owns
            shape_k, shape_v = (num_pages, page_size, kv_heads, head_dim), (num_pages, page_size, kv_heads, head_dim_v)
            self.page_table = table
        else:
            shape_k, shape_v = (batch, s_cache, kv_heads, head_dim), (batch, s_cache, kv_heads, head_dim_v)
            self.page_table = None
        self.k_cache, self.v_cache = noise(shape_k, dt, gen), noise(shape_v, dt, gen)
        if paged:  # pages no sequence lists: never read, any bit pattern (NaN payloads included)
            spare = torch.tensor(order[sum(per):])
            self.k_cache[spare] = noise((len(spare), *shape_k[1:]), dt, gen, finite=False)
            self.v_cache[spare] = noise((len(spare), *shape_v[1:]), dt, gen, finite=False)
        self.expected_k, self.expected_v = self.k_cache.clone(), self.v_cache.clone()
        self.keys, self.values = [], []
        for b, n in enumerate(lens):
            old_k, old_v = normal((n, kv_heads, head_dim), dt, gen), normal((n, kv_heads, head_dim_v), dt, gen)
            self._put(self.k_cache, b, 0, old_k)
            self._put(self.v_cache, b, 0, old_v)
            self._put(self.expected_k, b, 0, old_k)
            self._put(self.expected_v, b, 0, old_v)
            self._put(self.expected_k, b, n, self.k[b])
            self._put(self.expected_v, b, n, self.v[b])
            self.keys.append(torch.cat([old_k, self.k[b]]))
            self.values.append(torch.cat([old_v, self.v[b]]))
        self.page_size = page_size

    def _put(self, cache, b, start, rows):
        """rows -> cache positions start.. of sequence b: a dense row, or key t in row t % P of page table[b, t // P]."""
        if self.page_table is None:
            cache[b, start:start + len(rows)] = rows
            return
        p = cache.shape[1]
        for i, row in enumerate(rows):
            t = start + i
            cache[int(self.page_table[b, t // p]), t % p] = row

    @property
    def cache_seqlens(self):
        return torch.tensor(self.lens, dtype=torch.int32)

    def call(self, causal, **kw):
        extra = {"page_table": self.page_table} if self.paged else {}
        return fa.flash_attn_with_kvcache(self.q, self.k_cache, self.v_cache, k=self.k, v=self.v,
                                          cache_seqlens=self.cache_seqlens, causal=causal, **extra, **kw)


@st.composite
def cases(draw, paged):
    kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 3))
    s_new = draw(st.integers(1, 5))
    q_len = draw(st.integers(1, s_new + 1))  # decode (1), the new tokens' queries (s_new), or one more
    page_size = draw(st.sampled_from([16, 32])) if paged else None
    s_cache = None if paged else draw(st.sampled_from([16, 48, 64]))
    top = 70 if paged else s_cache - s_new
    lens = draw(st.lists(st.integers(0, top), min_size=batch, max_size=batch))
    return Case(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, head_dim=64, head_dim_v=64, q_len=q_len,
                s_new=s_new, lens=lens, paged=paged, page_size=page_size, s_cache=s_cache,
                dtype=draw(st.sampled_from(["float16", "bfloat16"])), seed=draw(st.integers(0, 2**16)))


def check_case(c: Case, causal: bool):
    out = c.call(causal)
    # c.k_cache, c.v_cache are the very tensors the call got: the append is in place, as FA3's
    assert same_bytes(c.k_cache, c.expected_k) and same_bytes(c.v_cache, c.expected_v)
    for b in range(c.batch):
        verdict = check_close(out[b:b + 1], c.q[b:b + 1], c.keys[b][None], c.values[b][None], causal, dtype=c.dtype)
        assert verdict.ok, (b, c.lens, str(verdict))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(paged=False), st.booleans())
def test_a_dense_cache_append_is_byte_exact_and_the_attention_reads_it(c, causal):
    check_case(c, causal)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(paged=True), st.booleans())
def test_a_paged_cache_append_through_a_shuffled_table_is_byte_exact_and_the_attention_reads_it(c, causal):
    check_case(c, causal)


def test_decode_steps_grow_the_cache_and_match_attention_over_it():
    """Three decode steps of one query each, causal, GQA 2, on a dense cache: each step sees its own key."""
    gen = torch.Generator().manual_seed(5)
    kc, vc = torch.zeros(2, 32, 2, 64, dtype=torch.float16), torch.zeros(2, 32, 2, 64, dtype=torch.float16)
    lens = torch.tensor([3, 0], dtype=torch.int32)
    kc[0, :3], vc[0, :3] = normal((3, 2, 64), torch.float16, gen), normal((3, 2, 64), torch.float16, gen)
    for step in range(3):
        q = normal((2, 1, 4, 64), torch.float16, gen)
        k, v = normal((2, 1, 2, 64), torch.float16, gen), normal((2, 1, 2, 64), torch.float16, gen)
        out = fa.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, causal=True)
        for b in range(2):
            n = int(lens[b]) + 1
            assert torch.equal(kc[b, n - 1], k[b, 0]) and torch.equal(vc[b, n - 1], v[b, 0])
            assert check_close(out[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], True).ok
        lens = lens + 1
    assert not kc[0, 6:].any() and not kc[1, 3:].any()


def test_an_int_cache_seqlens_a_head_dim_v_and_the_lse():
    c = Case(batch=2, heads=2, kv_heads=1, head_dim=64, head_dim_v=64, q_len=2, s_new=2, lens=[7, 7], paged=False,
             page_size=None, s_cache=16, dtype="float16", seed=3)
    out, lse = fa.flash_attn_with_kvcache(c.q, c.k_cache, c.v_cache, k=c.k, v=c.v, cache_seqlens=7, causal=True,
                                         return_softmax_lse=True)
    assert same_bytes(c.k_cache, c.expected_k) and same_bytes(c.v_cache, c.expected_v)
    assert lse.shape == (2, 2, 2) and torch.isfinite(lse).all()
    for b in range(2):
        assert check_close(out[b:b + 1], c.q[b:b + 1], c.keys[b][None], c.values[b][None], True).ok


def test_packed_queries_append_too():
    """Varlen q (cu_seqlens_q: 2 and 3 queries) with 3 new keys per sequence into a dense cache."""
    gen = torch.Generator().manual_seed(7)
    kc, vc = normal((2, 32, 1, 64), torch.float16, gen), normal((2, 32, 1, 64), torch.float16, gen)
    q, cu = normal((5, 2, 64), torch.float16, gen), torch.tensor([0, 2, 5], dtype=torch.int32)
    k, v = normal((2, 3, 1, 64), torch.float16, gen), normal((2, 3, 1, 64), torch.float16, gen)
    lens = [4, 20]
    expect_k = kc.clone()
    for b, n in enumerate(lens):
        expect_k[b, n:n + 3] = k[b]
    out = fa.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                     cu_seqlens_q=cu, max_seqlen_q=3, causal=True)
    assert same_bytes(kc, expect_k)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert check_close(out[rows][None], q[rows][None], kc[b:b + 1, :n + 3], vc[b:b + 1, :n + 3], True).ok


# -- the emitted kernel on the CPU model, directly ---------------------------------------------------


def paged_inputs(seed=1, dv=64, lens=(0, 14, 30)):
    """A shuffled paged cache (page 16) of noise, three sequences appending 5 keys each, one across a page
    edge; enough spare pages that a kernel ignoring the table still stores in bounds."""
    c = Case(batch=3, heads=2, kv_heads=2, head_dim=64, head_dim_v=dv, q_len=1, s_new=5, lens=list(lens), paged=True,
             page_size=16, s_cache=None, dtype="float16", seed=seed, spare_pages=8)
    return c, (c.k_cache, c.v_cache, c.k, c.v, c.page_table, c.cache_seqlens)


def emulated_is(got, expected) -> bool:
    """The CPU model's float32 cache equals `expected`, value for value (NaN where NaN: the model's
    float32 buffers keep no float16 NaN payload, which is why the op copies back only the appended
    rows; the byte-exact checks are the door's, above)."""
    return got.shape == tuple(expected.shape) and np.array_equal(got, expected.float().numpy(), equal_nan=True)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 20), st.sampled_from([1, 3]), st.sampled_from([(64, 64), (128, 64)]),
       st.sampled_from([16, 48]), st.integers(0, 2**16))
def test_the_emulated_append_writes_exactly_the_appended_rows(batch, s_new, kv_heads, dims, page_size, seed):
    """emulate_append alone (no forward): many shapes, odd lengths past page and block edges."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 40, (batch,), generator=gen).tolist()
    c = Case(batch=batch, heads=kv_heads, kv_heads=kv_heads, head_dim=dims[0], head_dim_v=dims[1], q_len=1,
             s_new=s_new, lens=lens, paged=True, page_size=page_size, s_cache=None, dtype="bfloat16", seed=seed)
    stats = driver.Stats()
    new_k, new_v = driver.emulate_append(c.k_cache, c.v_cache, c.k, c.v, c.page_table, c.cache_seqlens, stats=stats)
    assert stats.ctas == -(-s_new // 8) * kv_heads * batch  # the grid: ceil(seqlen_new / APPEND_ROWS) x kv_heads x batch
    assert emulated_is(new_k, c.expected_k) and emulated_is(new_v, c.expected_v)


def test_seqlen_new_zero_launches_nothing_and_changes_nothing():
    c, args = paged_inputs()
    before = c.k_cache.clone()
    empty_k, empty_v = c.k[:, :0], c.v[:, :0]
    ops.append_kv(c.k_cache, c.v_cache, empty_k, empty_v, c.page_table, c.cache_seqlens)
    assert same_bytes(c.k_cache, before)


# -- mutants: each caught by the ownership rule and, without it, by the byte compare -----------------

POSITION = "start + r0 + i"
MUTANTS = {
    "one row later": lambda s: s.replace(f"({POSITION}) // PAGE_SIZE], ({POSITION}) % PAGE_SIZE",
                                         f"({POSITION} + 1) // PAGE_SIZE], ({POSITION} + 1) % PAGE_SIZE"),
    "one row earlier": lambda s: s.replace(f"({POSITION}) // PAGE_SIZE], ({POSITION}) % PAGE_SIZE",
                                           f"({POSITION} - 1) // PAGE_SIZE], ({POSITION} - 1) % PAGE_SIZE"),
    "ignores page_table": lambda s: s.replace(f"block_table[batch_idx, ({POSITION}) // PAGE_SIZE]",
                                              f"batch_idx * max_pages + ({POSITION}) // PAGE_SIZE"),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_an_append_mutant_is_caught(name, monkeypatch):
    c, args = paged_inputs(lens=(3, 14, 30))  # no empty cache: a row earlier is still a row of the cache
    source = render_append_source(append_plan("float16", 64, 64, 16))
    mutated = MUTANTS[name](source)
    assert mutated != source  # the edit applies
    good_k, good_v = driver.emulate_append(*args, source=source)  # the kernel as emitted passes on these inputs
    assert emulated_is(good_k, c.expected_k) and emulated_is(good_v, c.expected_v)
    with pytest.raises(KernelError, match="which it does not own"):
        driver.emulate_append(*args, source=mutated)
    # without the ownership rule the mutant runs, and the cache it leaves is not the expected one
    monkeypatch.setattr(driver, "append_ownership", lambda call, rows: None)
    bad_k, bad_v = driver.emulate_append(*args, source=mutated)
    assert not emulated_is(bad_k, c.expected_k) and not emulated_is(bad_v, c.expected_v)


def test_a_guard_one_row_too_far_is_caught():
    """`<=` for `<`: the block writes a row past seqlen_new (and reads past K_new)."""
    c, args = paged_inputs()
    source = render_append_source(append_plan("float16", 64, 64, 16))
    mutated = source.replace("if r0 + i < seqlen_new:", "if r0 + i <= seqlen_new:")
    assert mutated != source
    with pytest.raises(KernelError):
        driver.emulate_append(*args, source=mutated)


def test_the_ownership_rule_names_the_block_and_the_rows_it_owns():
    c, args = paged_inputs()
    mutated = MUTANTS["one row later"](render_append_source(append_plan("float16", 64, 64, 16)))
    with pytest.raises(KernelError) as info:
        driver.emulate_append(*args, source=mutated)
    assert "block (x=0, y=0, z=0)" in str(info.value) and "K_cache[" in str(info.value)


# -- validation: one line, naming the argument -----------------------------------------------------


def dense(**over):
    gen = torch.Generator().manual_seed(9)
    kw = dict(q=normal((2, 1, 4, 64), torch.float16, gen), k_cache=normal((2, 32, 2, 64), torch.float16, gen),
              v_cache=normal((2, 32, 2, 64), torch.float16, gen), k=normal((2, 3, 2, 64), torch.float16, gen),
              v=normal((2, 3, 2, 64), torch.float16, gen), cache_seqlens=torch.tensor([4, 9], dtype=torch.int32))
    kw.update(over)
    return kw


def paged(**over):
    c, _ = paged_inputs()
    kw = dict(q=c.q, k_cache=c.k_cache, v_cache=c.v_cache, k=c.k, v=c.v, cache_seqlens=c.cache_seqlens,
              page_table=c.page_table)
    kw.update(over)
    return kw


def shared_page_table():
    t = paged()["page_table"].clone()
    t[1, 1] = t[2, 2]  # keys 16..18 of sequence 1 and 32..34 of sequence 2: rows 0..2 of one page
    return t


E = torch.zeros(1)
BAD = [  # (what, the call's keywords, the argument the message starts with)
    ("k without v", lambda: dense(v=None), "v"),
    ("v without k", lambda: dense(k=None), "k"),
    ("k's kv heads", lambda: dense(k=torch.zeros(2, 3, 1, 64, dtype=torch.float16)), "k.shape"),
    ("k's head dim", lambda: dense(k=torch.zeros(2, 3, 2, 32, dtype=torch.float16)), "k.shape"),
    ("k's batch", lambda: dense(k=torch.zeros(1, 3, 2, 64, dtype=torch.float16)), "k.shape"),
    ("k's rank", lambda: dense(k=torch.zeros(2, 3, 128, dtype=torch.float16)), "k.shape"),
    ("v's length", lambda: dense(v=torch.zeros(2, 2, 2, 64, dtype=torch.float16)), "v.shape"),
    ("k's dtype", lambda: dense(k=torch.zeros(2, 3, 2, 64, dtype=torch.bfloat16)), "k.dtype"),
    ("v's dtype", lambda: dense(v=torch.zeros(2, 3, 2, 64, dtype=torch.float32)), "v.dtype"),
    ("no cache_seqlens", lambda: dense(cache_seqlens=None), "cache_seqlens"),
    ("float cache_seqlens", lambda: dense(cache_seqlens=torch.tensor([4.0, 9.0])), "cache_seqlens"),
    ("int64 cache_seqlens", lambda: dense(cache_seqlens=torch.tensor([4, 9])), "cache_seqlens"),
    ("past the dense cache", lambda: dense(cache_seqlens=torch.tensor([4, 30], dtype=torch.int32)), "cache_seqlens[1]"),
    ("a negative length", lambda: dense(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), "cache_seqlens[0]"),
    ("an int past the dense cache", lambda: dense(cache_seqlens=30), "cache_seqlens[0]"),
    ("a strided cache", lambda: dense(k_cache=torch.zeros(2, 32, 4, 64, dtype=torch.float16)[:, :, ::2]), "k_cache.stride()"),
    ("duplicate cache rows", lambda: dense(cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32)), "cache_batch_idx"),
    ("past the pages", lambda: paged(cache_seqlens=torch.tensor([0, 14, 60], dtype=torch.int32)), "cache_seqlens[2]"),
    ("a page out of range", lambda: paged(page_table=paged()["page_table"].index_fill(1, torch.tensor([0]), 99)),
     "page_table[0, 0]"),  # FA3's name for the door's block_table (issue 25)
    ("two sequences, one page", lambda: paged(page_table=shared_page_table()), "page_table"),
    ("rotary with the append", lambda: dense(rotary_cos=E), "rotary_cos"),
    ("packed new keys", lambda: dense(cu_seqlens_k_new=E), "cu_seqlens_k_new"),
]


@pytest.mark.parametrize("what, make, name", BAD, ids=[b[0] for b in BAD])
def test_a_bad_append_is_one_line_naming_the_argument(what, make, name):
    kw = make()
    before = kw["k_cache"].clone()
    with pytest.raises(InputError) as info:
        fa.flash_attn_with_kvcache(**kw)
    msg = str(info.value)
    assert msg.startswith(f"{name} = ") and "\n" not in msg, msg
    assert same_bytes(kw["k_cache"], before)  # refused before anything was written


@pytest.mark.parametrize("what, over", [
    ("a window with a split count (SpecError)", {"window_size": (4, 0), "num_splits": 2}),
    ("a bad softmax_scale", {"softmax_scale": -1.0}),
    ("a page table one row short", {"page_table": paged()["page_table"][:, :2]}),
])
def test_an_attention_the_forward_refuses_writes_nothing(what, over):
    """The attention's own checks run before the append: a refused call leaves the cache untouched."""
    kw = paged(**over)
    before_k, before_v = kw["k_cache"].clone(), kw["v_cache"].clone()
    with pytest.raises((InputError, SpecError)):
        fa.flash_attn_with_kvcache(**kw)
    assert same_bytes(kw["k_cache"], before_k) and same_bytes(kw["v_cache"], before_v)


def test_the_op_refuses_what_the_door_would_and_names_the_kernel_argument():
    c, (kc, vc, k, v, table, lens) = paged_inputs()
    with pytest.raises(InputError, match=r"^k\.shape = \[3, 5, 2, 32\]"):
        ops.append_kv(kc, vc, k[..., :32].contiguous(), v, table, lens)
    with pytest.raises(InputError, match=r"^block_table\.dtype = torch\.int64"):
        ops.append_kv(kc, vc, k, v, table.long(), lens)
    with pytest.raises(InputError, match=r"^k = memory overlapping k_cache"):
        ops.append_kv(kc, vc, kc.view(-1)[:k.numel()].view(k.shape), v, table, lens)  # a view of the cache


def test_the_op_is_a_mutating_custom_op():
    c, args = paged_inputs()
    torch.library.opcheck(ops.append_kv, args, test_utils=("test_schema", "test_faketensor"))  # on copies
    assert ops.append_kv(*args) is None  # the op returns nothing: the caches are its outputs, in place
    assert same_bytes(c.k_cache, c.expected_k) and same_bytes(c.v_cache, c.expected_v)


# -- emitted only where used; builds ------------------------------------------------------------------


def test_no_forward_kernel_carries_the_append():
    from pathlib import Path

    from attngen.spec import load

    root = Path(__file__).resolve().parent.parent
    for toml in sorted((root / "examples").glob("*.toml")):
        assert "build_append_kernel" not in render_source(load(str(toml)))
    assert "build_append_kernel" in render_append_source(append_plan("bfloat16", 128, 128, 128))


@NEEDS_TOOLKIT
@pytest.mark.parametrize("args", [("bfloat16", 128, 128, 128), ("float16", 64, 64, 16), ("float16", 192, 128, 64)])
def test_the_append_kernel_builds_for_sm90a_without_spills(args):
    from attngen.build.nvcc import build_append

    report = build_append(append_plan(*args)).report
    assert report["kernel"] == append_plan(*args).name
    assert report["registers"] and report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0
    assert report["stack_frame_bytes"] == 0


@NEEDS_TOOLKIT
def test_the_runtime_builds_the_append_kernel_entry():
    from attngen.run import append

    kernel = append.compile_append(append_plan("bfloat16", 128, 128, 128))
    assert kernel.jit is not None and kernel.cache_path and "fa3_kvappend_hd128_bf16_page128" in kernel.cache_path


# -- the GPU (skipped without an sm_90 device) --------------------------------------------------------


def _gpu(fn):
    for mark in reversed(GPU_ONLY):
        fn = mark(fn)
    return fn


@_gpu
@pytest.mark.parametrize("paged_cache", [False, True])
def test_the_gpu_append_is_byte_exact_and_the_attention_reads_it(paged_cache):
    c = Case(batch=3, heads=8, kv_heads=2, head_dim=128, head_dim_v=128, q_len=2, s_new=3, lens=[0, 61, 130],
             paged=paged_cache, page_size=64, s_cache=256, dtype="bfloat16", seed=11)
    cuda = {n: getattr(c, n).cuda() for n in ("q", "k", "v", "k_cache", "v_cache")}
    extra = {"page_table": c.page_table.cuda()} if paged_cache else {}
    out = fa.flash_attn_with_kvcache(cuda["q"], cuda["k_cache"], cuda["v_cache"], k=cuda["k"], v=cuda["v"],
                                     cache_seqlens=c.cache_seqlens.cuda(), causal=True, **extra)
    assert same_bytes(cuda["k_cache"].cpu(), c.expected_k) and same_bytes(cuda["v_cache"].cpu(), c.expected_v)
    for b in range(c.batch):
        assert check_close(out[b:b + 1].cpu(), c.q[b:b + 1], c.keys[b][None], c.values[b][None], True).ok
