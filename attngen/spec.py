"""The user's declarative description of one FA3 forward kernel.

A `Spec` holds only what the user chose. Everything derived from it (tile
sizes when absent, thread counts, register split, shared-memory bytes,
barrier numbering) lives in `plan.py`, which is also where budgets are
checked. This module checks each field on its own: type, range, unknown keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any

HEAD_DIMS = (64, 96, 128, 192, 256)
DTYPES = {"float16": "f16", "bfloat16": "bf16"}
MAX_CONSUMERS = 3
MAX_STAGES = 4
MAX_GQA_GROUP = 1024


class SpecError(ValueError):
    """A spec that cannot become a kernel: names the field, the value and what would be valid."""

    def __init__(self, field: str, value: Any, valid: str):
        self.field, self.value, self.valid = field, value, valid
        super().__init__(f"spec field `{field}` = {value!r}: {valid}")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One FlashAttention-3 forward kernel for sm_90a. See docs/spec-reference.md."""

    head_dim: int = 128
    dtype: str = "float16"
    causal: bool = False
    gqa_group: int = 1
    consumers: int = 2
    k_stages: int = 2
    v_stages: int = 2
    block_m: int | None = None
    block_n: int | None = None
    pingpong: bool | None = None
    aligned: bool = False

    def __post_init__(self):
        _check_fields(self)
        if self.pingpong is None:
            object.__setattr__(self, "pingpong", self.consumers >= 2)
        if self.pingpong and self.consumers < 2:
            raise SpecError("pingpong", self.pingpong, "ping-pong needs consumers >= 2 (there is no other warpgroup to alternate with)")
        # Tile sizes are resolved by the plan; freezing them here makes the spec's
        # name and hash independent of whether the user wrote the default out.
        if self.block_m is None or self.block_n is None:
            from attngen.plan import default_tiles

            bm, bn = default_tiles(self)
            object.__setattr__(self, "block_m", self.block_m if self.block_m is not None else bm)
            object.__setattr__(self, "block_n", self.block_n if self.block_n is not None else bn)
        from attngen.plan import make_plan

        make_plan(self)  # budgets: raises SpecError before anything is rendered

    # -- identity ---------------------------------------------------------
    @property
    def name(self) -> str:
        """Canonical readable name; every axis of the spec is in it."""
        parts = [
            f"fa3_fwd_hd{self.head_dim}",
            DTYPES[self.dtype],
            "causal" if self.causal else "full",
            f"g{self.gqa_group}",
            f"c{self.consumers}",
            f"k{self.k_stages}v{self.v_stages}",
            f"m{self.block_m}n{self.block_n}",
        ]
        if self.consumers >= 2 and not self.pingpong:
            parts.append("nopp")
        if self.aligned:
            parts.append("aligned")
        return "_".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def hash(self) -> str:
        """Content hash of the resolved spec (12 hex digits)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]



FIELDS = tuple(f.name for f in dataclasses.fields(Spec))


def _check_fields(s: Spec) -> None:
    def need_int(field, lo, hi):
        v = getattr(s, field)
        if type(v) is not int or not lo <= v <= hi:
            raise SpecError(field, v, f"expected an integer from {lo} to {hi}")

    def need_bool(field, optional=False):
        v = getattr(s, field)
        if not (isinstance(v, bool) or (optional and v is None)):
            raise SpecError(field, v, "expected true or false")

    if type(s.head_dim) is not int or s.head_dim not in HEAD_DIMS:
        raise SpecError("head_dim", s.head_dim, f"expected one of {', '.join(map(str, HEAD_DIMS))}")
    if not isinstance(s.dtype, str) or s.dtype not in DTYPES:
        raise SpecError("dtype", s.dtype, 'expected "float16" or "bfloat16"')
    need_bool("causal")
    need_int("gqa_group", 1, MAX_GQA_GROUP)
    need_int("consumers", 1, MAX_CONSUMERS)
    need_int("k_stages", 1, MAX_STAGES)
    need_int("v_stages", 1, MAX_STAGES)
    need_bool("pingpong", optional=True)
    need_bool("aligned")
    rows = 64 * s.consumers
    if s.block_m is not None and (type(s.block_m) is not int or s.block_m != rows):
        raise SpecError(
            "block_m", s.block_m,
            f"expected {rows}: each consumer warpgroup owns 64 query rows (one wgmma M tile), so block_m = 64 * consumers",
        )
    if s.block_n is not None:
        v = s.block_n
        if type(v) is not int or not (16 <= v <= 256 and v % 16 == 0):
            raise SpecError("block_n", v, "expected a multiple of 16 from 16 to 256 (wgmma N and the PV reduction step)")


def from_dict(data: dict[str, Any], *, source: str = "spec") -> Spec:
    """Build a Spec from flat keys, rejecting unknown ones with the nearest valid key."""
    if not isinstance(data, dict):
        raise SpecError("<spec>", data, "expected a table of flat keys")
    for key, value in data.items():
        if key not in FIELDS:
            near = difflib.get_close_matches(key, FIELDS, n=1)
            hint = f"did you mean `{near[0]}`? " if near else ""
            raise SpecError(key, value, f"unknown key in {source}; {hint}valid keys: {', '.join(FIELDS)}")
    return Spec(**data)


def load(path: str | Path) -> Spec:
    """Read a spec from a TOML file of flat keys."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError("<file>", str(path), "no such spec file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError("<file>", str(path), f"not valid TOML: {e}") from None
    return from_dict(data, source=str(path))


def to_toml(spec: Spec) -> str:
    """The resolved spec as TOML (what the emitted header and presets carry)."""
    lines = []
    for key, value in spec.to_dict().items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = json.dumps(value)
        else:
            text = str(value)
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"
