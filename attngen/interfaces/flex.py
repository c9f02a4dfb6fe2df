"""FlexAttention's front door: `flex_attention`, Python score_mod/mask_mod functions, `create_block_mask`.

    out = attngen.flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                                 enable_gqa=False, return_lse=False)     # [B, H, S, D], as torch's
    mask = attngen.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128)

A score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx) is an ordinary Python
function (a def, a nested def, a lambda, a functools.partial; without a source file, its torch.fx
trace). `translate` reads its source with `ast` (the whole file, so line numbers are the file's)
and its closure and globals with `inspect`, and writes the expression language of
attngen/expr.py (docs/interfaces.md, "Python mods, translated", has the table): torch's
functions and methods, arithmetic, comparisons, & | ~ on conditions -> and or not. A captured
float tensor becomes a float32 call-time tensor, an integer or bool one an int32 tensor
(name.int32[...], exact), a captured number a literal, and a call of another such function
(torch's and_masks/or_masks too) is inlined. A -inf branch of torch.where is split off as a
mask (split_masked). Anything else is a FlexTranslationError naming the function, the file's
line and the construct: there is no fallback.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import inspect
import keyword
import linecache
import math
import numbers

import numpy as np
import torch

from attngen import expr, tiles
from attngen.interfaces.op_arguments import compiling
from attngen.interfaces.ops import attention
from attngen.reference.forward import InputError
from attngen.spec import FIELDS

# names a call-time tensor may not take: the language's, the spec fields and attention's keywords
TAKEN = expr.RESERVED | set(FIELDS) | {"softmax_scale", "scale", "out", "cu_seqlens_q", "cu_seqlens_k",
                                       "max_seqlen_q", "block_table", "seqused_k", "num_splits", "block_mask",
                                       "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"}

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
# torch / math functions -> the language's, or an OPS entry written with them (arguments checked by expr.parse)
UNARY = ("tanh", "exp", "exp2", "log", "abs", "sin", "cos", "tan", "sqrt")
TORCH_FUNCS = {**{f: f for f in UNARY}, "where": "where", "minimum": "min", "maximum": "max", "min": "min",
               "max": "max", "pow": "pow", "sigmoid": "sigmoid", "clamp": "clamp", "clip": "clamp",
               "square": "square"}
NN_FUNCS = {"silu": "silu", "sigmoid": "sigmoid"}  # torch.nn.functional
MATH_FUNCS = {"tanh": "tanh", "exp": "exp", "exp2": "exp2", "log": "log", "fabs": "abs", "sin": "sin", "cos": "cos",
              "tan": "tan", "sqrt": "sqrt", "pow": "pow"}
BUILTIN_FUNCS = {abs: "abs", min: "min", max: "max", pow: "pow"}
# methods on a value (x.pow(2), x.clamp(min=0)): the torch function of that name, x its first argument
METHODS = {"pow", "sqrt", "clamp", "clip", "abs", "exp", "exp2", "log", "tanh", "sin", "cos", "tan", "sigmoid", "square"}
# parameter names, for keyword arguments (torch's)
PARAMS = {"where": ("condition", "input", "other"), "pow": ("input", "exponent"), "clamp": ("input", "min", "max"),
          "min": ("input", "other"), "max": ("input", "other")}


def _call(name: str, *args) -> ast.expr:
    return ast.Call(ast.Name(name, ast.Load()), list(args), [])


def _sigmoid_denominator(x):
    return ast.BinOp(ast.Constant(1), ast.Add(), _call("exp", ast.UnaryOp(ast.USub(), x)))


# ops written with the language's functions
OPS = {"sigmoid": lambda x: ast.BinOp(ast.Constant(1), ast.Div(), _sigmoid_denominator(x)),
       "silu": lambda x: ast.BinOp(x, ast.Div(), _sigmoid_denominator(x)),
       "square": lambda x: ast.BinOp(x, ast.Mult(), x),
       "clamp": lambda x, lo=None, hi=None: _clamp(x, lo, hi)}


def _clamp(x, lo, hi):
    x = x if lo is None else _call("max", x, lo)
    return x if hi is None else _call("min", x, hi)


class FlexTranslationError(InputError):
    """A score_mod/mask_mod the expression language cannot express: the function, the line, the construct."""

    def __init__(self, fn, line, what: str):
        where = f"{getattr(fn, '__qualname__', fn)} ({_file(fn)}, line {line})"
        ValueError.__init__(self, f"{where}: {what}")
        self.argument, self.value, self.expected = getattr(fn, "__qualname__", repr(fn)), line, what


def _first_line(fn):
    """fn's first line, or "?" (a partial, a torch.fx trace, a callable object)."""
    fn = getattr(fn, "func", fn)
    return getattr(getattr(fn, "__code__", None), "co_firstlineno", "?")


def _file(fn) -> str:
    code = getattr(fn, "__code__", None)
    return code.co_filename if code else "?"


@dataclasses.dataclass(frozen=True)
class Translated:
    text: str  # the expression (canonical form)
    tensors: dict  # name -> torch.Tensor (float32, or int32 for integer and bool tensors) the expression indexes
    mask: str = ""  # a score_mod's -inf, split off as a mask_mod (canonical form): "" when it has none


INF = "__inf__"  # infinity in a translated tree (the language has no such literal): split off or refused


def _is_neg_inf(node) -> bool:
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Name) \
        and node.operand.id == INF


def _has_inf(node) -> bool:
    return any(isinstance(n, ast.Name) and n.id == INF for n in ast.walk(node))


def _and(a, b):
    return b if a is None else (a if b is None else ast.BoolOp(ast.And(), [a, b]))


def _not(c):
    return ast.UnaryOp(ast.Not(), c)


