"""The score_mod / mask_mod expression language: one parser for the kernel, the reference and the emulator.

An expression is Python syntax read with `ast` and checked against a whitelist:

    score (score_mod only)   q . k / sqrt(head_dim), as in FlexAttention
    b, h, q_idx, kv_idx      batch, query head, query row, key column (integers)
    numeric literals         2, 0.5, 1e-3
    name[index, ...]         a float32 call-time tensor (bias[h], doc[b, q_idx], table[q_idx - kv_idx + 64]);
                             indices are integer expressions, clamped to the tensor's extent
    name.int32[index, ...]   an int32 call-time tensor (exact ids, tables of indices): its entries
                             are integers, usable as indices, in % and // and compared exactly
    + - * /  unary -         arithmetic (/ is true division)
    a % n, a // n            integer remainder and floor division (document ids, strided patterns):
                             a an integer expression, n a nonzero integer literal; Python's floor
                             semantics (the result takes n's sign), as torch's % and // on ints;
                             n may be an integer expression too (a tensor entry, 1 + kv_idx): then
                             a % 0 and a // 0 are 0 (the kernel never divides by zero)
    a & b, a | b, a ^ b      bitwise, on integer expressions (kv_idx & 1)
    tanh exp exp2 log sin cos tan sqrt pow(a, b) abs min max where(cond, a, b)
    == != < <= > >=  and or not   comparisons and boolean logic

An expression is at most MAX_CHARS characters, MAX_NODES syntax nodes and MAX_DEPTH deep (the
checker, the emitter and TVM's parser all recurse over it); a literal must be a finite float32
(or, if an integer, an int32): the kernel computes in those types.

`parse` returns an `Expr` (or raises ExprError naming the column and what is allowed);
`evaluate` runs it with numpy in float64 (the reference); `emit` prints it as TileLang
(the template). This module imports nothing from attngen: spec, plan, render and reference
all sit above it.
"""

from __future__ import annotations

import ast
import dataclasses
import keyword
import math

import numpy as np

INT, FLOAT, BOOL = "int", "float", "bool"
INDEX_VARS = ("b", "h", "q_idx", "kv_idx")
FUNCS = {"tanh": 1, "exp": 1, "log": 1, "abs": 1, "min": 2, "max": 2, "where": 3,
         "exp2": 1, "sin": 1, "cos": 1, "tan": 1, "sqrt": 1, "pow": 2}
FLOAT_FUNCS = ("tanh", "exp", "log", "exp2", "sin", "cos", "tan", "sqrt", "pow")  # float32 in and out
NUMPY_FUNCS = {"tanh": np.tanh, "exp": np.exp, "log": np.log, "abs": np.abs, "min": np.minimum, "max": np.maximum,
               "exp2": np.exp2, "sin": np.sin, "cos": np.cos, "tan": np.tan, "sqrt": np.sqrt, "pow": np.power}
BITWISE = {ast.BitAnd: "bitwise_and", ast.BitOr: "bitwise_or", ast.BitXor: "bitwise_xor"}  # integers only
# A tensor axis indexed by exactly one of these has that extent (the runtime checks it);
# any other index makes the axis free (any extent >= 1).
AXIS_OF = {"b": "batch", "h": "heads", "q_idx": "q_len", "kv_idx": "kv_len"}
# Names a call-time tensor may not take: the variables, the functions, the arguments of
# attngen.attention/emulate, and Python keywords.
RESERVED = frozenset(INDEX_VARS) | {"score"} | set(FUNCS) | {
    "q", "k", "v", "out", "spec", "seed", "policy", "source", "causal", "window", "softcap",
    "alibi_slopes", "sinks", "return_lse", "lse", "softmax_scale", "scale", "T",
}

MAX_CHARS = 1000
MAX_NODES = 256
MAX_DEPTH = 64
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = 2**31 - 1

ALLOWED = ("allowed: score (score_mod only), b, h, q_idx, kv_idx, numbers, tensors like bias[h], "
           "+ - * / (int % // & | ^), tanh exp exp2 log sin cos tan sqrt pow abs min max where, comparisons, and or not")


