"""The seed's configuration lowers to the hand-written seed kernel's CUDA, statement for statement.

`examples/seed_parity.toml` is the seed's configuration with the seed's steady-loop form
(steady_loop = "split"). Specialized to the seed's static shape it has the seed's resource
figures (our own copy below, measured on 2026-11-29 by lowering the seed's hand-written kernel:
tilelang 0.1.15, nvcc 13.0, sm_90a), and its lowered CUDA is the seed's up to identifier names,
renumbered temporaries, the order of the local declarations, and the places docs/seed-parity.md
lists: the fixes of the seed's three bugs (1: a masked prologue; 4: the epilogue's fence and
barrier; 5 and 6: the running max's finite, scale-safe start, the epilogue's division of a nonzero
row sum only), the lowering edits of issue 9's cold builds (2: tile 0's row sum; 3: the mask test),
issue 18's run-time softmax scale (7: the kernel's softmax_scale parameter, and
softmax_scale * LOG2E where the seed has its constant, which must be log2(e) / sqrt(head_dim) as
the reference computes it), and a fence TileLang puts in the seed's text only. Each of those is a
rewrite below that must apply exactly where the doc says (once per consumer warpgroup, or a fixed
number of times), so none can hide another difference.

The seed kernel is read from the seed notes (bench/seed_kernel.py), never from this repository.
"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

import attngen
from attngen.build.nvcc import build
from attngen.build.lower import import_tilelang, load_module, lower_prim_func, lower_source, TARGET
from attngen.hw import LOG2E
from attngen.kernels.common.plan import SEED_SHAPE, Shape
from attngen.kernels.fwd.plan import make_plan
from attngen.reference.forward import default_scale
from attngen.kernels.fwd.render import render_source

ROOT = Path(__file__).resolve().parent.parent
SEED = {
    "registers": 168,
    "spill_store_bytes": 0,
    "spill_load_bytes": 0,
    "stack_frame_bytes": 0,
    "dynamic_smem_bytes": 196608,
    "static_smem_bytes": 1024,
    "sass": {"HGMMA": 96, "HGMMA_A_FROM_REGISTERS": 48, "USETMAXREG": 3, "UTMALDG": 24, "UTMASTG": 4, "LDL": 0, "STL": 0},
}
# The seed's names -> ours (docs/seed-parity.md); a name with a suffix (sm_clear_3, pcast_1) maps its prefix.
SEED_NAMES = {"Qs": "Q_shared", "Ks": "K_shared", "Vs": "V_shared", "Os": "O_shared", "kready": "k_full",
              "kfree": "k_empty", "vready": "v_full", "vfree": "v_empty", "q_bar": "q_full", "sm": "m_cur",
              "smp": "m_prev", "ss": "row_sum_tile", "logsum": "row_sum", "pcast": "p_reg"}
CONSUMERS = 2  # each rewrite of a consumer's text applies once per consumer warpgroup
# 7. the run-time scale: a float literal as TileLang prints it (C99 hex, `f`, the decimal in a comment)
LITERAL = r"(?P<{}>0x[0-9a-f.]+p[+-]\d+)f/\*[^*/]*\*/"
SCALE_EXPR = re.compile(rf"\(softmax_scale \* {LITERAL.format('log2e')}\)")  # our scale_log2, substituted at each use
# per consumer: tile 0's exp2 (the score's and the max's factor) and, in each steady loop, alpha's
# (the old max's and the new max's) and the exp2's (the score's and the max's)
SCALE_USES = 2 + 2 * 4


def seed_module():
    """The hand-written kernel as a module: cut from the seed notes beside the checkout (or inside
    it), else the copy bench/seed_kernel.py left in .seed/; skipped where there is neither."""
    spec = importlib.util.spec_from_file_location("seed_kernel", ROOT / "bench" / "seed_kernel.py")
    seed_kernel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed_kernel)
    for notes in (seed_kernel.NOTES, ROOT / "shared" / "seeds" / "fa3-tilelang-notes.md"):
        if notes.is_file():
            return load_module(seed_kernel.extract(notes), "fa3_seed")
    copy = ROOT / ".seed" / "seed_fa3.py"
    if copy.is_file():
        return load_module(copy.read_text(), "fa3_seed")
    pytest.skip(f"no seed notes at {seed_kernel.NOTES} and no {copy} (bench/seed_kernel.py writes it)")


def lower_seed() -> str:
    module = seed_module()
    import_tilelang()
    from tvm.target import Target

    with Target(TARGET):
        prim_func = module.fa3_prefill.get_tir(*dataclasses.astuple(SEED_SHAPE), 128, "float16")
    artifact, _ = lower_prim_func(prim_func, module._pc)
    return artifact.kernel_source


# -- the comparison ---------------------------------------------------------------------------
IDENT = re.compile(r"[A-Za-z_]\w*")
DECLARATION = re.compile(r"(float|half_t) (\w+)\[\d+\];")


class Mismatch(AssertionError):
    pass


def rename(text: str, names: dict) -> str:
    def sub(m):
        tok = m.group(0)
        for old, new in names.items():
            if tok == old or tok.startswith(old + "_"):
                return new + tok[len(old):]
        return tok

    return IDENT.sub(sub, text)


def expect(what: str, applied: int, times: int) -> None:
    if applied != times:
        raise Mismatch(f"{what}: applies {applied} time(s), expected {times}")


def scale_log2(head_dim: int) -> np.float32:
    """log2(e) / sqrt(head_dim), as the reference computes the kernel's factor at the default scale
    (reference.attention_lowprec: float32(scale) * float32(LOG2E))."""
    return np.float32(default_scale(head_dim)) * np.float32(LOG2E)


def is_scale_log2(literal: str, head_dim: int) -> bool:
    """Whether softmax_scale * `literal` is scale_log2(head_dim) at the default scale."""
    return np.float32(default_scale(head_dim)) * np.float32(float.fromhex(literal)) == scale_log2(head_dim)


def drop_block(lines: list, head: str) -> tuple[list, int]:
    """The lines without each block that opens with `head` (to its matching brace)."""
    out, i, n = [], 0, 0
    while i < len(lines):
        if lines[i] != head:
            out.append(lines[i])
            i += 1
            continue
        depth = 0
        while True:
            depth += lines[i].count("{") - lines[i].count("}")
            i += 1
            if depth == 0:
                break
        n += 1
    return out, n


def ours_as_seed(lines: list, head_dim: int) -> list:
    """Our lowered kernel with the differences docs/seed-parity.md lists (all but 2, numbered as
    there) put back in the seed's form; 7 (the run-time scale) in a form both sides are put in."""
    # 1. bug 1 fixed: the masked prologue (block 0's first tile is diagonal)
    lines, n = drop_block(lines, "if (((int)blockIdx.x) < 1) {")
    expect("difference 1 (the masked prologue)", n, CONSUMERS)
    # 3. the steady loop's mask test: key <= row - k * 128 in ours, k * 128 + key <= row in the seed's
    mask = re.compile(r"if \(\(\(\((?P<a>\(\(\w+ >> 2\) \* 8\))(?P<bc>.*?) <= \((?P<r>.*) - \((?P<k>\w+) \* 128\)\)\)\) \{")
    out, n = [], 0
    for line in lines:
        m = mask.fullmatch(line)
        if m:
            line, n = f"if (((((({m['k']} * 128) + {m['a']}){m['bc']} <= {m['r']})) {{", n + 1
        out.append(line)
    expect("difference 3 (the mask test)", n, CONSUMERS)
    # 4. bug 2 fixed: every thread fences its O_shared stores and the warpgroup meets before the TMA
    # store, where the seed fences in the elected thread only
    lines, out, n, i = out, [], 0, 0
    while i < len(lines):
        if (lines[i:i + 3:2] == ["tl::fence_proxy_async();", "if (tl::tl_shuffle_elect<128>()) {"]
                and re.fullmatch(r"tl::__sync_thread_partial\(\d, 128\);", lines[i + 1])):
            out += [lines[i + 2], lines[i]]
            i, n = i + 3, n + 1
            continue
        out.append(lines[i])
        i += 1
    expect("difference 4 (the epilogue's fence and barrier)", n, CONSUMERS)
    # 5. bug 3 fixed: m_cur starts at a floor that stays finite once scaled (the lowest float halved,
    # over max(scale_log2, 1)), where the seed fills it with -inf; TileLang folds our floor into the
    # fill, where it puts the seed's -inf in a variable first
    floor = re.compile(rf"\*\(float2\*\)\((m_cur(?:_\d+)?) \+ 0\) = make_float2\((?P<f>\(-0x1\.fffffep\+126f/\*-1\.701412e\+38\*/ / "
                       rf"max\({SCALE_EXPR.pattern}, 0x1p\+0f/\*1\.000000e\+00\*/\)\)), (?P=f)\);")
    lines, out, n = out, [], 0
    for line in lines:
        m = floor.fullmatch(line)
        if m and is_scale_log2(m["log2e"], head_dim):
            var = f"broadcast_var_{1000 + n}"  # a name of the seed's family that no statement has
            out += [f"float {var} = -CUDART_INF_F;", f"*(float2*)({m[1]} + 0) = make_float2({var}, {var});"]
            n += 1
            continue
        out.append(line)
    lines = out
    expect("difference 5 (the start of m_cur)", n, CONSUMERS)
    # 6. bug 3 fixed: the epilogue divides a row by its sum only where the sum is not 0 (a row with
    # nothing to attend to gives 0, not NaN); the seed divides every row
    head = re.compile(r"float (broadcast_var\w*) = 0x0p\+0f/\*0\.000000e\+00\*/;")
    out, n, i = [], 0, 0
    while i < len(lines):
        zero = head.fullmatch(lines[i])
        cond = re.fullmatch(r"float2 (condval\w*);", lines[i + 1]) if zero else None
        test = cond and re.fullmatch(r"if \(\((row_sum\w*)\[\((\w+) & 1\)\] == 0x0p\+0f/\*0\.000000e\+00\*/\)\) \{", lines[i + 2])
        if test and lines[i + 3:i + 5] == [f"{cond[1]} = make_float2({zero[1]}, {zero[1]});", "} else {"]:
            end = next(j for j in range(i + 5, len(lines)) if "{" in lines[j] or "}" in lines[j])
            quotient = re.fullmatch(rf"{cond[1]} = (\w+);", lines[end - 1])
            store = re.fullmatch(rf"(\*\(float2\*\)\(acc_o(_\d+)? \+ \({test[2]} \* 2\)\) = ){cond[1]};", lines[end + 1])
            if quotient and lines[end] == "}" and store:
                out += lines[i + 5:end - 1] + [f"{store[1]}{quotient[1]};"]
                i, n = end + 2, n + 1
                continue
        out.append(lines[i])
        i += 1
    expect("difference 6 (the epilogue's division of a nonzero row sum only)", n, CONSUMERS)
    # 7. issue 18's run-time scale: the kernel takes softmax_scale as its last parameter (in its
    # declaration and its definition) ...
    signature = re.compile(r'(extern "C" __global__ void .*), float softmax_scale\)( \{|;)')
    lines, n = out, 0
    for i, line in enumerate(lines):
        m = signature.fullmatch(line)
        if m:
            lines[i], n = f"{m[1]}){m[2]}", n + 1
    expect("difference 7 (the kernel's softmax_scale parameter)", n, 2)
    # ... and each use of scale_log2 is softmax_scale * LOG2E, where the seed has the constant
    # log2(e) / sqrt(head_dim): a factor that is not that at the default scale stays as it is
    out, n = [], 0
    for line in lines:
        new = SCALE_EXPR.sub(lambda m: "scale_log2" if is_scale_log2(m["log2e"], head_dim) else m[0], line)
        n += new != line
        out.append(new)
    expect("difference 7 (scale_log2 from softmax_scale)", n, CONSUMERS * SCALE_USES)
    return out


