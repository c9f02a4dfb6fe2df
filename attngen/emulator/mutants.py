"""Systematic mutants of an emitted kernel, for measuring what the emulator catches.

`generate(source)` finds, with `ast`, every synchronization statement of the emitted text
and every mask or tile-count bound, and makes one mutant per edit (edits are made on
lines, so line numbers of untouched code stay put):

- move-up / move-down: an arrive, wait, fence or barrier swapped with its previous / next
  statement in the same block (a compound neighbour moves as a whole);
- drop: an arrive, fence or barrier (bar.sync) replaced by `pass`;
- depth+1 / depth-1: `T.wait_wgmma(n)` with n + 1 / n - 1 (not below 0);
- parity: the parity argument of an mbarrier wait flipped (`^ 1`);
- bound: a comparison in a mask (`T.if_then_else` inside `T.Parallel`) or in a test of a
  tile count shifted by one (`<` <-> `<=`, `>` <-> `>=`); an integer constant in a
  tile-count expression (an assignment to a name containing "tiles" or "split", or to the
  backward's q_first, n_q, full_first, full_stop, or the bounds of a `T.serial` loop) moved by
  one either way; a tile-count assignment's whole right-hand side plus or minus one.

Each mutant has a stable id built from the statement texts (comments stripped), not
from line numbers, so lists of ids survive template edits that move lines.
`EQUIVALENT` lists mutants that no checker can catch because the edit does not make the
kernel wrong, each with its argument (docs/emulator.md, "Mutation score").
"""

from __future__ import annotations

import ast
import dataclasses
import re

ARRIVES = {"mbarrier_arrive", "barrier_arrive", "named_barrier_arrive"}
WAITS = {"mbarrier_wait_parity", "barrier_wait", "wait_wgmma", "tma_store_wait"}
BARRIERS = {"sync_threads"}
FENCES = {"fence_proxy_async"}
PARITY_WAITS = {"mbarrier_wait_parity", "barrier_wait"}
# tile counts: the forward's n_tiles, full_tiles, split; the backward's Q-tile range of a KV tile
TILE_NAME = re.compile(r"tiles|split|^n_q$|^q_first$|^full_first$|^full_stop$")


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str  # stable: operation and statement texts (+ " #n" for the n-th identical one)
    op: str  # move-up, move-down, drop, depth+1, depth-1, parity, bound
    line: int  # the edited line of the original source (1-based)
    source: str = dataclasses.field(repr=False)  # the mutated source
    call: str = ""  # the T.<call> of the edited statement ("" for bounds)
    crossed: frozenset = frozenset()  # moves: the T.<calls> inside the statement moved across
    uses_crossed_defs: bool = False  # moves: the statement reads a name the crossed one assigns

    def describe(self) -> str:
        return f"line {self.line}: {self.id}"


def _t_call(node, t_names):
    """`T.<name>(...)` as an expression statement -> name, else None."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        f = node.value.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in t_names:
            return f.attr
    return None


def _strip(text: str) -> str:
    """A line without its comment and surrounding blanks (ids must not depend on comments)."""
    out, quote = [], None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            break
        out.append(ch)
    return "".join(out).strip()


class _Source:
    def __init__(self, source: str):
        self.text = source
        self.lines = source.splitlines(keepends=True)
        self.tree = ast.parse(source)
        self.t_names = {"T"}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "tilelang.language" and a.asname:
                        self.t_names.add(a.asname)

    def span(self, stmt):
        start = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
        return start, stmt.end_lineno  # 1-based, inclusive

    def head(self, stmt) -> str:
        return _strip(self.lines[stmt.lineno - 1])

    def swapped(self, a, b) -> str:
        """Source with consecutive sibling statements a (first) and b swapped; what lies between stays."""
        a0, a1 = self.span(a)
        b0, b1 = self.span(b)
        L = self.lines
        out = L[:a0 - 1] + L[b0 - 1:b1] + L[a1:b0 - 1] + L[a0 - 1:a1] + L[b1:]
        return "".join(out)

    def replaced(self, stmt, new_first_line: str) -> str:
        """Statement replaced by one line at its indentation (blank lines keep the numbering)."""
        s0, s1 = self.span(stmt)
        first = self.lines[s0 - 1]
        indent = first[: len(first) - len(first.lstrip())]
        new = [indent + new_first_line + "\n"] + ["\n"] * (s1 - s0)
        return "".join(self.lines[:s0 - 1] + new + self.lines[s1:])

    def edit_segment(self, node, new_text: str) -> str:
        """Replace the text of a single-line expression node."""
        assert node.lineno == node.end_lineno
        i = node.lineno - 1
        line = self.lines[i]
        b = line.encode()
        new_line = (b[:node.col_offset] + new_text.encode() + b[node.end_col_offset:]).decode()
        return "".join(self.lines[:i] + [new_line] + self.lines[i + 1:])

    def segment(self, node) -> str:
        return ast.get_source_segment(self.text, node)


def _names_read(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _names_assigned(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _calls(node, t_names) -> frozenset:
    return frozenset(n.func.attr for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                     and isinstance(n.func.value, ast.Name) and n.func.value.id in t_names)


def _bodies(tree):
    """Every statement list of the module (block bodies), in source order."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


