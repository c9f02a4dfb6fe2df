"""`attngen timeline --gpu`: the stamped build on a real GPU (see instrument.py)."""

from __future__ import annotations


def gpu_missing() -> str | None:
    """None when an sm_90 CUDA device is usable, else why not (one line)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"the device has compute capability {cap[0]}.{cap[1]}, not 9.0 (Hopper)"
    return None