def seed_as_ours(lines: list, head_dim: int) -> list:
    """The seed's lowered kernel with the lowering edit of docs/seed-parity.md (difference 2) made,
    TileLang's extra fence taken out, and its constant scale named as ours is (difference 7)."""
    # 2. tile 0's row sum: no fill of row_sum (0); tile 0's sum reduces straight into row_sum
    # where the seed reduces into row_sum_tile and copies it
    out, n = [], 0
    i = 0
    while i < len(lines):
        fill = re.fullmatch(r"float (broadcast_var\w*) = 0x0p\+0f/\*0\.000000e\+00\*/;", lines[i])
        if fill and re.fullmatch(rf"\*\(float2\*\)\(row_sum(_\d+)? \+ 0\) = make_float2\({fill[1]}, {fill[1]}\);", lines[i + 1]):
            i, n = i + 2, n + 1
            continue
        out.append(lines[i])
        i += 1
    expect("difference 2 (the fill of row_sum)", n, CONSUMERS)
    lines, n = out, 0
    copy_into = re.compile(r"\*\(float2\*\)\((row_sum(?:_\d+)?) \+ 0\) = \*\(float2\*\)\((row_sum_tile(?:_\d+)?) \+ 0\);")
    for start in [i for i, line in enumerate(lines) if line == "k_empty[0].arrive();"]:
        copy = next(i for i in range(start, len(lines)) if copy_into.fullmatch(lines[i]))
        into_sum, tile_sum = copy_into.fullmatch(lines[copy]).groups()
        for i in range(start, copy):
            lines[i] = re.sub(rf"\b{tile_sum}\b", into_sum, lines[i])
        lines[copy] = None
        n += 1
    lines = [line for line in lines if line is not None]
    expect("difference 2 (tile 0's row sum)", n, CONSUMERS)
    # TileLang's fence before the second warpgroup's first QK wgmma, in the seed's text only
    out, n = [], 0
    for i, line in enumerate(lines):
        if line == "tl::fence_proxy_async();" and lines[i - 1] == "tl::warpgroup_arrive();":
            n += 1
            continue
        out.append(line)
    expect("the seed's extra fence", n, 1)
    # 7. the run-time scale: the seed's compile-time factor, which must be log2(e) / sqrt(head_dim),
    # named scale_log2 as ours is; TileLang puts the constant in a variable where it broadcasts it
    factor = re.compile(rf"\(m_cur\w*\[\(\w+ & 1\)\] \* {LITERAL.format('c')}\)")
    constants = {m[0][m[0].index(" * ") + 3:-1] for line in out for m in factor.finditer(line)}
    if len(constants) != 1:
        raise Mismatch(f"the seed's scale: the max is multiplied by {sorted(constants)}, expected one constant")
    constant = constants.pop()
    value = np.float32(float.fromhex(re.fullmatch(LITERAL.format("c"), constant)["c"]))
    if value != scale_log2(head_dim):
        raise Mismatch(f"the seed's scale {value:.9g} is not log2(e) / sqrt({head_dim}) = {scale_log2(head_dim):.9g}")
    lines, out, n, held = out, [], 0, []
    for line in lines:
        m = re.fullmatch(rf"float (broadcast_var\w*) = {re.escape(constant)};", line)
        if m:
            held.append(m[1])
            n += 1
            continue
        new = line.replace(constant, "scale_log2")
        n += new != line
        out.append(new)
    for var in held:
        uses = [i for i, line in enumerate(out) if re.search(rf"\b{var}\b", line)]
        expect(f"difference 7 (the use of the seed's {var})", len(uses), 1)
        out[uses[0]] = re.sub(rf"\b{var}\b", "scale_log2", out[uses[0]])
    expect("difference 7 (the seed's constant scale)", n, CONSUMERS * SCALE_USES)
    return out


