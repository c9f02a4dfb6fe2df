"""Vector clocks for happens-before race detection (see hazards.py for how they are used).

A clock is a plain list of ints indexed by *component*. Components are allocated per CTA
as they are needed (agents first, then one per mbarrier), so clocks of different lengths
meet; a missing entry reads as 0. Lists of a dozen ints keep joins cheap.
"""

from __future__ import annotations


def get(vc: list, comp: int) -> int:
    return vc[comp] if comp < len(vc) else 0


def join(dst: list, src) -> None:
    """dst := max(dst, src), element-wise, in place."""
    if not src:
        return
    n = len(src)
    if len(dst) < n:
        dst.extend([0] * (n - len(dst)))
    for i in range(n):
        x = src[i]
        if x > dst[i]:
            dst[i] = x


def advance(vc: list, comp: int, value: int) -> None:
    """vc[comp] := max(vc[comp], value)."""
    if len(vc) <= comp:
        vc.extend([0] * (comp + 1 - len(vc)))
    if value > vc[comp]:
        vc[comp] = value