_OFF_BY_ONE = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
_OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


def _compare_flips(src: _Source, expr):
    """(node, new text) for each <, <=, >, >= comparison in expr, shifted by one."""
    for node in ast.walk(expr):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _OFF_BY_ONE:
            if node.lineno != node.end_lineno:
                continue
            left, right = src.segment(node.left), src.segment(node.comparators[0])
            yield node, f"{left} {_OFF_BY_ONE[type(node.ops[0])]} {right}", f"{left} {_OP_TEXT[type(node.ops[0])]} {right}"


def _int_constants(expr):
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and type(node.value) is int and node.lineno == node.end_lineno:
            yield node


def _in_parallel(tree):
    """Nodes lying inside a `for ... in T.Parallel(...)` loop."""
    inside = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Attribute)
                and node.iter.func.attr == "Parallel"):
            for sub in node.body:
                inside.update(id(n) for n in ast.walk(sub))
    return inside


def generate(source: str) -> list[Mutant]:
    src = _Source(source)
    raw = []  # (op, line, id text, mutated source, call, crossed calls, uses crossed defs)

    # -- synchronization statements: moves, drops, depths, parities ---------------------------
    for body in _bodies(src.tree):
        for i, stmt in enumerate(body):
            name = _t_call(stmt, src.t_names)
            if name is None or name not in ARRIVES | WAITS | BARRIERS | FENCES:
                continue
            text = src.head(stmt)
            reads = _names_read(stmt)
            for op, j, word in (("move-up", i - 1, "over"), ("move-down", i + 1, "under")):
                if 0 <= j < len(body):
                    other = body[j]
                    first, second = (other, stmt) if j < i else (stmt, other)
                    raw.append((op, stmt.lineno, f"{op} {text} {word} {src.head(other)}", src.swapped(first, second),
                                name, _calls(other, src.t_names), bool(reads & _names_assigned(other))))
            if name in ARRIVES | BARRIERS | FENCES:
                raw.append(("drop", stmt.lineno, f"drop {text}", src.replaced(stmt, f"pass  # dropped: {text}"), name))
            call = stmt.value
            if name == "wait_wgmma" and call.args and isinstance(call.args[0], ast.Constant):
                n = call.args[0].value
                for d, op in ((1, "depth+1"), (-1, "depth-1")):
                    if n + d >= 0:
                        raw.append((op, stmt.lineno, f"{op} {text}", src.edit_segment(call.args[0], str(n + d)), name))
            if name in PARITY_WAITS and len(call.args) >= 2:
                p = call.args[1]
                flipped = str(1 - p.value) if isinstance(p, ast.Constant) and p.value in (0, 1) else f"({src.segment(p)}) ^ 1"
                raw.append(("parity", stmt.lineno, f"parity {text}", src.edit_segment(p, flipped), name))

    # -- mask and tile-count bounds -------------------------------------------------------------
    parallel = _in_parallel(src.tree)
    for node in ast.walk(src.tree):
        # comparisons in masks: T.if_then_else(cond, ...) inside T.Parallel
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "if_then_else"
                and id(node) in parallel and node.args):
            for cmp, new, old in _compare_flips(src, node.args[0]):
                raw.append(("bound", cmp.lineno, f"bound {old} -> {new} in {_strip(src.lines[cmp.lineno - 1])}",
                            src.edit_segment(cmp, new)))
        # comparisons in tests of tile counts: `if full_tiles < 1:`
        if isinstance(node, ast.If) and any(isinstance(n, ast.Name) and TILE_NAME.search(n.id) for n in ast.walk(node.test)):
            for cmp, new, old in _compare_flips(src, node.test):
                raw.append(("bound", cmp.lineno, f"bound {old} -> {new} in {src.head(node)}", src.edit_segment(cmp, new)))
        # tile-count assignments: constants +-1, the whole right-hand side +-1
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and TILE_NAME.search(node.targets[0].id) and node.value.lineno == node.value.end_lineno):
            target = node.targets[0].id
            for c in _int_constants(node.value):
                for d in (1, -1):
                    if c.value + d >= 0:
                        raw.append(("bound", c.lineno, f"bound {target}: constant {c.value} -> {c.value + d} in {src.head(node)}",
                                    src.edit_segment(c, str(c.value + d))))
            rhs = src.segment(node.value)
            for d, sign in ((1, "+"), (-1, "-")):
                raw.append(("bound", node.lineno, f"bound {target} {sign} 1 in {src.head(node)}",
                            src.edit_segment(node.value, f"({rhs}) {sign} 1")))
        # tile loops: constant bounds of T.serial(...)
        if (isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Attribute)
                and node.iter.func.attr == "serial"):
            for c in _int_constants(node.iter):
                for d in (1, -1):
                    if c.value + d >= 0:
                        raw.append(("bound", c.lineno, f"bound loop: constant {c.value} -> {c.value + d} in {src.head(node)}",
                                    src.edit_segment(c, str(c.value + d))))

    # Stable ids (the n-th identical edit gets " #n"), no duplicates, no no-ops.
    out, seen_ids, seen_src = [], {}, {source}
    for op, line, ident, text, *rest in sorted(raw, key=lambda r: (r[1], r[0], r[2])):
        n = seen_ids[ident] = seen_ids.get(ident, 0) + 1
        if n > 1:
            ident = f"{ident} #{n}"
        if text in seen_src:  # a swap of two sync statements is made once (as the first one's move)
            continue
        seen_src.add(text)
        out.append(Mutant(ident, op, line, text, *rest))
    return out