def split_masked(tree):
    """A translated score_mod with -inf in it as (mask or None, score): the tree equals
    where(mask, score, -inf). -inf may stand as a branch of where (at any depth of wheres) and
    have a finite term added to or subtracted from it; anywhere else it has no mask meaning
    (None, None)."""
    if not _has_inf(tree):
        return None, tree
    if _is_neg_inf(tree):
        return _literal_bool(False), ast.Constant(0)
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id == "where":
        c, a, b = tree.args
        if _has_inf(c) or any(isinstance(n, ast.Name) and n.id == "score" for n in ast.walk(c)):
            return None, None  # (a mask cannot read the score)
        (ma, sa), (mb, sb) = split_masked(a), split_masked(b)
        if sa is None or sb is None:
            return None, None
        if _is_neg_inf(b):
            return _and(c, ma), sa
        if _is_neg_inf(a):
            return _and(_not(c), mb), sb
        true = _literal_bool(True)
        mask = ast.BoolOp(ast.Or(), [_and(c, ma) if ma else c, _and(_not(c), mb) if mb else _not(c)])
        return (mask if ma or mb else true), ast.Call(tree.func, [c, sa, sb], [])
    if isinstance(tree, ast.BinOp) and isinstance(tree.op, (ast.Add, ast.Sub)):
        for inner, other, left in ((tree.left, tree.right, True), (tree.right, tree.left, False)):
            if _has_inf(inner) and not _has_inf(other) and (left or isinstance(tree.op, ast.Add)):
                m, sc = split_masked(inner)
                if sc is None:
                    return None, None
                return m, ast.BinOp(sc, tree.op, other) if left else ast.BinOp(other, tree.op, sc)
    return None, None