def canonical(lines: list) -> tuple[list, list]:
    """(statements, declarations) with every name renumbered by its first use: `acc_s_1`, `i_15`,
    `condval` become `acc_s#1`, `i#7`, `condval#0` in order of appearance within their family,
    so two kernels compare equal exactly when one consistent renaming maps one onto the other.
    Local array declarations are compared as a set: their order differs, and an unused one is no statement."""
    declarations = [line for line in lines if DECLARATION.fullmatch(line)]
    body = [line for line in lines if not DECLARATION.fullmatch(line)]
    order: dict = {}

    def name(tok: str) -> str:
        base = re.fullmatch(r"(.*?)(?:_\d+)?", tok)[1] or tok
        family = order.setdefault(base, {})
        return f"{base}#{family.setdefault(tok, len(family))}"

    body = [IDENT.sub(lambda m: name(m.group(0)), line) for line in body]
    used = {tok for line in body for tok in re.findall(r"[\w]+#\d+", line)}
    decls = set()
    for line in declarations:
        tok = DECLARATION.fullmatch(line)[2]
        base = re.fullmatch(r"(.*?)(?:_\d+)?", tok)[1] or tok
        if tok in order.get(base, {}):
            decls.add(DECLARATION.sub(lambda m: f"{m[1]} {base}#{order[base][tok]}", line))
    return body, sorted(decls & {d for d in decls if re.search(r"\w+#\d+", d)[0] in used})


