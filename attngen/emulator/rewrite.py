"""The small `ast` pass that lets the emitted TileLang text run as Python with GPU meaning.

The emitted module is ordinary Python; only four things need a different meaning:

- imports of `tilelang...` bind the CPU implementation instead of the real package;
- `with T.ws(g):` runs its body only on warpgroup g: it becomes `if T.ws(g):`, and T.ws
  returns a per-thread mask;
- every `if` goes through `__rt__.cond(test)`: a test on the thread index becomes "how many
  of this agent's threads take the branch" (0: skipped; else the body runs once with that
  thread count, which is what barrier arrivals count); a test on `T.Parallel` indices runs
  the body once under the mask of the elements that take it; a plain test behaves as in
  Python. Subscripts in a test go through `__rt__.value`, so a test on per-element buffer
  values (not modeled) is told apart from one on the indices;
- `and` / `or` / `not` and chained comparisons work element-wise on the index arrays of
  `T.Parallel` and on thread masks (short-circuiting as usual on plain values);
- the destination of `T.atomic_add(dst[i, j], value)` names elements, it does not load them:
  the subscript becomes `__rt__.target(dst)[i, j]` (memory.Target).

Line numbers are kept, so tracebacks and reports point at the emitted source.
"""

from __future__ import annotations

import ast

from attngen.emulator.errors import UnsupportedConstruct

RT = "__rt__"  # helper object injected into the module namespace
TL = "__tilelang__"  # the CPU stand-in for the `tilelang` package
ATOMIC_CALLS = ("atomic_add",)  # T.<name>(dst, ...) whose dst subscript is an address


def _at(new, node):
    """Place a synthesized node on `node`'s first line (so errors in it report that line)."""
    for n in ast.walk(new):
        if "lineno" in n._attributes and getattr(n, "lineno", None) is None:
            n.lineno, n.col_offset = node.lineno, node.col_offset
            n.end_lineno, n.end_col_offset = node.lineno, node.col_offset
    return new


def _call(name: str, args, node) -> ast.Call:
    call = ast.Call(func=ast.Attribute(value=ast.Name(id=RT, ctx=ast.Load()), attr=name, ctx=ast.Load()), args=args, keywords=[])
    return _at(call, node)


def _thunk(expr) -> ast.Lambda:
    no_args = ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[])
    lam = ast.Lambda(args=no_args, body=expr)
    return _at(lam, expr)


class _MarkReads(ast.NodeTransformer):
    """`x[i]` -> `__rt__.value(x[i])` (loads only)."""

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load):
            return _call("value", [node], node)
        return node