def _function_node(fn):
    """The ast node (FunctionDef or Lambda) of fn, in its whole file's tree (memoized per code
    object: the source is read and parsed once, the closure and globals on every call)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        raise FlexTranslationError(fn, "?", "not a Python function (attngen reads the mod's source)")
    node = _nodes.get(code)
    if node is None:
        if len(_nodes) > 1024:
            _nodes.clear()
        node = _nodes[code] = _find_node(fn, code)
    return node


_nodes: dict = {}


def _find_node(fn, code):
    lines = linecache.getlines(code.co_filename, getattr(fn, "__globals__", None))
    if not lines and code.co_filename.startswith("<eval_with_key>"):  # a torch.fx trace's forward (_traced)
        lines = _FX_SOURCES.get(code.co_filename, [])
    if not lines:
        raise FlexTranslationError(fn, code.co_firstlineno, "its source is not available (define it in a file)")
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError as e:
        raise FlexTranslationError(fn, code.co_firstlineno, f"its file does not parse ({e.msg})") from None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Lambda) and code.co_name == "<lambda>" and node.lineno == code.co_firstlineno:
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if code.co_firstlineno in (first, node.lineno):
                found.append(node)
    if len(found) > 1 and code.co_name == "<lambda>":  # several lambdas on one line: match the parameters
        params = code.co_varnames[:code.co_argcount]
        found = [n for n in found if tuple(a.arg for a in n.args.args) == params]
    if len(found) != 1:
        raise FlexTranslationError(fn, code.co_firstlineno,
                                   "its source cannot be located unambiguously (put each lambda on its own line)")
    return found[0]


_FX_SOURCES: dict = {}  # a torch.fx trace's file name -> its forward's source lines


def _has_source(fn) -> bool:
    code = fn.__code__
    return bool(linecache.getlines(code.co_filename, getattr(fn, "__globals__", None)))


def _traced(fn):
    """A mod without a source file (defined in a REPL, `python -c`, exec) as torch.fx traces it: the
    trace's forward (whose source torch.fx writes), its `self` bound (the captured tensors are
    its attributes). Python control flow on the arguments cannot be traced: refused, as any."""
    import torch.fx
    try:
        gm = torch.fx.symbolic_trace(fn)
    except Exception as e:  # noqa: BLE001 - any failure of the user's code under tracing
        raise FlexTranslationError(fn, fn.__code__.co_firstlineno, f"its source is not available (define it in a "
                                   f"file), and torch.fx cannot trace it ({type(e).__name__}: {str(e)[:80]})") from None
    forward = type(gm).forward
    if len(_FX_SOURCES) > 1024:  # each call traces afresh (its captures as they are now): keep the map small
        _FX_SOURCES.clear()
    _FX_SOURCES[forward.__code__.co_filename] = gm.code.splitlines(True)
    return functools.partial(forward, gm)


class _Translator:
    def __init__(self, kind: str):
        self.kind = kind
        self.tensors: dict[str, torch.Tensor] = {}
        self.by_id: dict[int, str] = {}

    # -- one function: parameters bound to expression trees, locals substituted -------------
    def function(self, fn, args: list, depth: int = 0, keywords: dict | None = None) -> ast.expr:
        if depth > 8:
            raise FlexTranslationError(fn, getattr(getattr(fn, "__code__", None), "co_firstlineno", "?"),
                                       "calls nest more than 8 deep")
        if isinstance(fn, functools.partial):  # its bound arguments are captured values
            return self.function(fn.func, [_Bound(x) for x in fn.args] + list(args), depth + 1,
                                 {**{n: _Bound(x) for n, x in fn.keywords.items()}, **(keywords or {})})
        if inspect.isfunction(fn) and not _has_source(fn) and not fn.__code__.co_filename.startswith("<eval_with_key>"):
            return self.function(_traced(fn), args, depth + 1, keywords)
        if _torch_helper(fn, "noop_mask"):  # its body (batch.new_ones(...)) is a constant True
            return _literal_bool(True)
        combined = _mask_combiner(fn)
        if combined is not None:  # torch's and_masks / or_masks: their mods, joined
            op, mods = combined
            parts = [self.function(m, args, depth + 1) for m in mods]
            return _literal_bool(isinstance(op, ast.And)) if not parts else \
                parts[0] if len(parts) == 1 else ast.BoolOp(op, parts)
        node = _function_node(fn)
        line0 = node.lineno
        a = node.args
        if a.vararg or a.kwarg or a.kwonlyargs:
            raise FlexTranslationError(fn, line0, "*args, **kwargs or keyword-only parameters")
        params = [p.arg for p in a.posonlyargs + a.args]
        env = dict(zip(params, args))
        env.update(keywords or {})
        defaults = dict(zip(params[len(params) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()))
        env.update((p, _Bound(x)) for p, x in defaults.items() if p not in env)  # a default value is a capture
        if len(args) > len(params) or set(env) != set(params):
            raise FlexTranslationError(fn, line0, f"it takes {len(params)} parameters, {len(args)} given "
                                                  f"({', '.join(SCORE_ARGS if self.kind == 'score_mod' else MASK_ARGS)})")
        if isinstance(node, ast.Lambda):
            return self.expr(fn, node.body, env, depth)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        for stmt in body:
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                return self.expr(fn, stmt.value, env, depth)
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant) and stmt.value.value is None:
                continue  # `q = kv = None`: a torch.fx trace freeing its values
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                obj = self.resolve(fn, stmt.value, env) if isinstance(stmt.value, (ast.Name, ast.Attribute)) else None
                if isinstance(obj, torch.Tensor) and obj.dim() > 0 or callable(obj):  # t = self.table: an alias
                    value = _Bound(obj)
                else:
                    value = self.expr(fn, stmt.value, env, depth)
                for target in targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = value if isinstance(target, ast.Tuple) else [value]
                    if not all(isinstance(n, ast.Name) for n in names) or not isinstance(values, list) \
                            or len(values) != len(names):
                        raise FlexTranslationError(fn, stmt.lineno, "an assignment to anything but plain names "
                                                                    "(x = ..., or x, y = a tuple of as many)")
                    env.update((n.id, v) for n, v in zip(names, values))
                continue
            if isinstance(stmt, ast.Pass):
                continue
            raise FlexTranslationError(fn, stmt.lineno, f"the statement `{type(stmt).__name__}` "
                                                        f"(only assignments and one return; use torch.where for a branch)")
        raise FlexTranslationError(fn, line0, "no return statement with a value")

    # -- an expression --------------------------------------------------------------------------
    def lookup(self, fn, name: str, line: int):
        code = fn.__code__
        if name in code.co_freevars and fn.__closure__:
            cell = fn.__closure__[code.co_freevars.index(name)]
            try:
                return cell.cell_contents
            except ValueError:
                raise FlexTranslationError(fn, line, f"the captured name `{name}` is not bound yet") from None
        if name in fn.__globals__:
            return fn.__globals__[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise FlexTranslationError(fn, line, f"the name `{name}` is not defined")

    def resolve(self, fn, node, env):
        """The Python object a name or attribute chain (torch.where, math.pi, self_cfg.x) refers to."""
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id].value if isinstance(env[node.id], _Bound) else None
            return self.lookup(fn, node.id, node.lineno)
        if isinstance(node, ast.Attribute):
            base = self.resolve(fn, node.value, env)
            if base is None:
                return None
            try:
                return getattr(base, node.attr)
            except AttributeError:
                raise FlexTranslationError(fn, node.lineno, f"the attribute `.{node.attr}` does not exist") from None
        return None

    def tensor(self, t: torch.Tensor, name: str) -> str:
        if id(t) in self.by_id:
            return self.by_id[id(t)]
        base = name.lstrip("_") or "t"
        if base in TAKEN or keyword.iskeyword(base) or not base.isidentifier():
            base = f"t_{base}"
        out, n = base, 1
        while out in self.tensors:
            n += 1
            out = f"{base}{n}"
        self.tensors[out] = stored_tensor(t)
        self.by_id[id(t)] = out
        return out

    def keywords(self, fn, node, name: str, given: int, ex) -> list:
        """A call's keyword arguments (torch.clamp(x, min=0), torch.where(c, input=a, other=b)) as the
        positional ones after the `given` first, by torch's parameter names; a trailing one left out is None."""
        if not node.keywords:
            return []
        params = PARAMS.get(name, ("input",))
        by_name = {k.arg: k.value for k in node.keywords}
        unknown = sorted(set(by_name) - set(params[given:]))
        if unknown or None in by_name:
            raise FlexTranslationError(fn, node.lineno, f"the keyword argument `{unknown[0] if unknown else '**'}` in "
                                                        f"`{ast.unparse(node.func)}` (it takes {', '.join(params)})")
        out = [ex(by_name[p]) if p in by_name else None for p in params[given:]]
        while out and out[-1] is None:
            out.pop()
        if None in out:
            raise FlexTranslationError(fn, node.lineno, f"`{ast.unparse(node)}` leaves out a middle argument")
        return out

    def literal(self, fn, value, line) -> ast.expr:
        if isinstance(value, bool):
            return _literal_bool(value)
        if isinstance(value, numbers.Integral):
            return ast.Constant(int(value))
        if isinstance(value, numbers.Real):
            if math.isinf(value):  # a masked key (split off by split_masked) or refused there
                inf = ast.Name(INF, ast.Load())
                return inf if value > 0 else ast.UnaryOp(ast.USub(), inf)
            return ast.Constant(float(value))
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
            return self.literal(fn, value.item(), line)  # its value now (a new value, a new kernel text)
        raise FlexTranslationError(fn, line, f"the captured value of type {type(value).__name__} "
                                             f"(numbers become literals, tensors must be indexed)")

    def expr(self, fn, node, env, depth) -> ast.expr:
        line = getattr(node, "lineno", fn.__code__.co_firstlineno)
        ex = lambda n: self.expr(fn, n, env, depth)  # noqa: E731
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float)):
                return self.literal(fn, node.value, line)
            raise FlexTranslationError(fn, line, f"the literal {node.value!r}")
        if isinstance(node, ast.Tuple):  # a tuple value (x, y = helper(i)): unpacked by an assignment
            return [ex(e) for e in node.elts]
        if isinstance(node, ast.Name):
            value = env.get(node.id)
            if node.id in env and not isinstance(value, _Bound):
                return value
            value = value.value if node.id in env else self.lookup(fn, node.id, line)
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                raise FlexTranslationError(fn, line, f"the tensor `{node.id}` used whole (index it, like {node.id}[h])")
            return self.literal(fn, value, line)
        if isinstance(node, ast.Attribute) and node.attr == "min" and isinstance(node.value, ast.Call) \
                and self.resolve(fn, node.value.func, env) is torch.finfo:
            return self.literal(fn, -math.inf, line)  # torch.finfo(dtype).min: a masked key, as -inf
        if isinstance(node, ast.Attribute):
            value = self.resolve(fn, node, env)
            if value is None:
                raise FlexTranslationError(fn, line, f"the attribute or method `.{node.attr}` "
                                                     f"(use torch.{node.attr}(x) or a supported function)")
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                raise FlexTranslationError(fn, line, f"the tensor `{ast.unparse(node)}` used whole (index it)")
            return self.literal(fn, value, line)
        if isinstance(node, ast.Subscript):
            chain, base = [], node
            while isinstance(base, ast.Subscript):  # bias[h][q_idx] is bias[h, q_idx]
                idx = base.slice.elts if isinstance(base.slice, ast.Tuple) else [base.slice]
                chain = list(idx) + chain
                base = base.value
            t = self.resolve(fn, base, env)
            if not isinstance(t, torch.Tensor):
                raise FlexTranslationError(fn, line, f"indexing `{ast.unparse(base)}`, which is not a captured tensor")
            if t.dim() != len(chain):
                raise FlexTranslationError(fn, line, f"`{ast.unparse(base)}` has {t.dim()} dimensions, indexed with {len(chain)}")
            if any(isinstance(i, (ast.Slice, ast.Starred)) for i in chain):
                raise FlexTranslationError(fn, line, "a slice (index with b, h, q_idx, kv_idx expressions)")
            if _exact_integers(t) and t.numel() and not _fits_int32(t):
                raise FlexTranslationError(fn, line, f"the integer tensor `{ast.unparse(base)}` holds values beyond int32 "
                                                     f"(the kernel's integers; renumber them from 0)")
            name = self.tensor(t, base.attr if isinstance(base, ast.Attribute) else base.id)
            # Python's (and torch's) negative index counts from the end: wrapped where it may be negative
            idx = [i if _nonnegative(i) else _call("where", ast.Compare(i, [ast.Lt()], [ast.Constant(0)]),
                                                    ast.BinOp(i, ast.Add(), ast.Constant(n)), i)
                   for i, n in zip((ex(i) for i in chain), t.shape)]
            ref = ast.Name(name, ast.Load())
            if _exact_integers(t):
                ref = ast.Attribute(ref, "int32", ast.Load())
            entry = ast.Subscript(ref, idx[0] if len(idx) == 1 else ast.Tuple(idx, ast.Load()), ast.Load())
            if t.dtype == torch.bool:  # a boolean mask tensor (keep[b, kv_idx]): its entries are conditions
                cond = ast.Compare(entry, [ast.NotEq()], [ast.Constant(0)])
                cond.bool_entry = True  # in arithmetic or a comparison it is its 0/1 (_entry)
                return cond
            return entry
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: ast.Add, ast.Sub: ast.Sub, ast.Mult: ast.Mult, ast.Div: ast.Div, ast.Mod: ast.Mod,
                   ast.FloorDiv: ast.FloorDiv}
            if isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
                left, right = ex(node.left), ex(node.right)
                if _is_condition(left) or _is_condition(right):  # a mask's & | (torch's bool tensors): and, or
                    if isinstance(node.op, ast.BitXor):
                        return ast.Compare(_as_int(left), [ast.NotEq()], [_as_int(right)])
                    return ast.BoolOp(ast.And() if isinstance(node.op, ast.BitAnd) else ast.Or(), [left, right])
                return ast.BinOp(left, type(node.op)(), right)  # integers (kv_idx & 1): bitwise
            if isinstance(node.op, ast.Pow):
                return _call("pow", ex(node.left), ex(node.right))
            if type(node.op) not in ops:
                raise FlexTranslationError(fn, line, f"the operator {_OPNAMES.get(type(node.op), type(node.op).__name__)}")
            return ast.BinOp(_entry(ex(node.left)), ops[type(node.op)](), _entry(ex(node.right)))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, (ast.Invert, ast.Not)):
                return ast.UnaryOp(ast.Not(), ex(node.operand))
            return ast.UnaryOp(type(node.op)(), ex(node.operand))
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(type(node.op)(), [ex(v) for v in node.values])
        if isinstance(node, ast.Compare):  # (a bool tensor's entry compared: its 0/1)
            return ast.Compare(_entry(ex(node.left)), [type(o)() for o in node.ops],
                               [_entry(ex(c)) for c in node.comparators])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__getitem__" \
                and len(node.args) == 1 and not node.keywords:  # t.__getitem__(i), as torch.fx writes t[i]
            return ex(ast.copy_location(ast.Subscript(node.func.value, node.args[0], ast.Load()), node))
        if isinstance(node, ast.Call):
            target = self.resolve(fn, node.func, env)
            positional = list(node.args)
            if target is None and isinstance(node.func, ast.Attribute) and node.func.attr in ("new_zeros", "new_ones"):
                return ast.Constant(int(node.func.attr == "new_ones"))  # h.new_zeros(h.shape): a constant, broadcast
            if target is None and isinstance(node.func, ast.Attribute):  # a method on a value: x.pow(2)
                if node.func.attr not in METHODS:
                    raise FlexTranslationError(fn, line, f"the method `.{node.func.attr}()` (methods: "
                                                         f"{', '.join(sorted(METHODS))}; or a torch function)")
                target, positional = getattr(torch, node.func.attr), [node.func.value] + positional
            if target is float and len(node.args) == 1 and isinstance(node.args[0], ast.Constant):
                try:  # float("-inf"), float("inf"), float(2)
                    return self.literal(fn, float(node.args[0].value), line)
                except (TypeError, ValueError):
                    raise FlexTranslationError(fn, line, f"`{ast.unparse(node)}` is not a number") from None
            name = _function_name(target)
            args = [ex(a) for a in positional]
            if name is not None:
                args += self.keywords(fn, node, name, len(args), ex)
                if name in OPS:
                    try:
                        return OPS[name](*args)
                    except TypeError:
                        raise FlexTranslationError(fn, line, f"`{ast.unparse(node)}`: {len(args)} arguments") from None
                return _call(name, *args)
            if inspect.isfunction(target) or isinstance(target, functools.partial):  # a helper: inlined
                if node.keywords:
                    raise FlexTranslationError(fn, line, f"keyword arguments in a call of `{ast.unparse(node.func)}`")
                return self.function(target, args, depth + 1)
            raise FlexTranslationError(fn, line, f"calling `{ast.unparse(node.func)}` (supported: torch.where, "
                                                 f"torch.{'/'.join(UNARY)}, pow, sigmoid, silu, clamp, square, "
                                                 f"minimum/maximum, abs, min, max, and Python functions made of these)")
        if isinstance(node, ast.IfExp):
            raise FlexTranslationError(fn, line, "a conditional expression `x if c else y` (use torch.where(c, x, y))")
        raise FlexTranslationError(fn, line, f"the construct `{type(node).__name__}` ({ast.unparse(node)[:40]})")


