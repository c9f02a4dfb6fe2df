"""Serving fields (layout, paged_kv, page_size, splits): validation, planning and what is emitted."""

import pytest

import attngen
from attngen import hw
from attngen.kernels.common.plan import DEFAULT_PAGE_SIZE, Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.kernels.fwd.render import render_source
from attngen.spec import Spec, SpecError


@pytest.mark.parametrize("fields, field, words", [
    (dict(layout="thd"), "layout", '"varlen"'),
    (dict(page_size=64), "page_size", "expected no page_size with paged_kv = false"),
    (dict(paged_kv=True, page_size=40), "page_size", "multiple of 16"),
    (dict(paged_kv=True, page_size=8192), "page_size", "to 4096"),
    (dict(paged_kv="yes"), "paged_kv", "true or false"),
    (dict(splits=0), "splits", '"auto"'),
    (dict(splits=1000), "splits", "1 to 128"),
    (dict(splits="many"), "splits", '"auto"'),
    (dict(layout="varlen", aligned=True), "aligned", "call time"),
    (dict(paged_kv=True, aligned=True), "aligned", "call time"),
    (dict(splits=4, sinks=True), "splits", "sink"),
    (dict(splits="auto", window=(128, 0)), "splits", "window"),
])
def test_bad_serving_fields_name_the_field(fields, field, words):
    with pytest.raises(SpecError) as e:
        Spec(**fields)
    assert e.value.field == field and words in str(e.value)


def test_page_size_must_hold_whole_tiles():
    with pytest.raises(SpecError) as e:
        make_plan(Spec(paged_kv=True, page_size=96, block_n=128))
    assert e.value.field == "page_size" and "multiple of block_n = 128" in str(e.value)


@pytest.mark.parametrize("fields, page, block_n", [
    (dict(paged_kv=True), DEFAULT_PAGE_SIZE, 128),
    (dict(paged_kv=True, page_size=48, head_dim=64), 48, 48),  # the largest tile that divides the page
    (dict(paged_kv=True, head_dim=256, consumers=1), DEFAULT_PAGE_SIZE, 64),  # 80 would fit the budgets, not the page
])
def test_block_n_is_chosen_to_divide_the_page(fields, page, block_n):
    plan = make_plan(Spec(**fields))
    assert plan.page_size == page and plan.spec.block_n == block_n and page % block_n == 0


def test_defaults_leave_name_and_hash_alone():
    plain, spelled = make_plan(Spec(causal=True)), make_plan(Spec(causal=True, layout="bshd", paged_kv=False, splits=1))
    assert (plain.name, plain.hash) == (spelled.name, spelled.hash)
    assert render_source(plain) == render_source(spelled)


def test_serving_kernels_have_distinct_names():
    names = {make_plan(Spec(**f)).name for f in (
        {}, dict(layout="varlen"), dict(paged_kv=True), dict(splits=2), dict(splits="auto"),
        dict(layout="varlen", paged_kv=True, page_size=256))}
    assert len(names) == 5  # splits 2 and "auto" are one kernel (the count is a call-time value)


def test_a_static_shape_is_refused_for_per_sequence_lengths():
    with pytest.raises(SpecError) as e:
        make_plan(Spec(layout="varlen"), Shape(1, 8, 8, 128, 128))
    assert e.value.field == "shape"
    make_plan(Spec(splits=2), Shape(1, 8, 8, 128, 128))  # split-KV alone keeps static shapes


def test_pack_gqa_only_for_split_kv_with_groups():
    assert make_plan(Spec(gqa_group=8, consumers=1, splits="auto")).pack_gqa
    assert not make_plan(Spec(gqa_group=8, consumers=1)).pack_gqa
    assert not make_plan(Spec(gqa_group=1, splits="auto")).pack_gqa
    assert not make_plan(Spec(gqa_group=8, consumers=2, splits="auto")).pack_gqa  # decode tiles: one warpgroup


def test_a_paging_or_splitting_producer_gets_more_registers_with_one_consumer():
    base = make_plan(Spec(consumers=1))
    paged = make_plan(Spec(consumers=1, paged_kv=True))
    assert base.producer_regs == hw.REG_SPLIT[1][0]
    assert paged.producer_regs == hw.SERVING_PRODUCER_REGS[1] > base.producer_regs
    assert paged.producer_regs + paged.consumer_regs <= 2 * paged.launch_regs  # the pool still covers both


