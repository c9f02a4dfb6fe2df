"""The public address of context parallelism (`from attngen import distributed as cp`).

The code lives in attngen/interfaces/distributed.py; this name is the same module object, so that
imports, attributes and monkeypatches through either name reach one module.
"""

import sys

from attngen.interfaces import distributed as _module

sys.modules[__name__] = _module
