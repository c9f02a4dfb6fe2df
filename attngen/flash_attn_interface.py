"""The public address of FlashAttention-3's door (`from attngen.flash_attn_interface import flash_attn_func`).

The code lives in attngen/interfaces/flash_attn_interface.py; this name is the same module object, so that
imports, attributes and monkeypatches through either name reach one module.
"""

import sys

from attngen.interfaces import flash_attn_interface as _module

sys.modules[__name__] = _module
