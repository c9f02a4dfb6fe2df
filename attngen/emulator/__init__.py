"""A CPU emulator that executes emitted TileLang FA3 kernels under Hopper's asynchronous rules.

It runs the same text the GPU build compiles (see docs/emulator.md): warpgroups as agents
under a seeded scheduler, mbarriers with phases and parity waits, named barriers, TMA loads
that land when their phase completes, asynchronous wgmma retired by wait_wgmma, and hazard
and deadlock reports instead of silent wrong answers or hangs.

Modules: rewrite (ast pass), tlang (the T.* subset), memory (buffers, regions, TMA bounds),
clocks and hazards (happens-before race detection with vector clocks), agents (scheduler and
barriers), mutants (systematic mutants for the mutation score), driver (emulate, emulate_stats, check_run;
`attngen emulate` is attngen/cli/emulate.py).
"""

from attngen.emulator.agents import POLICIES
from attngen.emulator.backward import emulate_backward
from attngen.emulator.driver import Stats, check_run, emulate, emulate_stats
from attngen.emulator.errors import DeadlockError, EmulationError, HazardError, KernelError, UnsupportedConstruct

__all__ = [
    "emulate", "emulate_backward", "emulate_stats", "check_run", "Stats", "POLICIES",
    "EmulationError", "HazardError", "DeadlockError", "UnsupportedConstruct", "KernelError",
]
