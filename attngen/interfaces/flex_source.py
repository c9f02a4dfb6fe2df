"""Where a FlexAttention mod's Python source comes from, for its translation (flex_mods.translate):
its file, read with linecache and parsed whole (line numbers are the file's), the function's node
found by name and first line; or, for a function without a source file (a REPL, `python -c`,
exec), the forward that torch.fx writes when it traces it. Any failure is a FlexTranslationError
naming the function, the file's line and the reason.
"""

from __future__ import annotations

import ast
import functools
import linecache

from attngen.reference.forward import InputError


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


__all__ = ["FlexTranslationError"]