def compare(seed_cuda: str, ours_cuda: str, spec: attngen.Spec) -> None:
    """Raise Mismatch naming the first statement where the seed's kernel and ours (of `spec`) differ."""
    seed = [line.strip() for line in rename(seed_cuda, {**SEED_NAMES, "main_kernel": f"{make_plan(spec).name}_kernel"}).splitlines()]
    ours = [line.strip() for line in ours_cuda.splitlines()]
    a, a_decl = canonical(seed_as_ours([x for x in seed if x], spec.head_dim))
    b, b_decl = canonical(ours_as_seed([x for x in ours if x], spec.head_dim))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise Mismatch(f"statement {i}: the seed's\n  {x}\nours\n  {y}")
    if len(a) != len(b):
        raise Mismatch(f"the seed's kernel has {len(a)} statements, ours {len(b)}")
    if a_decl != b_decl:
        raise Mismatch(f"local declarations differ: only the seed's {sorted(set(a_decl) - set(b_decl))}, "
                       f"only ours {sorted(set(b_decl) - set(a_decl))}")


# -- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    spec = attngen.load_spec(ROOT / "examples" / "seed_parity.toml")
    result = build(spec, shape=Shape(*dataclasses.astuple(SEED_SHAPE)), cache_dir=tmp_path_factory.mktemp("cache"))
    return spec, result