def test_with_two_consumers_a_paged_producer_takes_registers_from_the_consumers():
    base = make_plan(Spec(consumers=2))
    paged = make_plan(Spec(consumers=2, paged_kv=True))
    assert (base.producer_regs, base.consumer_regs) == hw.REG_SPLIT[2] == (24, 240)
    assert (paged.producer_regs, paged.consumer_regs) == (hw.SERVING_PRODUCER_REGS[2], 232)
    assert paged.producer_regs + 2 * paged.consumer_regs <= 3 * paged.launch_regs
    assert make_plan(Spec(consumers=2, splits=4)).consumer_regs == 232
    # the consumers' 232 is the register budget too: hd192 at block_n 128 (240 by the estimate) no longer fits
    assert make_plan(Spec(head_dim=192, consumers=2, k_stages=1, v_stages=1, splits=4)).spec.block_n == 112
    assert make_plan(Spec(head_dim=192, consumers=2, k_stages=1, v_stages=1)).spec.block_n == 128


def test_varlen_stores_only_its_rows_and_reads_its_lengths():
    src = render_source(Spec(causal=True, layout="varlen"))
    assert "q_len = cu_seqlens_q[batch_idx + 1] - q_start" in src
    assert "kv_len = cu_seqlens_k[batch_idx + 1] - k_start" in src
    assert "if q0 + row0 + i < q_len:" in src
    assert "O[q_start + q0 + row0 + i, head, j] = O_shared[g, i, j]" in src
    assert "T.copy(O_shared[g, :, :], O[" not in src  # no whole-tile TMA store into the packed output
    assert "max_seqlen_q: T.int32" in src and "T.ceildiv(max_seqlen_q, BLOCK_M)" in src


def test_paged_loads_each_tile_through_the_block_table():
    src = render_source(Spec(causal=True, paged_kv=True, page_size=256))
    assert "TILES_PER_PAGE = 2" in src
    assert "page = block_table[batch_idx, T.min(k // TILES_PER_PAGE, last_page)]" in src
    assert "T.tma_copy(K[page, page_row:page_row + BLOCK_N, kv_head, :]" in src
    assert "kv_len = seqused_k[batch_idx]" in src
    assert "T.copy(O_shared[g, :, :], O[batch_idx," in src  # bshd output: the TMA store clips at q_len itself


def test_split_kv_emits_partials_and_a_combine_kernel():
    plan = make_plan(Spec(causal=True, gqa_group=8, consumers=1, paged_kv=True, splits="auto", lse=True))
    src = render_source(plan)
    assert "def build_combine_kernel():" in src and f"def {plan.name}_combine(" in src
    assert "O_partial[split_idx, batch_idx, (q0 + row0 + i) // GQA_GROUP, (head + (q0 + row0 + i) % GQA_GROUP), j] = acc_o[i, j]" in src
    assert "first_tile = split_idx * tiles_per_split" in src
    assert "LSE: T.Tensor([batch, heads, q_len]" in src.split("def build_combine_kernel")[1]  # the combine writes the LSE
    assert "LSE: T.Tensor" not in src.split("def build_combine_kernel")[0]
    assert "O_shared" not in src  # partials leave from registers: no output staging buffer
    assert "O" not in plan.smem


def test_spec_files_take_the_serving_fields(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('head_dim = 64\nlayout = "varlen"\npaged_kv = true\npage_size = 256\nsplits = "auto"\n')
    spec = attngen.load_spec(path)
    assert (spec.layout, spec.paged_kv, spec.page_size, spec.splits) == ("varlen", True, 256, "auto")
    assert 'splits = "auto"' in attngen.spec.to_toml(spec)


@pytest.mark.parametrize("command", [["timeline"], ["tune", "--dry-run"]])
def test_tools_that_model_dense_kernels_refuse_serving_specs(command, tmp_path, capsys):
    from attngen.cli import main

    path = tmp_path / "s.toml"
    path.write_text('splits = "auto"\ngqa_group = 4\n')
    assert main([command[0], str(path), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'spec field `splits` = "auto"' in err and "without layout, paged_kv and splits" in err