@dataclasses.dataclass(frozen=True)
class _Bound:
    """A parameter bound by functools.partial to a Python value (a number, a tensor): a capture."""
    value: object


def _literal_bool(value: bool) -> ast.expr:
    """True or False in the language, which has no boolean literal."""
    return ast.Compare(ast.Constant(0), [ast.Eq() if value else ast.NotEq()], [ast.Constant(0)])


def _torch_helper(fn, name: str) -> bool:
    """Whether fn is torch.nn.attention.flex_attention's `name` (or a function made inside it)."""
    return getattr(fn, "__module__", None) == "torch.nn.attention.flex_attention" and \
        getattr(getattr(fn, "__code__", None), "co_name", None) == name


def _mask_combiner(fn):
    """(ast.And() or ast.Or(), the mods) for a mask made by torch's and_masks / or_masks, else None."""
    if not (_torch_helper(fn, "and_mask") or _torch_helper(fn, "or_mask")) or "mask_mods" not in fn.__code__.co_freevars:
        return None
    code = fn.__code__
    mods = fn.__closure__[code.co_freevars.index("mask_mods")].cell_contents
    return (ast.And() if code.co_name == "and_mask" else ast.Or()), tuple(mods)


def _exact_integers(t: torch.Tensor) -> bool:
    """An integer or bool tensor: kept as int32 (name.int32[...]), exact, not rounded to float32."""
    return not (t.is_floating_point() or t.is_complex())