class ExprError(ValueError):
    """A bad expression: the column (1-based) and what went wrong."""

    def __init__(self, col: int, message: str):
        self.col, self.message = col, message
        super().__init__(f"at column {col}: {message}")


@dataclasses.dataclass(frozen=True)
class Expr:
    text: str
    kind: str  # "score_mod" or "mask_mod"
    tree: ast.expr = dataclasses.field(compare=False, repr=False)
    types: dict = dataclasses.field(compare=False, repr=False)  # id(node) -> INT/FLOAT/BOOL
    tensors: tuple  # ((name, (axis extent or None, ...)), ...) in order of first use
    uses: frozenset  # the variables it reads
    int_tensors: frozenset = frozenset()  # the tensors written name.int32[...]: int32 kernel parameters

    @property
    def canonical(self) -> str:
        """The text as the parsed tree prints it (ast.unparse): spacing, redundant parentheses and
        comments dropped and identifiers NFKC-normalised, as Python reads them, so two texts of
        one kernel get one name and one hash. The presets' texts are already canonical."""
        return ast.unparse(self.tree)


def _col(node) -> int:
    return getattr(node, "col_offset", 0) + 1


def _is_name(node, name) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def tensor_name(sub: ast.Subscript) -> tuple:
    """(name, is_int32) of a tensor subscript `name[...]` or `name.int32[...]`, or (None, False)."""
    v = sub.value
    if isinstance(v, ast.Attribute) and v.attr == "int32" and isinstance(v.value, ast.Name):
        return v.value.id, True
    return (v.id, False) if isinstance(v, ast.Name) else (None, False)