class _Rewriter(ast.NodeTransformer):
    def __init__(self, filename: str):
        self.filename = filename
        self.t_aliases: set[str] = set()
        self.alloc_names: dict[int, str] = {}  # line of `x = T.alloc_*(...)` -> "x"
        self.counter = 0

    # -- imports ---------------------------------------------------------------
    def _bind(self, name: str, dotted: str, node):
        expr = ast.Name(id=TL, ctx=ast.Load())
        for part in dotted.split(".")[1:]:
            expr = ast.Attribute(value=expr, attr=part, ctx=ast.Load())
        if dotted == "tilelang.language":
            self.t_aliases.add(name)
        return _at(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=expr), node)

    def visit_Import(self, node):
        keep, out = [], []
        for alias in node.names:
            if alias.name == "tilelang" or alias.name.startswith("tilelang."):
                if alias.asname:
                    out.append(self._bind(alias.asname, alias.name, node))
                else:  # `import tilelang.language` binds the top-level name
                    out.append(self._bind("tilelang", "tilelang", node))
            else:
                keep.append(alias)
        if keep:
            out.insert(0, _at(ast.Import(names=keep), node))
        return out

    def visit_ImportFrom(self, node):
        mod = node.module or ""
        if node.level == 0 and (mod == "tilelang" or mod.startswith("tilelang.")):
            out = []
            for alias in node.names:
                if alias.name == "*":
                    raise UnsupportedConstruct(f"`from {mod} import *` at {self.filename}:{node.lineno}")
                out.append(self._bind(alias.asname or alias.name, f"{mod}.{alias.name}", node))
            return out
        if mod == "__future__" and any(a.name == "annotations" for a in node.names):
            raise UnsupportedConstruct(f"`from __future__ import annotations` at {self.filename}:{node.lineno} "
                                       f"(tensor annotations must be evaluated)")
        return node

    # -- names of allocations (for reports) ------------------------------------
    def visit_Assign(self, node):
        v = node.value
        if (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute) and v.func.attr.startswith("alloc_")):
            self.alloc_names[node.lineno] = node.targets[0].id
        self.generic_visit(node)
        return node

    # -- warp specialization and thread-dependent branches ---------------------
    def _is_ws(self, expr) -> bool:
        return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "ws"
                and isinstance(expr.func.value, ast.Name) and expr.func.value.id in self.t_aliases)

    def visit_With(self, node):
        if any(self._is_ws(item.context_expr) for item in node.items):
            if len(node.items) != 1 or node.items[0].optional_vars is not None:
                raise UnsupportedConstruct(f"`with T.ws(...)` combined with other context managers at {self.filename}:{node.lineno}")
            return self.visit(_at(ast.If(test=node.items[0].context_expr, body=node.body, orelse=[]), node))
        self.generic_visit(node)
        return node

    def visit_If(self, node):
        self.generic_visit(node)
        node.test = _MarkReads().visit(node.test)
        self.counter += 1
        var = f"__branch_{node.lineno}_{self.counter}"

        def name(ctx):
            return ast.Name(id=var, ctx=ctx)

        def guarded(attr, enter, body):
            inner = ast.With(items=[ast.withitem(context_expr=ast.Call(
                func=ast.Attribute(value=name(ast.Load()), attr=enter, ctx=ast.Load()), args=[], keywords=[]))], body=body)
            test = ast.Attribute(value=name(ast.Load()), attr=attr, ctx=ast.Load())
            return ast.If(test=test, body=[inner], orelse=[])

        out = [ast.Assign(targets=[name(ast.Store())], value=_call("cond", [node.test], node.test)),
               guarded("then", "taken", node.body)]
        if node.orelse:
            out.append(guarded("other", "not_taken", node.orelse))
        return [_at(n, node.test) for n in out]

    # -- atomics: the destination subscript is an address, not a load ----------
    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr in ATOMIC_CALLS and isinstance(f.value, ast.Name)
                and f.value.id in self.t_aliases):
            if node.args:
                node.args[0] = self._target(node.args[0])
            for kw in node.keywords:
                if kw.arg == "dst":
                    kw.value = self._target(kw.value)
        return node

    @staticmethod
    def _target(expr):
        if not isinstance(expr, ast.Subscript):
            return expr
        return _at(ast.Subscript(value=_call("target", [expr.value], expr), slice=expr.slice, ctx=ast.Load()), expr)

    # -- element-wise logic ----------------------------------------------------
    def visit_BoolOp(self, node):
        self.generic_visit(node)
        fn = "and_" if isinstance(node.op, ast.And) else "or_"
        expr = node.values[0]
        for nxt in node.values[1:]:
            expr = _call(fn, [expr, _thunk(nxt)], node)
        return expr

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return _call("not_", [node.operand], node)
        return node

    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) == 1:
            return node
        parts = []
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            parts.append(_at(ast.Compare(left=left, ops=[op], comparators=[right]), node))
            left = right
        expr = parts[0]
        for p in parts[1:]:
            expr = _call("and_", [expr, _thunk(p)], node)
        return expr


class Rewritten:
    """The compiled, rewritten module and what the reports need from the source."""

    def __init__(self, code, filename: str, lines: list[str], alloc_names: dict[int, str], t_aliases: set[str]):
        self.code, self.filename, self.lines, self.alloc_names, self.t_aliases = code, filename, lines, alloc_names, t_aliases

    def line_text(self, line) -> str:
        if line is None or not 1 <= line <= len(self.lines):
            return ""
        return self.lines[line - 1].strip()


def rewrite(source: str, filename: str) -> Rewritten:
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise UnsupportedConstruct(f"the emitted source does not parse: {filename}:{e.lineno}: {e.msg}") from None
    rw = _Rewriter(filename)
    tree = ast.fix_missing_locations(rw.visit(tree))
    code = compile(tree, filename, "exec", dont_inherit=True)
    return Rewritten(code, filename, source.splitlines(), rw.alloc_names, rw.t_aliases)
