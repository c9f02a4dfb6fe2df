"""Exceptions raised by the CPU emulator; each carries a readable multi-line report."""

from __future__ import annotations


class EmulationError(Exception):
    """Base class: the emitted kernel did something the Hopper model rejects."""

    kind = "error"

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


class HazardError(EmulationError):
    """Two accesses race (no synchronization orders them), an async-proxy read lacks its proxy
    fence, or an asynchronous operation is left in flight."""

    kind = "hazard"


class DeadlockError(EmulationError):
    """Every agent of a CTA is blocked: the report names each agent's line and what it waits for."""

    kind = "deadlock"


class UnsupportedConstruct(EmulationError):
    """The emitted source uses something the emulator does not model; names it and its line."""

    kind = "unsupported"


class KernelError(EmulationError):
    """The emitted code failed in an ordinary way (bad index, shape mismatch, Python error)."""

    kind = "kernel error"


class Abort(BaseException):
    """Unwinds an agent thread after another agent failed (BaseException: emitted code cannot catch it)."""
