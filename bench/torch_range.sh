#!/usr/bin/env bash
# Test attngen with one torch release in a fresh virtual environment (default: 2.4.0, the
# lowest that pyproject.toml allows), as a user with their own torch would have it.
#
#   bash bench/torch_range.sh            # torch 2.4.0
#   bash bench/torch_range.sh 2.14.1     # any other release
#
# torch first (the release asked for), then attngen from this checkout (not editable: the
# package as pip builds it) with its test extra; pip keeps that torch, or the run stops.
# Then the CPU tests that touch torch: the runtime's input checks (and its slow test, which
# compiles a kernel through tilelang.compile in two processes), the CPU model's torch
# in/torch out path, the torch SDPA oracle of the reference tests, and the custom ops
# (tests/test_ops.py, tests/test_ops_backward.py: torch.library, compile, export, opcheck and autograd,
# whose APIs move between releases).
# The venv lives in /tmp (TORCH_RANGE_VENV to move it); PyPI's Linux torch wheels are CUDA
# builds (about 2.5 GB with their nvidia-* requirements for 2.4.0); they import without a GPU.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-2.4.0}
VENV=${TORCH_RANGE_VENV:-/tmp/attngen-torch-$VERSION}
PY=${PYTHON:-python3}

"$PY" -m venv --clear "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$VERSION"
"$VENV/bin/python" -m pip install -q "$ROOT[test]"
have=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$have" != "$VERSION" ]; then
    echo "torch_range.sh: pip replaced torch $VERSION with $have while installing attngen" >&2
    exit 1
fi
"$VENV/bin/python" -c "import torch, tilelang, attngen; print(f'torch {torch.__version__}, tilelang {tilelang.__version__}, attngen from {attngen.__file__}')"
cd "$ROOT"
# -p no:cacheprovider: leave the checkout as it was (python -m puts the checkout first on sys.path,
# so the tests run this attngen; the install above brought its requirements)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_runtime_validation.py tests/test_reference.py tests/test_ops.py tests/test_ops_backward.py \
    "tests/test_emulator.py::test_torch_in_torch_out_numpy_in_numpy_out"