def test_seed_configuration_matches_the_seed_figures(lowered):
    spec, result = lowered
    assert spec == attngen.Spec(head_dim=128, dtype="float16", causal=True, gqa_group=1, consumers=2,
                                k_stages=2, v_stages=2, block_m=128, block_n=128, aligned=True, steady_loop="split")
    r = result.report
    got = {k: r[k] for k in SEED if k != "sass"}
    got["sass"] = {k: r["sass"][k] for k in SEED["sass"]}
    assert got == SEED
    assert r["setmaxnreg_applied"]
    cuda = result.cuda_source
    assert "__launch_bounds__(384, 1)" in cuda
    # static shape: no runtime length parameters, grid fixed at 8 x 8 x 1 blocks
    assert "int q_len" not in cuda and "CUtensorMap O_desc" in cuda


@pytest.fixture(scope="module")
def seed_cuda():
    return lower_seed()


def test_lowered_cuda_is_the_seeds_statement_for_statement(lowered, seed_cuda):
    spec, result = lowered
    compare(seed_cuda, result.cuda_source, spec)


SCALE = "(softmax_scale * 0x1.7154764ee6c2fp+0f/*1.442695e+00*/)"  # our scale_log2 as TileLang prints it
FLOOR = f"(-0x1.fffffep+126f/*-1.701412e+38*/ / max({SCALE}, 0x1p+0f/*1.000000e+00*/))"  # our m_cur start


@pytest.mark.parametrize("edit", [
    ("ki_6 < 8", "ki_6 < 7"),  # one wgmma fewer in one QK
    ("(k_2 * 128)", "(k_2 * 112)"),  # the mask test of another tile size
    ("v__6 = *(float2*)(m_prev + 0);", "v__6 = *(float2*)(m_cur + 0);"),  # an operand names another buffer
    (f"make_float2({FLOOR}, {FLOOR})", "make_float2(-CUDART_INF_F, -CUDART_INF_F)"),  # the seed's -inf start (bug 3) in one warpgroup
    ("-0x1.fffffep+126f/*-1.701412e+38*/", "-0x1.fffffep+127f/*-3.402823e+38*/"),  # one floor not halved: -inf once scaled by > 1
    ("0x1p+0f/*1.000000e+00*/))", "0x1p-1f/*5.000000e-01*/))"),  # one floor's divisor bounded below by 0.5, not 1
    ("(i_22 & 1)] == 0x0p+0f", "(i_22 & 1)] <= 0x0p+0f"),  # one epilogue's select under another test
    # ln 2 for LOG2E in one factor
    (f"(m_cur[(i_7 & 1)] * {SCALE})", "(m_cur[(i_7 & 1)] * (softmax_scale * 0x1.62e42fefa39efp-1f/*6.931472e-01*/))"),
    ("V_desc, float softmax_scale);", "V_desc, double softmax_scale);"),  # the declaration's parameter of another type
])
def test_the_comparison_catches_a_changed_statement(lowered, seed_cuda, edit):
    spec, result = lowered
    old, new = edit
    assert old in result.cuda_source
    with pytest.raises(Mismatch):
        compare(seed_cuda, result.cuda_source.replace(old, new, 1), spec)


@pytest.mark.parametrize("count, message", [(-1, "is not log2"), (1, "the seed's constant scale")])
def test_the_comparison_catches_a_seed_of_another_scale(lowered, seed_cuda, count, message):
    """The seed's constant scale must be log2(e) / sqrt(head_dim), not just the same on both sides:
    here it is log2(e) / sqrt(64) in all its uses (-1) or in the first (1)."""
    spec, result = lowered
    constant = "0x1.0527dbd5cafffp-3f/*1.275174e-01*/"  # log2(e) / sqrt(128)
    assert constant in seed_cuda
    with pytest.raises(Mismatch, match=message):
        compare(seed_cuda.replace(constant, "0x1.7154764ee6c2fp-3f/*1.803369e-01*/", count), result.cuda_source, spec)


def test_the_comparison_catches_the_one_steady_loop(seed_cuda):
    """The default loop form is not the seed's: one loop with a per-tile mask test."""
    spec = dataclasses.replace(attngen.load_spec(ROOT / "examples" / "seed_parity.toml"), steady_loop="one")
    cuda = lower_source(render_source(spec, Shape(*dataclasses.astuple(SEED_SHAPE)))).cuda_source
    with pytest.raises(Mismatch):
        compare(seed_cuda, cuda, spec)