# -- mutants that are not bugs ---------------------------------------------------------------------
REASONS = {
    "stronger": "a wait moved earlier, an arrive moved later (or a deeper wgmma wait): the mutant's happens-before "
                "contains the original's, so it cannot race and computes the same values; it could only deadlock, "
                "which the emulator reports, and did not",
    "waits-swapped": "two adjacent waits swapped: every access after the pair is still after both",
    "pingpong": "the ping-pong named barriers order no data (consumers share only read-only Q/K/V tiles and "
                "write disjoint O rows): moving or dropping one changes which warpgroup issues first, or "
                "deadlocks (reported), but cannot race or change a value",
    "last-release": "a release after the last load into that stage: the producer loads nothing more into it, "
                    "so no write can race with the reads it protects, and nobody waits for it",
    "k-release-ordered-by-v": "the producer loads K(k + K_STAGES) only after V(k + K_STAGES - 1), which waits for the "
                              "release of V(k + K_STAGES - 1 - V_STAGES); with K_STAGES >= V_STAGES (the prologue's "
                              "release, or no k_empty wait at all: K_STAGES > V_STAGES) that release follows the "
                              "wait_wgmma(0) of an iteration >= k, so QK(k) has retired before the load: v_empty "
                              "orders it",
    "mask-no-op": "masks more than needed only where the mask keeps everything anyway (a full tile masked, a tile "
                  "past every row's last key loaded and masked whole): exp2(-inf) = 0 leaves every sum as it was",
    "same-value": "the edited expression has the same value for every shape: ceildiv(max(x, 2), BLOCK_N) = "
                  "ceildiv(max(x, 1), BLOCK_N); the backward's floordiv(max(x, 1), BLOCK_M) = floordiv(max(x, 0), BLOCK_M)",
    # the backward module (kernels/bwd/render.py)
    "do-release-ordered-by-q": "the backward's producer waits for q_empty[stage] before it loads Q and then dO into the "
                               "stage, and q_empty is arrived on after the wait_wgmma(0) that retires every wgmma "
                               "reading the stage's dO too (wgmmas retire oldest first): do_empty orders nothing "
                               "that q_empty does not",
    "masked-extra-visit": "the backward's KV tile visits one Q tile more than it needs (before q_first or from q_stop "
                          "on): no row of that tile sees the KV tile, the visit is masked (q_tile < full_first, "
                          "q_tile >= full_stop or past q_len) and its mask keeps no entry, so P = dS = 0 and it adds "
                          "nothing to dK, dV or dQ",
    "phantom-row": "row q_len, past the end: TMA zero-fills its Q, dO, LSE2 and dPsum rows, so S = 0, P = exp2(0 - 0) = 1, "
                   "dP = dPsum = 0: it adds P^T dO = 0 to dV, dS = 0 to dK and dQ, and its dQ row is dropped (a "
                   "score_mod could make that P infinite, hence the condition)",
    "unstored-row": "the preprocess's rows past q_len read row q_len - 1 (the index is clamped) and are never stored "
                    "(the store has its own r0 + i < q_len)",
    "no-left-edge": "without a left window edge full_stop = ceil(q_len / BLOCK_M), which no visited Q tile reaches: "
                    "q_tile >= full_stop is false with or without the edit",
}