def _fits_int32(t: torch.Tensor) -> bool:
    return int(t.min()) >= -2**31 and int(t.max()) < 2**31


def stored_tensor(t: torch.Tensor) -> torch.Tensor:
    """A captured tensor as the kernel takes it: int32 for integers and bools, else float32. Not
    detached: one that requires grad (a learnable bias) reaches attngen.attention as it is, whose
    backward refuses it by name (no gradient for mod tensors yet), never a silent constant."""
    return t.to(torch.int32 if _exact_integers(t) else torch.float32).contiguous()


def _nonnegative(node) -> bool:
    """Whether a translated integer index is provably >= 0 (then it is left as written)."""
    if isinstance(node, ast.Name):
        return node.id in expr.INDEX_VARS
    if isinstance(node, ast.Constant):
        return node.value >= 0
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        return _nonnegative(node.left) and _nonnegative(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mod, ast.FloorDiv)):  # floor forms, by a literal
        return _nonnegative(node.right) and (isinstance(node.op, ast.Mod) or _nonnegative(node.left))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = node.args
        if node.func.id == "max":
            return any(_nonnegative(a) for a in args)
        if node.func.id in ("min", "where"):
            return all(_nonnegative(a) for a in (args if node.func.id == "min" else args[1:]))
    return False


_OPNAMES = {ast.LShift: "<<", ast.RShift: ">>", ast.MatMult: "@ (matmul)"}


def _entry(node):
    """A bool tensor's entry as the number 0/1 (x + keep[i], seq[q] == seq[kv]); anything else as it is."""
    return node.left if getattr(node, "bool_entry", False) else node


def _is_condition(node) -> bool:
    """Whether a translated tree is a condition (a comparison, and/or/not), not an integer."""
    return isinstance(node, (ast.Compare, ast.BoolOp)) or (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not))


def _as_int(node):
    return _call("where", node, ast.Constant(1), ast.Constant(0)) if _is_condition(node) else node


def _function_name(target):
    """The op name (the language's function, or an OPS entry) of a torch/math/builtin function object, or None."""
    for table, module in ((TORCH_FUNCS, torch), (NN_FUNCS, torch.nn.functional), (MATH_FUNCS, math)):
        for py, ours in table.items():
            if getattr(module, py, None) is target:
                return ours
    try:
        return BUILTIN_FUNCS.get(target)
    except TypeError:
        return None


def translate(fn, kind: str) -> Translated:
    """A score_mod (kind "score_mod") or mask_mod ("mask_mod") Python function as an expression.

    The closure and globals are read on every call (a rebound capture is seen at once); the
    source is parsed once per function (_function_node) and the expression once per text
    (_parsed)."""
    if not callable(fn):
        raise InputError(kind, type(fn).__name__, f"a Python function {'(score, b, h, q_idx, kv_idx)' if kind == 'score_mod' else '(b, h, q_idx, kv_idx)'}")
    tr = _Translator(kind)
    names = SCORE_ARGS if kind == "score_mod" else MASK_ARGS
    tree = tr.function(fn, [ast.Name(n, ast.Load()) for n in names])
    mask = ""
    if _has_inf(tree):
        cond, tree = split_masked(tree) if kind == "score_mod" else (None, None)
        if tree is None:
            raise FlexTranslationError(fn, _first_line(fn), "an infinity where it is not a masked key "
                                       "(write -inf as a branch of torch.where(cond, score, -float('inf')) with a "
                                       "cond of b, h, q_idx, kv_idx only, or use a mask_mod)")
        mask = _canonical(fn, ast.unparse(ast.fix_missing_locations(cond)), "mask_mod")
    text = ast.unparse(ast.fix_missing_locations(tree))
    return Translated(_canonical(fn, text, kind), tr.tensors, mask)


