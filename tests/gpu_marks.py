"""The marks of the GPU-only test modules: `pytest -m gpu` selects them, and without a compute
capability 9.0 device they skip cleanly (CI, this machine, a CPU-only torch build)."""

import pytest
import torch


def has_sm90() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
    except Exception:  # a CPU-only torch build raises instead of answering
        return False


GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_sm90(), reason="needs a CUDA device of compute capability 9.0 (H100/H200)"),
]