def parse(text: str, kind: str) -> Expr:
    """Check `text` as a score_mod (numeric, may read `score`) or mask_mod (boolean)."""
    if not isinstance(text, str):
        raise ExprError(1, f"expected a string expression, got {type(text).__name__}")
    if len(text.strip()) > MAX_CHARS:
        raise ExprError(1, f"the expression is {len(text.strip())} characters long; at most {MAX_CHARS} "
                           f"(precompute the rest into a call-time tensor)")
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as e:
        raise ExprError(e.offset or 1, f"not a valid expression ({e.msg}); {ALLOWED}") from None
    except (RecursionError, MemoryError):  # nesting Python's own parser cannot take
        raise ExprError(1, f"the expression nests deeper than {MAX_DEPTH} levels; at most {MAX_DEPTH}") from None
    _check_size(tree)
    types, tensors, uses, ints = {}, {}, set(), {}

    def bad(node, what):
        raise ExprError(_col(node), f"{what} is not allowed; {ALLOWED}")

    def numeric(node, what):
        t = visit(node)
        if t not in (INT, FLOAT):
            raise ExprError(_col(node), f"{what} must be a number, got a boolean")
        return t

    def boolean(node, what):
        t = visit(node)
        if t != BOOL:
            raise ExprError(_col(node), f"{what} must be a comparison or boolean, got a number")
        return t

    def integer_op(node):
        # integers only, by a nonzero literal: the kernel's int32 floormod/floordiv, never a
        # run-time division by zero, and the same value in numpy, TileLang and Python
        sym = "%" if isinstance(node.op, ast.Mod) else "//"
        if visit(node.left) != INT:
            raise ExprError(_col(node.left), f"the left operand of {sym} must be an integer expression of b, h, "
                                             f"q_idx, kv_idx and integer literals (a tensor entry or score is a float)")
        if visit(node.right) != INT:
            raise ExprError(_col(node.right), f"the right operand of {sym} must be an integer literal (like 64) or "
                                              f"an integer expression")
        lit = node.right.operand if isinstance(node.right, ast.UnaryOp) and isinstance(node.right.op, ast.USub) \
            else node.right
        if not (isinstance(lit, ast.Constant) and type(lit.value) is int):
            return INT  # a run-time divisor: 0 gives 0 (emit, evaluate)
        if lit.value == 0:
            raise ExprError(_col(node.right), f"{sym} by the literal 0 is undefined")
        return INT

    def visit(node):
        t = _visit(node)
        types[id(node)] = t
        return t

    def _visit(node):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                bad(node, f"the literal {node.value!r}")
            _check_literal(node)
            return INT if isinstance(node.value, int) else FLOAT
        if isinstance(node, ast.Attribute):
            raise ExprError(node.end_col_offset - len(node.attr), f"the attribute access `.{node.attr}` is not allowed; {ALLOWED}")
        if isinstance(node, ast.Name):
            if node.id == "score":
                if kind != "score_mod":
                    raise ExprError(_col(node), "`score` is only defined in score_mod (a mask_mod sees positions, not scores)")
                uses.add("score")
                return FLOAT
            if node.id in INDEX_VARS:
                uses.add(node.id)
                return INT
            if node.id in FUNCS:
                bad(node, f"`{node.id}` without a call")
            bad(node, f"the name `{node.id}` (a tensor must be indexed, like {node.id}[h])")
        if isinstance(node, ast.Subscript):
            name, is_int = tensor_name(node)
            if name is None:
                bad(node, "indexing anything but a tensor name (or name.int32)")
            if ints.setdefault(name, is_int) != is_int:
                raise ExprError(_col(node), f"`{name}` is indexed both as {name}[...] (float32) and {name}.int32[...]")
            if name in RESERVED or name.startswith("_") or keyword.iskeyword(name):
                raise ExprError(_col(node), f"`{name}` cannot name a tensor (reserved); {ALLOWED}")
            idx = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if any(isinstance(i, (ast.Slice, ast.Starred)) for i in idx):
                bad(node, "a slice")
            axes = []
            for i in idx:
                if visit(i) != INT:
                    raise ExprError(_col(i), f"an index of `{name}` must be an integer expression of b, h, q_idx, kv_idx")
                axes.append(AXIS_OF.get(i.id) if isinstance(i, ast.Name) else None)
            if name in tensors:
                old = tensors[name]
                if len(old) != len(axes):
                    raise ExprError(_col(node), f"`{name}` is indexed with {len(old)} and {len(axes)} indices")
                axes = [a if a == o else None for a, o in zip(axes, old)]
            tensors[name] = tuple(axes)
            return INT if is_int else FLOAT
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.USub):
                return numeric(node.operand, "the operand of -")
            if isinstance(node.op, ast.UAdd):
                return numeric(node.operand, "the operand of +")
            if isinstance(node.op, ast.Not):
                return boolean(node.operand, "the operand of not")
            bad(node, "this unary operator")
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Mod, ast.FloorDiv)):
                return integer_op(node)
            if type(node.op) in BITWISE:
                for side in (node.left, node.right):
                    if visit(side) != INT:
                        raise ExprError(_col(side), "an operand of & | ^ must be an integer expression "
                                                    "(for conditions use and, or)")
                return INT
            if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
                bad(node, f"the operator {type(node.op).__name__}")
            a = numeric(node.left, "an operand of arithmetic")
            b = numeric(node.right, "an operand of arithmetic")
            if isinstance(node.op, ast.Div):
                if isinstance(node.right, ast.Constant) and node.right.value == 0:
                    raise ExprError(_col(node.right), "division by the literal 0 makes every value inf or NaN")
                return FLOAT
            return INT if a == b == INT else FLOAT
        if isinstance(node, ast.BoolOp):
            for v in node.values:
                boolean(v, "an operand of and/or")
            return BOOL
        if isinstance(node, ast.Compare):
            for v in [node.left] + node.comparators:
                numeric(v, "an operand of a comparison")
            for op in node.ops:
                if not isinstance(op, (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
                    bad(node, f"the comparison {type(op).__name__}")
            return BOOL
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCS:
                name = node.func.id if isinstance(node.func, ast.Name) else "this call"
                bad(node, f"calling `{name}`")
            fn, n = node.func.id, FUNCS[node.func.id]
            if node.keywords or len(node.args) != n:
                raise ExprError(_col(node), f"{fn}() takes {n} positional argument(s)")
            if fn == "where":
                boolean(node.args[0], "the condition of where()")
                a = numeric(node.args[1], "a branch of where()")
                b = numeric(node.args[2], "a branch of where()")
                return INT if a == b == INT else FLOAT
            ts = [numeric(a, f"an argument of {fn}()") for a in node.args]
            if fn in FLOAT_FUNCS:
                return FLOAT
            return INT if all(t == INT for t in ts) else FLOAT
        if isinstance(node, ast.IfExp):
            bad(node, "`x if c else y` (use where(c, x, y))")
        bad(node, f"{type(node).__name__}")

    result = visit(tree)
    if kind == "score_mod" and result == BOOL:
        raise ExprError(1, "score_mod must give a number (a new score); a boolean belongs in mask_mod")
    if kind == "mask_mod" and result != BOOL:
        raise ExprError(1, "mask_mod must give a boolean (true: the key is visible), for example q_idx >= kv_idx")
    return Expr(text, kind, tree, types, tuple(tensors.items()), frozenset(uses),
                frozenset(n for n, is_int in ints.items() if is_int))


def _check_size(tree) -> None:
    """MAX_NODES and MAX_DEPTH, counted without recursion (the checks below recurse)."""
    nodes, stack = 0, [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise ExprError(1, f"the expression has more than {MAX_NODES} syntax nodes; at most {MAX_NODES} "
                               f"(precompute the rest into a call-time tensor)")
        if depth > MAX_DEPTH:
            raise ExprError(_col(node), f"the expression nests deeper than {MAX_DEPTH} levels (a chain a + b + c ... "
                                        f"takes a level per term); at most {MAX_DEPTH}")
        stack += [(c, depth + 1) for c in ast.iter_child_nodes(node)
                  if not isinstance(c, (ast.expr_context, ast.operator, ast.unaryop, ast.boolop, ast.cmpop))]


def _check_literal(node) -> None:
    """A literal the kernel can hold: a float32 that neither overflows nor flushes a nonzero to 0,
    an int that fits int32 (index arithmetic; cast to float32 where a float is needed)."""
    v = node.value
    if isinstance(v, float):
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            raise ExprError(_col(node), f"the literal {v!r} is not a finite float32 (the kernel's arithmetic); "
                                        f"expected a magnitude of at most {FLOAT32_MAX:.7g}")
        if v != 0 and np.float32(v) == 0:
            raise ExprError(_col(node), f"the literal {v!r} is 0 in float32 (the kernel's arithmetic); "
                                        f"expected 0 or a magnitude of at least {float(np.finfo(np.float32).smallest_subnormal):.3g}")
    elif abs(v) > INT32_MAX:
        hint = f" (or the float {float(v):g})" if abs(v) <= FLOAT32_MAX else ""
        raise ExprError(_col(node), f"the integer literal {v} does not fit int32 (the kernel's index arithmetic); "
                                    f"expected a magnitude of at most {INT32_MAX}{hint}")


# -- float64 evaluation (the reference) ------------------------------------------------
def evaluate(expr: Expr, env: dict, tensors: dict, node=None):
    """numpy value of `expr` (or of `node`, one of its subtrees); `env` maps score/b/h/q_idx/kv_idx
    to broadcastable arrays, `tensors` maps each tensor name to a numpy array. Tensor indices are
    clamped to the extent."""

    def ev(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return env[node.id]
        if isinstance(node, ast.Subscript):
            name, is_int = tensor_name(node)
            arr = np.asarray(tensors[name], np.int64 if is_int else np.float64)
            return arr[read_index(node, arr.shape, ev)]
        if isinstance(node, ast.UnaryOp):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else (np.logical_not(v) if isinstance(node.op, ast.Not) else v)
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, (ast.Mod, ast.FloorDiv)):  # numpy's, like Python's: floor semantics
                f = np.mod if isinstance(node.op, ast.Mod) else np.floor_divide
                return np.where(np.equal(b, 0), 0, f(a, np.where(np.equal(b, 0), 1, b)))  # x // 0 = x % 0 = 0
            if type(node.op) in BITWISE:
                return getattr(np, BITWISE[type(node.op)])(np.asarray(a, np.int64), np.asarray(b, np.int64))
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.true_divide(a, b)
        if isinstance(node, ast.BoolOp):
            vals = [ev(v) for v in node.values]
            f = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
            out = vals[0]
            for v in vals[1:]:
                out = f(out, v)
            return out
        if isinstance(node, ast.Compare):
            ops = {ast.Eq: np.equal, ast.NotEq: np.not_equal, ast.Lt: np.less, ast.LtE: np.less_equal,
                   ast.Gt: np.greater, ast.GtE: np.greater_equal}
            left, out = ev(node.left), True
            for op, c in zip(node.ops, node.comparators):
                right = ev(c)
                out = np.logical_and(out, ops[type(op)](left, right))
                left = right
            return out
        if isinstance(node, ast.Call):
            fn, args = node.func.id, [ev(a) for a in node.args]
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                if fn == "where":
                    return np.where(args[0], args[1], args[2])
                if fn in FLOAT_FUNCS:
                    args = [np.asarray(a, np.float64) for a in args]  # pow(2, -1) is 0.5, not an integer error
                return NUMPY_FUNCS[fn](*args)
        raise AssertionError(ast.dump(node))

    return ev(expr.tree if node is None else node)


def read_index(sub: ast.Subscript, shape: tuple, ev) -> tuple:
    """The entry a tensor read `name[i, ...]` takes in a tensor of `shape`: each index as `ev`
    (an evaluator of index nodes) gives it, broadcast, clamped to the extent (as `emit` clamps).
    The reference reads through it, and its backward scatters through it (tensor_grad_terms)."""
    idx = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
    parts = np.broadcast_arrays(*[np.asarray(ev(i)) for i in idx])
    return tuple(np.clip(p, 0, n - 1) for p, n in zip(parts, shape))


def tensor_reads(e: Expr, name: str) -> list:
    """The read sites `name[...]` of a float tensor in `e`, in the tree's walk order: each is one
    term of the tensor's gradient (derivative(e, wrt=site), scattered at the site's index)."""
    return [n for n in ast.walk(e.tree) if isinstance(n, ast.Subscript) and tensor_name(n) == (name, False)]


# -- TileLang text (the kernel) --------------------------------------------------------
def emit(expr: Expr, names: dict, tensor_ref, extent, node=None) -> str:
    """TileLang source of `expr` (or of `node`, one of its subtrees: a tensor read's element).

    names: score/b/h/q_idx/kv_idx -> kernel text; tensor_ref(name) -> the kernel parameter;
    extent(name, axis) -> the axis extent's kernel text (indices are clamped to [0, extent)).
    Integer operands of float operations are cast explicitly (TVM does not promote ints in
    divisions), so the kernel computes what `evaluate` computes.
    """
    types = expr.types

    def as_float(node):
        if types[id(node)] == INT:
            if isinstance(node, ast.Constant):
                return repr(float(node.value))
            return f'T.Cast("float32", {ev(node)})'
        return ev(node)

    def operands(nodes):
        if all(types[id(n)] == INT for n in nodes):
            return [ev(n) for n in nodes]
        return [as_float(n) for n in nodes]

    def ev(node):
        if isinstance(node, ast.Constant):
            return repr(node.value)
        if isinstance(node, ast.Name):
            return names[node.id]
        if isinstance(node, ast.Subscript):
            name = tensor_name(node)[0]
            idx = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            out = []
            for axis, i in enumerate(idx):
                text, n = ev(i), extent(name, axis)
                if isinstance(i, ast.Name) and i.id in ("b", "h"):
                    out.append(text)  # always in range
                elif isinstance(i, ast.Name):  # q_idx / kv_idx: >= 0, may pass the end in a partial tile
                    out.append(f"T.min({text}, {n} - 1)")
                else:
                    out.append(f"T.min(T.max({text}, 0), {n} - 1)")
            return f"{tensor_ref(name)}[{', '.join(out)}]"
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return f"(not {ev(node.operand)})"
            sign = "-" if isinstance(node.op, ast.USub) else "+"
            return f"({sign}{ev(node.operand)})"
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Mod, ast.FloorDiv)):  # TVM's floor forms (C's % and / truncate)
                fn = "floormod" if isinstance(node.op, ast.Mod) else "floordiv"
                lit = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
                if isinstance(lit, ast.Constant):
                    return f"T.{fn}({ev(node.left)}, {ev(node.right)})"
                d = ev(node.right)  # a run-time divisor: 0 gives 0, and is never divided by
                return f"T.if_then_else({d} == 0, 0, T.{fn}({ev(node.left)}, T.if_then_else({d} == 0, 1, {d})))"
            if type(node.op) in BITWISE:
                return f"T.{BITWISE[type(node.op)]}({ev(node.left)}, {ev(node.right)})"
            op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
            if isinstance(node.op, ast.Div):
                a, b = as_float(node.left), as_float(node.right)
            else:
                a, b = operands([node.left, node.right])
            return f"({a} {op} {b})"
        if isinstance(node, ast.BoolOp):
            op = " and " if isinstance(node.op, ast.And) else " or "
            return "(" + op.join(ev(v) for v in node.values) + ")"
        if isinstance(node, ast.Compare):
            ops = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
            nodes = [node.left] + node.comparators
            texts = operands(nodes)
            parts = [f"({texts[n]} {ops[type(op)]} {texts[n + 1]})" for n, op in enumerate(node.ops)]
            return parts[0] if len(parts) == 1 else "(" + " and ".join(parts) + ")"
        if isinstance(node, ast.Call):
            fn = node.func.id
            if fn == "where":
                a, b = operands(node.args[1:])
                return f"T.if_then_else({ev(node.args[0])}, {a}, {b})"
            if fn in FLOAT_FUNCS:
                return f"T.{fn}({', '.join(as_float(a) for a in node.args)})"
            args = operands(node.args)
            return f"T.{fn}({', '.join(args)})"
        raise AssertionError(ast.dump(node))

    return ev(expr.tree if node is None else node)


# -- the symbolic derivative (the backward pass) ------------------------------------------
def derivative(e: Expr, wrt: ast.Subscript | None = None) -> Expr:
    """d(score_mod)/d(score) as an expression of the same language, parsed like any score_mod: the
    reference evaluates it with `evaluate` and a backward kernel prints it with `emit`. With `wrt`,
    one tensor read site of `e` (tensor_reads), d(score_mod)/d(that entry) instead, by the same
    rules: the site's derivative is 1, score's and every other read's 0 (a learnable tensor).

    Rules: d score = 1; a literal, b, h, q_idx, kv_idx or a tensor entry (its indices are integers)
    has derivative 0; sums, products and quotients by the usual rules; tanh(u)' = (1 - tanh(u)^2) u',
    exp(u)' = exp(u) u', log(u)' = u' / u; exp2(u)' = exp2(u) ln2 u'; sin' = cos, cos' = -sin, tan(u)' =
    u' / cos(u)^2, sqrt(u)' = u' / (2 sqrt(u)); pow(a, b)' = b pow(a, b - 1) a' + pow(a, b) log(a) b';
    abs(u)' = sign(u) u' (0 at u = 0, as torch); min(a, b)'
    and max(a, b)' take the derivative of the operand chosen (b's at a tie); where(c, a, b)' =
    where(c, a', b'). Products with 0 and 1 and sums with 0 are folded, so `score * 2` gives `2`.
    """
    if e.kind != "score_mod":
        raise ValueError(f"derivative: a {e.kind} has no derivative with respect to the score")
    zero, one = ast.Constant(0), ast.Constant(1)

    def is_const(n, v):
        return isinstance(n, ast.Constant) and n.value == v

    def add(a, b, op=ast.Add):
        if is_const(b, 0):
            return a
        if is_const(a, 0):
            return b if op is ast.Add else ast.UnaryOp(ast.USub(), b)
        return ast.BinOp(a, op(), b)

    def mul(a, b):
        if is_const(a, 0) or is_const(b, 0):
            return zero
        if is_const(a, 1):
            return b
        if is_const(b, 1):
            return a
        return ast.BinOp(a, ast.Mult(), b)

    def div(a, b):
        return zero if is_const(a, 0) else ast.BinOp(a, ast.Div(), b)

    def call(fn, *args):
        return ast.Call(ast.Name(fn, ast.Load()), list(args), [])

    def d(n):
        if isinstance(n, ast.Name):
            return one if n.id == "score" and wrt is None else zero
        if n is wrt:
            return one
        if isinstance(n, (ast.Constant, ast.Subscript)):
            return zero
        if isinstance(n, ast.UnaryOp):
            du = d(n.operand)
            return du if isinstance(n.op, ast.UAdd) or is_const(du, 0) else ast.UnaryOp(ast.USub(), du)
        if isinstance(n, ast.BinOp) and (isinstance(n.op, (ast.Mod, ast.FloorDiv)) or type(n.op) in BITWISE):
            return zero  # integer operands: no score inside
        if isinstance(n, ast.BinOp):
            a, b = n.left, n.right
            da, db = d(a), d(b)
            if isinstance(n.op, (ast.Add, ast.Sub)):
                return add(da, db, type(n.op))
            if isinstance(n.op, ast.Mult):
                return add(mul(da, b), mul(a, db))
            # (a / b)' = a' / b - a b' / (b b)
            return add(div(da, b), div(mul(a, db), ast.BinOp(b, ast.Mult(), b)), ast.Sub)
        if isinstance(n, ast.Call):
            fn, args = n.func.id, n.args
            if fn == "where":
                da, db = d(args[1]), d(args[2])
                return zero if is_const(da, 0) and is_const(db, 0) else call("where", args[0], da, db)
            if fn in ("min", "max"):
                da, db = d(args[0]), d(args[1])
                if is_const(da, 0) and is_const(db, 0):
                    return zero
                op = ast.Lt() if fn == "min" else ast.Gt()
                return call("where", ast.Compare(args[0], [op], [args[1]]), da, db)
            if fn == "pow":  # (a^b)' = b a^(b-1) a' + a^b log(a) b'
                a, b = args
                da, db = d(a), d(b)
                lower = call("pow", a, ast.BinOp(b, ast.Sub(), one))
                return add(mul(mul(b, lower), da), mul(mul(n, call("log", a)), db))
            du = d(args[0])
            if is_const(du, 0):
                return zero
            u = args[0]
            if fn == "exp2":
                return mul(mul(call("exp2", u), ast.Constant(math.log(2))), du)
            if fn == "sin":
                return mul(call("cos", u), du)
            if fn == "cos":
                return mul(ast.UnaryOp(ast.USub(), call("sin", u)), du)
            if fn == "tan":  # 1 / cos(u)^2
                return div(du, ast.BinOp(call("cos", u), ast.Mult(), call("cos", u)))
            if fn == "sqrt":
                return div(du, ast.BinOp(ast.Constant(2), ast.Mult(), call("sqrt", u)))
            if fn == "tanh":
                return mul(ast.BinOp(one, ast.Sub(), ast.BinOp(call("tanh", u), ast.Mult(), call("tanh", u))), du)
            if fn == "exp":
                return mul(call("exp", u), du)
            if fn == "log":
                return div(du, u)
            if fn == "abs":
                sign = call("where", ast.Compare(u, [ast.Gt()], [zero]), one,
                            call("where", ast.Compare(u, [ast.Lt()], [zero]), ast.UnaryOp(ast.USub(), one), zero))
                return mul(sign, du)
        raise AssertionError(ast.dump(n))

    return parse(ast.unparse(ast.fix_missing_locations(d(e.tree))), "score_mod")
