"""The stamped variant of an emitted kernel for `attngen timeline --gpu`: a source transform.

The plain emitted text is never edited: `instrument(source)` parses it with `ast` and returns a
new text in which, for one chosen block, one thread per warpgroup writes `clock64()` into an
extra int64 tensor `Stamps[warpgroup, slot]` before and after every wait (mbarrier parity
wait, bar.sync, wait_wgmma) and after every issue (wgmma, TMA copy, mbarrier and named-barrier
arrive, the epilogue's store). Slot j of a warpgroup is its j-th stamp, so each stamp matches
one event of the CPU trace of the same block (`stamp_plan`), and the measured chart uses the
same lanes and hover texts as the model's.
"""

from __future__ import annotations

import ast

WAITS = {"mbarrier_wait_parity", "sync_threads", "wait_wgmma"}
ISSUES = {"wgmma_gemm", "tma_copy", "mbarrier_arrive", "named_barrier_arrive"}
SLOTS = 1024  # stamps per warpgroup (the longest kernel of 1x2x2048x2048 needs about 400)
EXTRA = ["Stamps", "stamp_n", "stamp_tx", "stamp_block"]


def _call_name(stmt) -> str | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute):
        return stmt.value.func.attr
    return None


def _is_store(stmt) -> bool:
    """T.copy(<shared>, O[...]): the epilogue's store to global memory."""
    if _call_name(stmt) != "copy":
        return False
    args = stmt.value.args
    return len(args) == 2 and isinstance(args[1], ast.Subscript) and isinstance(args[1].value, ast.Name) and args[1].value.id == "O"


def _stamp(at) -> list:
    code = ("if stamp_block:\n"
            "    if stamp_tx % 128 == 0:\n"
            f"        if stamp_n[0] < {SLOTS}:\n"
            "            Stamps[stamp_tx // 128, stamp_n[0]] = T.call_extern(\"int64\", \"clock64\")\n"
            "            stamp_n[0] = stamp_n[0] + 1\n")
    tree = ast.parse(code).body
    for node in tree:
        for n in ast.walk(node):
            if "lineno" in n._attributes:
                n.lineno = n.end_lineno = at.lineno
                n.col_offset = n.end_col_offset = 0
    return tree


class _Stamper(ast.NodeTransformer):
    def _body(self, body):
        out = []
        for stmt in body:
            stmt = self.visit(stmt)
            name = _call_name(stmt)
            if name in WAITS:
                out += _stamp(stmt) + [stmt] + _stamp(stmt)
            elif name in ISSUES or _is_store(stmt):
                out += [stmt] + _stamp(stmt)
            else:
                out.append(stmt)
        return out

    def generic_visit(self, node):
        for field in ("body", "orelse"):
            if isinstance(getattr(node, field, None), list) and not isinstance(node, (ast.Module,)):
                setattr(node, field, self._body(getattr(node, field)))
        for field, value in ast.iter_fields(node):
            if field in ("body", "orelse"):
                continue
            if isinstance(value, ast.AST):
                self.visit(value)
        return node


def _decorated(fn, name) -> bool:
    return any(isinstance(d, ast.Attribute) and d.attr == name for d in fn.decorator_list)


def instrument(source: str, block=(0, 0, 0)) -> str:
    """The stamped variant of `source` for the block (x, y, z); the input text is not modified."""
    tree = ast.parse(source)
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_kernel")
    macros = [n for n in build.body if isinstance(n, ast.FunctionDef) and _decorated(n, "macro")]
    prim = next(n for n in build.body if isinstance(n, ast.FunctionDef) and _decorated(n, "prim_func"))
    # the extra tensor, last, so Q, K, V, O keep their positions
    ann = ast.parse(f'T.Tensor([THREADS // 128, {SLOTS}], "int64")', mode="eval").body
    prim.args.args.append(ast.arg(arg="Stamps", annotation=ann))
    for m in macros:  # each macro takes the stamp state as extra trailing parameters
        m.args.args += [ast.arg(arg=a) for a in EXTRA]
        m.body = _Stamper()._body(m.body)
    macro_names = {m.name for m in macros}
    kernel = next(n for n in ast.walk(prim) if isinstance(n, ast.With) and "Kernel" in ast.unparse(n.items[0].context_expr))
    names = [e.id for e in kernel.items[0].optional_vars.elts] if isinstance(kernel.items[0].optional_vars, ast.Tuple) \
        else [kernel.items[0].optional_vars.id]
    cond = " and ".join(f"({n} == {v})" for n, v in zip(names, block))
    setup = ast.parse("stamp_tx = T.get_thread_binding()\n"
                      "stamp_n = T.alloc_local([1], \"int32\")\n"
                      "stamp_n[0] = 0\n"
                      f"stamp_block = {cond}\n").body
    for node in setup:
        for n in ast.walk(node):
            if "lineno" in n._attributes:
                n.lineno = n.end_lineno = kernel.lineno
                n.col_offset = n.end_col_offset = 0
    kernel.body = setup + _Stamper()._body(kernel.body)
    for node in ast.walk(kernel):  # pass the stamp state to every macro call
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in macro_names:
            node.args += [ast.Name(id=a, ctx=ast.Load()) for a in EXTRA]
    tree = ast.fix_missing_locations(tree)
    header = "# attngen timeline --gpu: stamped variant (instrument.py) of the kernel below; not a golden file\n"
    return header + ast.unparse(tree) + "\n"


def stamp_plan(events: list) -> list:
    """(kind, event index) per stamp slot of one warpgroup, matching instrument(): a wait is
    stamped before and after, an issue after. Trace events -> the stamps they produce."""
    plan = []
    for i, e in enumerate(events):
        if e.kind in ("mbar_wait", "wgmma_wait"):
            plan += [("before", i), ("after", i)]
        elif e.kind == "bar_wait":
            plan += [("before", i - 1), ("after", i)]  # bar.sync records its arrive, then its wait
        elif e.kind in ("wgmma", "tma_issue", "mbar_arrive") or (e.kind == "bar_arrive" and not e.info["sync"]):
            plan.append(("after", i))
        elif e.kind == "copy" and e.info["scopes"] == "shared->global":
            plan.append(("after", i))
    return plan