def _canonical(fn, text: str, kind: str) -> str:
    """The translated text checked by the expression language, in canonical form (memoized per text)."""
    canonical = _parsed.get((text, kind))
    if canonical is None:
        try:
            canonical = expr.parse(text, kind).canonical
        except expr.ExprError as e:
            line = _first_line(fn)
            raise FlexTranslationError(fn, line, f"translated to `{text}`, which the expression language rejects "
                                                 f"{e}") from None
        if len(_parsed) > 1024:
            _parsed.clear()
        _parsed[(text, kind)] = canonical
    return canonical


_parsed: dict = {}


# -- the block mask -------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class BlockMask:
    """FlexAttention's BlockMask fields: per (b, h, Q tile) the KV tiles that are partial
    (kv_num_blocks, kv_indices: the mask runs there) and full (full_kv_num_blocks,
    full_kv_indices: no mask needed), and the transposed q_* lists per KV tile. Empty tiles are in
    neither list. Only the first *_num_blocks entries of an index row are meaningful."""
    seq_lengths: tuple  # (Q_LEN, KV_LEN)
    BLOCK_SIZE: tuple  # (Q block, KV block)
    kv_num_blocks: torch.Tensor  # int32 [B, H, nq]
    kv_indices: torch.Tensor  # int32 [B, H, nq, nk]
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    q_num_blocks: torch.Tensor  # int32 [B, H, nk]
    q_indices: torch.Tensor  # int32 [B, H, nk, nq]
    full_q_num_blocks: torch.Tensor
    full_q_indices: torch.Tensor
    mask_mod: object
    states: np.ndarray  # int8 [B, H, nq, nk]: tiles.EMPTY / PARTIAL / FULL
    mask_text: str = ""  # the mask_mod translated (the kernel's spec mask_mod)
    mask_tensors: dict = dataclasses.field(default_factory=dict)  # its captured tensors when the tiles were classified

    @property
    def shape(self) -> tuple:
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def sparsity(self) -> float:
        """Percent of tiles that are empty."""
        return 100.0 * float((self.states == tiles.EMPTY).mean())

    def retiled(self, block_m: int, block_n: int) -> "BlockMask":
        """The same mask over tiles of block_m x block_n, each a whole multiple or divisor of its
        BLOCK_SIZE (tiles.retile_states): the tiles a kernel with other tile sizes visits."""
        st = tiles.retile_states(self.states, self.BLOCK_SIZE, (block_m, block_n), self.seq_lengths)
        return _block_mask(self.seq_lengths, (block_m, block_n), st, self.mask_mod, self.mask_text, self.mask_tensors,
                           self.kv_num_blocks.device)


def _block_mask(lengths, block_size, st, mask_mod, text, tensors, dev) -> BlockMask:
    lists = {n: torch.from_numpy(x).to(dev) for n, x in tiles.mask_lists(st).items()}
    return BlockMask(tuple(lengths), tuple(block_size), mask_mod=mask_mod, states=st, mask_text=text,
                     mask_tensors=dict(tensors), **lists)


def _positive(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 1:
        raise InputError(name, x, "a positive int")
    return int(x)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks=True, compute_dq_write_order=False, dq_kv_order=True) -> BlockMask:
    """Evaluate mask_mod (translated, with numpy: expr.evaluate) over [B, H, Q_LEN, KV_LEN] and
    classify each BLOCK_SIZE tile (tiles.tile_states). B or H None is 1 (broadcast, as Flex).
    BLOCK_SIZE is an int or (Q block, KV block). `device`: where the index tensors live (CPU
    by default; Flex's default is "cuda"). `_compile` is accepted and changes nothing.
    separate_full_blocks=False lists every visited tile as partial (the mask runs on all), as
    torch's; compute_dq_write_order and dq_kv_order are accepted and change nothing (attngen's
    backward derives its own lists and order: docs/backward.md)."""
    B = 1 if B is None else _positive("B", B)
    H = 1 if H is None else _positive("H", H)
    Q_LEN, KV_LEN = _positive("Q_LEN", Q_LEN), _positive("KV_LEN", KV_LEN)
    bm, bn = (BLOCK_SIZE, BLOCK_SIZE) if not isinstance(BLOCK_SIZE, (tuple, list)) else tuple(BLOCK_SIZE)
    bm, bn = _positive("BLOCK_SIZE", bm), _positive("BLOCK_SIZE", bn)
    tr = translate(mask_mod, "mask_mod")
    e = expr.parse(tr.text, "mask_mod")
    arrays = {n: t.detach().cpu().numpy() for n, t in tr.tensors.items()}  # the tiles' states: values only

    def rows(q0, q1):
        env = {"b": np.arange(B)[:, None, None, None], "h": np.arange(H)[None, :, None, None],
               "q_idx": np.arange(q0, q1)[None, None, :, None], "kv_idx": np.arange(KV_LEN)[None, None, None, :]}
        return np.broadcast_to(expr.evaluate(e, env, arrays), (B, H, q1 - q0, KV_LEN))
    st = tiles.mask_states(rows, Q_LEN, bm, bn)
    if not separate_full_blocks:
        st = np.where(st == tiles.FULL, tiles.PARTIAL, st).astype(st.dtype)
    dev = torch.device("cpu") if device is None else torch.device(device)
    return _block_mask((Q_LEN, KV_LEN), (bm, bn), st, mask_mod, tr.text, tr.tensors, dev)


# -- flex_attention --------------------------------------------------------------------------------------


