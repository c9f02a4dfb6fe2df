"""The public address of the torch ops (`import attngen.ops` registers attngen::fwd, bwd and append_kv).

The code lives in attngen/interfaces/ops.py; this name is the same module object, so that
imports, attributes and monkeypatches through either name reach one module.
"""

import sys

from attngen.interfaces import ops as _module

sys.modules[__name__] = _module