# (id pattern, reason, condition on the spec or None), first match wins; only survivors are
# looked up. Every entry is argued in docs/emulator.md ("Mutation score").
EQUIVALENT = [
    # happens-before only grows
    (r"^depth-1 T\.wait_wgmma\(1\)", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(q_full, 0\) over T\.fill\(", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(k_full\[k_stage\], .*\) over v_stage_prev = ", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(v_full\[v_stage_(prev|last)\], .*\) over for i, j in T\.Parallel\(", "stronger", None),
    (r"^move-up T\.wait_wgmma\(0\) over T\.reduce_sum\(", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(k_empty\[0\]\) under full_tiles = ", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(k_empty\[k_stage\]\) under (T\.copy\(m_cur, m_prev\)|for i, j in T\.Parallel\(|diag = |if k )",
     "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(v_empty\[v_stage_(prev|last)\]\) under for i(, j)? in T\.Parallel\(", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(k_full\[k_stage\]\) under v_stage = ", "stronger", None),
    (r"^move-down T\.mbarrier_wait_parity\(q_full, 0\) under T\.mbarrier_wait_parity\(k_full\[0\], 0\)$", "waits-swapped", None),
    # the ping-pong ring
    (r"^drop T\.sync_threads\(wait_bar, PINGPONG_THREADS\)", "pingpong", None),
    (r"^move-(up|down) T\.sync_threads\(wait_bar, PINGPONG_THREADS\) ", "pingpong", None),
    (r"^move-(up|down) T\.named_barrier_arrive\(signal_bar, PINGPONG_THREADS\) ", "pingpong", None),
    (r"^move-down T\.mbarrier_wait_parity\(q_full, 0\) under if g == \d+:$", "pingpong", None),
    # early K releases ordered through the V pipeline
    (r"^move-down T\.wait_wgmma\(1\) under T\.mbarrier_arrive\(k_empty\[k_stage\]\)", "k-release-ordered-by-v",
     lambda spec: spec.k_stages >= spec.v_stages),
    (r"^move-down T\.wait_wgmma\(0\) under T\.mbarrier_arrive\(k_empty\[0\]\)$", "k-release-ordered-by-v",
     lambda spec: spec.k_stages > spec.v_stages),
    (r"^move-down T\.mbarrier_wait_parity\(k_empty\[k_stage\], .*\) under T\.tma_copy\(K\[", "k-release-ordered-by-v",
     lambda spec: spec.k_stages > spec.v_stages),
    # releases nobody waits for
    (r"^(move-down T\.wait_wgmma\(0\) under |drop )T\.mbarrier_arrive\(v_empty\[v_stage_last\]\)$", "last-release", None),
    # bounds
    (r"^bound full_tiles - 1 in ", "mask-no-op", None),
    (r"^bound full_tiles: constant 1 -> 0 in full_tiles = T\.floordiv\(q0 \+ row0 \+ causal_offset \+ 1, BLOCK_N\)$",
     "mask-no-op", None),
    (r"^bound full_tiles < 1 -> full_tiles <= 1 in if full_tiles < 1:$", "mask-no-op", None),
    (r"^bound n_tiles \+ 1 in ", "mask-no-op", None),
    (r"^bound n_tiles: constant 1 -> 2 in n_tiles = T\.min\(T\.ceildiv\(kv_len, BLOCK_N\), T\.ceildiv\(T\.max\(", "same-value", None),
    # the backward module: happens-before only grows
    (r"^move-up T\.mbarrier_wait_parity\(kv_full, 0\) over T\.fill\(", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(q_full\[stage\], phase\) over m0 = q_tile \* BLOCK_M$", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(do_full\[stage\], phase\) over T\.wgmma_gemm\(K_shared", "stronger", None),
    (r"^move-up T\.mbarrier_wait_parity\(q_empty\[stage\], .*\) over m0 = \(q_first \+ m\) \* BLOCK_M$", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(q_empty\[stage\]\) under T\.mbarrier_arrive\(do_empty\[stage\]\)$", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(do_empty\[stage\]\) under T\.copy\(acc_dq, dQ_shared", "stronger", None),
    (r"^move-down T\.mbarrier_arrive\(q_full\[stage\]\) under T\.mbarrier_wait_parity\(do_empty\[stage\]", "stronger", None),
    (r"^move-down T\.mbarrier_wait_parity\(do_empty\[stage\], .*\) under T\.tma_copy\(dO\[", "do-release-ordered-by-q", None),
    # the backward module: bounds
    (r"^bound r0 \+ i < q_len -> r0 \+ i <= q_len in prod\[i, j\] = ", "unstored-row", None),
    (r"^bound m0 \+ j < q_len -> m0 \+ j <= q_len in acc_s\[i, j\] = ", "phantom-row", lambda spec: not spec.score_mod),
    (r"^bound (m0 \+ BLOCK_M > q_len -> m0 \+ BLOCK_M >= q_len|q_tile < full_first -> q_tile <= full_first) in if q_tile ",
     "mask-no-op", None),
    (r"^bound full_first( \+ 1|: constant 0 -> 1|: constant 1 -> 0) in full_first = ", "mask-no-op", None),
    (r"^bound full_stop - 1 in full_stop = ", "mask-no-op", None),
    (r"^bound (q_tile >= full_stop -> q_tile > full_stop in if q_tile |full_stop \+ 1 in full_stop = )", "no-left-edge",
     lambda spec: spec.window[0] < 0),
    (r"^bound (q_first - 1|n_q \+ 1|n_q: constant 0 -> 1) in (q_first|n_q) = ", "masked-extra-visit", None),
    (r"^bound q_first: constant 0 -> 1 in q_first = T\.floordiv\(T\.max\(", "same-value", None),
]


def equivalent(m: Mutant, spec) -> str | None:
    """The reason key if m is a documented equivalent mutant for this spec, else None."""
    for pattern, reason, cond in EQUIVALENT:
        if re.search(pattern, m.id) and (cond is None or cond(spec)):
            return reason
    return None


def strengthens(m: Mutant) -> bool:
    """The edit only adds happens-before: a wait moved up (a wgmma wait not across a wgmma issue),
    an arrive moved down, a wgmma wait made deeper; never across an assignment it reads."""
    if m.op == "depth-1":
        return True
    if m.uses_crossed_defs:
        return False
    if m.op == "move-up" and m.call in PARITY_WAITS:
        return True
    if m.op == "move-up" and m.call == "wait_wgmma":
        return "wgmma_gemm" not in m.crossed
    if m.op == "move-down" and m.call in {"mbarrier_arrive", "barrier_arrive"}:
        return True
    return False
