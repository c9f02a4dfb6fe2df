"""FlexAttention's score_mod and mask_mod, translated into attngen's expression language.

A score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx) is an ordinary Python
function (a def, a nested def, a lambda, a functools.partial; without a source file, its torch.fx
trace: flex_source.py). `translate` reads its source with `ast` (the whole file, so line numbers are the file's)
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
import math
import numbers

import torch

from attngen import expr
from attngen.interfaces.flex_source import FlexTranslationError, _first_line, _function_node, _has_source, _traced
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

    def literal(self, fn, value, line, name: str | None = None) -> ast.expr:
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() and value.requires_grad:
            # a learnable scalar: a 1-entry tensor read, so that its gradient flows (a literal is a constant)
            return ast.Subscript(ast.Name(self.tensor(value, name or "scalar"), ast.Load()), ast.Constant(0), ast.Load())
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
            return self.literal(fn, value, line, node.id)
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
            return self.literal(fn, value, line, node.attr)
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
    """A captured tensor as the kernel takes it: int32 for integers and bools, else float32 (a 0-d
    one, a learnable scalar, as 1 entry). Not detached: one that requires grad (a learnable bias)
    reaches attngen.attention as it is, whose backward gives it its gradient through these casts."""
    t = t.reshape(1) if t.dim() == 0 else t
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
        params = "(score, b, h, q_idx, kv_idx)" if kind == "score_mod" else "(b, h, q_idx, kv_idx)"
        raise InputError(kind, type(fn).__name__, f"a Python function {params}")
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


__all__ = ["SCORE_ARGS", "MASK_ARGS", "TAKEN", "Translated", "split_masked", "stored_tensor", "translate"]
