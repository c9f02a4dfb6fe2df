"""The marks of the GPU-only test modules: `pytest -m gpu` selects them, and without a compute
capability 9.0 device they skip cleanly (CI, this machine, a CPU-only torch build). Also the mark
of the tests that build a kernel for the GPU runtime and need a CUDA toolkit, not a device."""

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


def has_toolkit() -> bool:
    from attngen.build import toolchain

    try:
        toolchain.current()
    except toolchain.ToolchainError:
        return False
    return True


NEEDS_TOOLKIT = pytest.mark.skipif(not has_toolkit(),
                                   reason="a CUDA toolkit (nvcc: system or the nvidia-cuda-nvcc wheels) is needed to build a kernel")
