"""The latency model: traced events -> cycles, with parameters from latency.toml.

Every parameter lives in `latency.toml` beside this file with its source or its stated
assumption; this module only does the arithmetic. `SourceInfo` reads the emitted text once
(line texts, and per `T.Parallel` loop the statement's operation counts and its role).
"""

from __future__ import annotations

import ast
import dataclasses
import tomllib
from pathlib import Path

DEFAULT = Path(__file__).with_name("latency.toml")
EXP_CALLS = {"exp2", "exp", "log2", "log", "sqrt", "rsqrt"}


@dataclasses.dataclass
class Latency:
    params: dict
    path: str

    @classmethod
    def load(cls, path=None) -> "Latency":
        """The model in `path` (default latency.toml); a user's file must hold every parameter the default has."""
        p = Path(path) if path else DEFAULT
        params = _read(p)
        if path:
            _check_like(params, _read(DEFAULT), p)
        return cls(params, str(p))

    def __getitem__(self, key):
        section, name = key.split(".")
        return self.params[section][name]

    @property
    def clock_ghz(self) -> float:
        return float(self["gpu.clock_ghz"])

    def flop_per_cycle(self, dtype: str) -> float:
        tflops = self.params["tensor_core"]["tflops"]
        rate = tflops.get(dtype, tflops.get("bfloat16"))
        return rate * 1e12 / (self["gpu.sms"] * self.clock_ghz * 1e9)

    def wgmma_cycles(self, m: int, n: int, k: int, dtype: str) -> float:
        """Tensor-core occupancy of one wgmma (M x N x K) on the SM."""
        return 2.0 * m * n * k / self.flop_per_cycle(dtype)

    def tma_transfer(self, nbytes: int) -> float:
        return nbytes / float(self["tma.bytes_per_cycle"])

    def compute_cycles(self, fp_ops: float, mufu_ops: float = 0, cvt: float = 0, smem_bytes: float = 0,
                       shuffles: int = 0) -> float:
        s = self.params["simt"]
        busy = max(fp_ops / s["fp32_per_cycle"], mufu_ops / s["exp2_per_cycle"]) + cvt / s["cvt_per_cycle"] \
            + smem_bytes / s["smem_bytes_per_cycle"]
        return s["statement_cycles"] + busy + shuffles * s["shuffle_cycles"]


class _Ops(ast.NodeVisitor):
    def __init__(self):
        self.fp, self.mufu = 0, 0

    def visit_BinOp(self, node):
        self.fp += 1
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self.fp += 1
        self.generic_visit(node)

    def visit_Compare(self, node):
        self.fp += len(node.ops)
        self.generic_visit(node)

    def visit_Call(self, node):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in EXP_CALLS:
            self.mufu += 1
        elif name == "if_then_else":
            self.fp += 1  # a select
        self.generic_visit(node)


@dataclasses.dataclass
class Statement:
    text: str  # the loop's body, as written
    fp: int  # fp32 operations per element
    mufu: int  # special-function (exp2) operations per element
    role: str  # softmax, rescale, epilogue or other
    smem_bytes: int = 0  # shared-memory bytes moved per element: a shared-to-shared copy (fp8's V transpose) reads and writes


def classify(text: str) -> str:
    """The role of a tile statement, from its text (the chart's colours)."""
    t = text.replace(" ", "")
    if "exp2(" in t or "exp(" in t or "reduce_max" in t or "reduce_sum" in t or "if_then_else" in t and ">=" in t:
        return "softmax"
    if "acc_o[i,j]*=" in t or "*=alpha" in t:
        return "rescale"
    if "/row_sum" in t or "O_shared" in t or "acc_o[i,j]=" in t:
        return "epilogue"
    if "row_sum" in t or "m_prev" in t or "p_reg" in t:
        return "softmax"
    return "other"


def _element_size(tree) -> int:
    """Bytes of the kernel's element type (its DTYPE constant; 2 when it has none)."""
    from attngen.timeline.trace import ITEMSIZE

    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["DTYPE"] \
                and isinstance(node.value, ast.Constant):
            return ITEMSIZE.get(node.value.value, 2)
    return 2


def _shared_copy(body) -> bool:
    """A loop body that only copies one shared buffer's element into another (fp8's V transpose)."""
    return len(body) == 1 and isinstance(body[0], ast.Assign) and isinstance(body[0].value, ast.Subscript) \
        and all("_shared" in ast.unparse(x) for x in (body[0].targets[0], body[0].value.value))


class SourceInfo:
    """Line texts of the emitted source and what each T.Parallel loop costs per element."""

    def __init__(self, source: str):
        self.lines = source.splitlines()
        lines = self.lines
        self.loops: dict[int, Statement] = {}
        tree = ast.parse(source)
        itemsize = _element_size(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and getattr(node.iter.func, "attr", "") == "Parallel":
                ops = _Ops()
                for stmt in node.body:
                    ops.visit(stmt)
                body = "\n".join("\n".join(lines[n.lineno - 1:n.end_lineno]).strip() for n in node.body)
                smem = 2 * itemsize if _shared_copy(node.body) else 0
                self.loops[node.lineno] = Statement(body, max(ops.fp, 1), ops.mufu, classify(body), smem)

    def text(self, line) -> str:
        if line is None or not 1 <= line <= len(self.lines):
            return ""
        return self.lines[line - 1].strip()


def _read(p: Path) -> dict:
    from attngen.reference.forward import InputError

    try:
        return tomllib.loads(p.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise InputError("--latency", str(p), f"a readable latency TOML file like {DEFAULT.name} ({why})") from None


def _check_like(params: dict, default: dict, p: Path) -> None:
    """Every section and parameter of the default, with a value of the same kind (numbers positive)."""
    from attngen.reference.forward import InputError

    for section, entries in default.items():
        for name, want in entries.items():
            got = params.get(section, {}).get(name) if isinstance(params.get(section), dict) else None
            where = f"[{section}] {name}"
            if got is None:
                raise InputError("--latency", str(p), f"a latency TOML with {where} (see {DEFAULT})")
            divisor = name in ("sms", "clock_ghz", "tflops") or name.endswith("_per_cycle")  # rates: > 0; costs: >= 0
            numbers = list(got.values()) if isinstance(got, dict) else [got]
            number_like = isinstance(want, (int, float, dict)) and not isinstance(want, bool)
            ok = isinstance(got, dict) == isinstance(want, dict) and (not number_like or all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and (x > 0 if divisor else x >= 0) for x in numbers))
            ok = ok and (number_like or type(got) is type(want))
            if not ok:
                kind = "positive" if divisor else "non-negative"
                raise InputError("--latency", str(p), f"{where} like the default's {want!r} ({kind} numbers)")