def _bhsd(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise InputError(name, type(t).__name__, "a torch.Tensor [B, H, S, D]")
    if t.dim() != 4:
        raise InputError(f"{name}.shape", list(t.shape), "4 dimensions: [B, H, S, D] (FlexAttention's layout)")


def check_layout(query, key, value, enable_gqa: bool) -> None:
    """Shapes that the [B, H, S, D] layout explains; a [B, S, H, D] tensor usually is not one."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _bhsd(name, t)
    hint = ("flex_attention takes [B, H, S, D] (FlexAttention's layout); a [B, S, H, D] tensor (the "
            "flash-attn layout) needs .transpose(1, 2)")
    if key.shape[0] not in (1, query.shape[0]) or value.shape[0] != key.shape[0]:
        raise InputError("key.shape[0] (B)", key.shape[0], f"{query.shape[0]}, query's batch, or 1 (broadcast), "
                                                           f"and value's the same")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise InputError("value.shape", list(value.shape), f"heads and length {list(key.shape[1:3])} of key's: {hint}")
    if key.shape[3] != query.shape[3]:
        raise InputError("key.shape[3] (D)", key.shape[3], f"{query.shape[3]}, query's head dim: {hint}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv:
        if hkv < 1 or hq % hkv:
            raise InputError("query.shape[1] (H)", hq, f"a multiple of key.shape[1] (kv heads) = {hkv}: {hint}")
        if not enable_gqa:
            raise InputError("enable_gqa", enable_gqa, f"True: query has {hq} heads and key {hkv} (GQA), "
                                                       f"as torch's flex_attention requires")


def _to_bshd(t):
    """[B, H, S, D] -> [B, S, H, D] as the kernels take it: a view when the permuted strides are
    packed (the tensor is a transpose of a packed [B, S, H, D]), else one packed copy (the
    kernels' host stub takes packed tensors only: attngen.run.inputs.check_layout)."""
    view = t.transpose(1, 2)
    return view if view.is_contiguous() else view.contiguous()


KERNEL_Q_TILES = (128, 64, 192)  # 64 rows per consumer warpgroup; the default first


def kernel_block_mask(bm, bshape, head_dim: int, dtype, head_dim_v: int, kw: dict, fields: dict) -> BlockMask:
    """The block mask the kernel visits: attngen's own (a torch BlockMask is classified again by
    create_block_mask from its mask_mod), over the kernel's tiles. Its BLOCK_SIZE is taken as
    the tiles when a kernel plans with them; else the first Q tile (128, 64, 192) and the
    largest block_n that plan and divide or are divided by its blocks (BlockMask.retiled). `fields`:
    the call's block_m/block_n (kernel_options), the only tiles then tried."""
    from attngen.kernels.fwd.plan import BLOCK_N_CANDIDATES, make_plan
    from attngen.run.checks import spec_dtype
    from attngen.spec import Spec, SpecError

    if not isinstance(bm, BlockMask):
        size = bm.BLOCK_SIZE if isinstance(bm.BLOCK_SIZE, (tuple, list)) else (bm.BLOCK_SIZE, bm.BLOCK_SIZE)
        bm = create_block_mask(bm.mask_mod, bshape[0], bshape[1], *bm.seq_lengths,
                               BLOCK_SIZE=(int(size[0]), int(size[-1])))
    bq, bk = bm.BLOCK_SIZE
    fields = dict(head_dim=head_dim, dtype=spec_dtype(dtype) or "float16", block_mask=True,
                  mask_mod=kw["mask_mod"], score_mod=kw.get("score_mod", ""), head_dim_v=head_dim_v)

    def plans(m, n) -> bool:
        try:
            make_plan(Spec(**fields, consumers=m // 64, block_n=n))
            return True
        except SpecError:
            return False
    ms = ([bq] if bq in KERNEL_Q_TILES else []) + [t for t in KERNEL_Q_TILES if t != bq and tiles.retiles(bq, t)]
    ns = [bk] + [c for c in BLOCK_N_CANDIDATES if c != bk]
    if "block_m" in fields:  # kernel_options' tiles: those or none
        ms = [fields["block_m"]] if tiles.retiles(bq, fields["block_m"]) else []
    if "block_n" in fields:
        ns = [fields["block_n"]]
    for m in ms:
        for n in ns:
            if n % 16 == 0 and n <= 256 and tiles.retiles(bk, n) and plans(m, n):
                return bm if (m, n) == (bq, bk) else bm.retiled(m, n)
    raise InputError("block_mask.BLOCK_SIZE", (bq, bk), "blocks that kernel tiles divide or are divided by (a Q tile "
                                                        "of 64, 128 or 192 rows, a KV tile a multiple of 16)")


# kernel_options keys that are spec fields (the kernel's tiles); any other key is refused by name
KERNEL_OPTIONS = {"BLOCK_M": "block_m", "BLOCK_N": "block_n"}


def kernel_fields(kernel_options) -> dict:
    """torch's kernel_options as spec fields: BLOCK_M (64, 128 or 192: 64 rows per consumer) and BLOCK_N."""
    fields = {}
    for name, value in dict(kernel_options or {}).items():
        if name not in KERNEL_OPTIONS:
            raise InputError(f"kernel_options[{name!r}]", value, f"one of {', '.join(KERNEL_OPTIONS)} (spec fields; "
                                                                 f"attngen picks the rest of its schedule itself)")
        fields[KERNEL_OPTIONS[name]] = _positive(f"kernel_options[{name!r}]", value)
    if "block_m" in fields:
        if fields["block_m"] not in KERNEL_Q_TILES:
            raise InputError("kernel_options['BLOCK_M']", fields["block_m"], "64, 128 or 192 (64 rows per consumer warpgroup)")
        fields["consumers"] = fields["block_m"] // 64
    return fields


def _aux_output(lse):
    """torch's AuxOutput(lse=..., max_scores=None), or a namedtuple of those fields on a torch without it."""
    import collections
    from torch.nn.attention import flex_attention as torch_flex
    aux = getattr(torch_flex, "AuxOutput", None) or collections.namedtuple("AuxOutput", ["lse", "max_scores"])
    return aux(lse=lse, max_scores=None)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """torch.nn.attention.flex_attention's call, on attngen's kernel: [B, H, S, D] in and out;
    returns out, or (out, lse [B, H, Q_LEN] float32, natural log) with return_lse, or
    (out, AuxOutput(lse=..., max_scores=None)) with return_aux=AuxRequest(lse=True) (torch's
    AuxRequest, or any object with the fields lse and max_scores). key and value may have a batch
    of 1 (broadcast over query's). kernel_options: BLOCK_M and BLOCK_N, the kernel's tiles."""
    check_layout(query, key, value, enable_gqa)
    if return_aux is not None:
        if getattr(return_aux, "max_scores", False):
            raise InputError("return_aux.max_scores", True, "False: attngen's kernels keep no row max for the caller")
        if not hasattr(return_aux, "lse"):
            raise InputError("return_aux", type(return_aux).__name__, "torch's AuxRequest(lse=...), or None")
        return_lse = bool(return_lse or return_aux.lse)
    if key.shape[0] != query.shape[0]:  # a key/value batch of 1, broadcast (a copy: the kernels take packed tensors)
        key, value = (t.expand(query.shape[0], *t.shape[1:]) for t in (key, value))
    fields = kernel_fields(kernel_options)
    meta = (tuple(int(n) for n in query.shape), int(key.shape[2]), int(value.shape[-1]), query.dtype,
            tuple(sorted(fields.items())))
    if compiling():  # the translation is a constant of the graph (_traced_mods)
        kw = dict(_TRACED[_traced_mods(score_mod, block_mask, meta)])
    else:
        kw = _mods(score_mod, block_mask, meta)
    if scale is not None:  # a run-time scale (issue 18); passed only when asked for
        kw["softmax_scale"] = scale  # not float(): a SymFloat under torch.compile stays symbolic
    kw = {n: (x.to(query.device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    if "block_mask" not in kw:  # (with one, its tiles are the kernel's: _mods fitted them to these fields)
        kw.update(fields)
    result = attention(_to_bshd(query), _to_bshd(key), _to_bshd(value), return_lse=return_lse, **kw)
    out, lse = result if return_lse else (result, None)
    out = out.transpose(1, 2)  # [B, H, S, D], a view
    if return_aux is not None:
        return out, _aux_output(lse if return_aux.lse else None)
    return (out, lse) if return_lse else out


_TRACED: dict = {}  # _traced_mods' results, by key
# Bounded: a program that traces many mods (one per layer, say) must not hold every translation and its
# tensors forever. A graph whose entry was dropped fails its guard on _TRACED and is traced again.
_TRACED_MAX = 64


@torch._dynamo.assume_constant_result
def _traced_mods(score_mod, block_mask, meta) -> str:
    """_mods under torch.compile: run once while tracing (the translation reads source, closures and
    numpy, which dynamo cannot trace), its result kept in _TRACED under the returned key, a constant
    of the graph; the graph reads the captured tensors and block-mask lists from there (guarded
    graph inputs). So a compiled graph keeps the translation it was traced with, as torch's does."""
    key = f"{id(score_mod)}:{id(block_mask)}:{meta}"
    if key not in _TRACED and len(_TRACED) >= _TRACED_MAX:
        _TRACED.clear()
    _TRACED[key] = _mods(score_mod, block_mask, meta)
    return key


def _mods(score_mod, block_mask, meta) -> dict:
    """attngen.attention's keywords for a score_mod and a block mask: the translated texts, their captured
    tensors and the kernel's block mask. `meta`: query's shape, the key length, value's head dim, the dtype."""
    (batch, heads, q_len, head_dim), kv_len, head_dim_v, dtype, fields = meta
    kw = {}
    score_mask = ""  # the score_mod's -inf keys, as a mask
    if score_mod is not None:
        tr = translate(score_mod, "score_mod")
        if tr.text != "score":  # (where(c, score, -inf) is a mask alone)
            kw["score_mod"] = tr.text
        kw.update(tr.tensors)
        score_mask = tr.mask
    if block_mask is not None:
        mm = getattr(block_mask, "mask_mod", None)
        lengths = tuple(getattr(block_mask, "seq_lengths", ()))
        if mm is None or len(lengths) != 2:
            raise InputError("block_mask", type(block_mask).__name__, "a BlockMask from attngen.create_block_mask")
        if lengths != (q_len, kv_len):
            raise InputError("block_mask.seq_lengths", lengths, f"({q_len}, {kv_len}), query's and key's lengths")
        bshape = tuple(getattr(block_mask, "kv_num_blocks").shape[:2]) if hasattr(block_mask, "kv_num_blocks") else (1, 1)
        for axis, (got, want) in enumerate(zip(bshape, (batch, heads))):
            if got not in (1, want):
                raise InputError(f"block_mask {'BH'[axis]}", got, f"1 or {want}")
        tr = translate(mm, "mask_mod")  # afresh: its captures as they are now, as torch's flex_attention reads them
        clash = {n for n in set(tr.tensors) & set(kw) if not (kw[n].dtype == tr.tensors[n].dtype
                                                              and torch.equal(kw[n], tr.tensors[n]))}
        if clash:  # the two mods captured different tensors under one name
            raise InputError("block_mask.mask_mod", sorted(clash), "tensor names other than score_mod's")
        kw["mask_mod"] = tr.text
        kw.update(tr.tensors)
        bm = kernel_block_mask(block_mask, bshape, head_dim, dtype, head_dim_v, kw, dict(fields))
        if score_mask:  # the block mask's tiles, its full ones masked too: the score_mod's -inf may fall there
            st = np.where(bm.states == tiles.FULL, tiles.PARTIAL, bm.states).astype(bm.states.dtype)
            kw["mask_mod"] = _canonical(score_mod, f"({tr.text}) and ({score_mask})", "mask_mod")
            bm = _block_mask(bm.seq_lengths, bm.BLOCK_SIZE, st, bm.mask_mod, kw["mask_mod"], bm.mask_tensors,
                             bm.kv_num_blocks.device)
        elif bm.mask_text != kw["mask_mod"]:  # the same tiles; the mod's text as it translates now
            bm = dataclasses.replace(bm, mask_text=kw["mask_mod"])
        kw["block_mask"] = bm
        del kw["mask_mod"]  # the block mask brings its own (attention checks nothing twice)
    elif score_mask:
        kw["mask_mod"] = score_mask
    return kw


__all__ = ["BlockMask", "FlexTranslationError", "Translated", "create_block_mask", "flex_attention", "translate"]
