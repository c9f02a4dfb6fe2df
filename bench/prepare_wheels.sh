#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the H200 image lacks for `import tilelang`, and .seed/ with the
# seed kernel: run on a machine with internet, before a GPU run; bench/gpu_check.sh installs the
# wheels there with pip --target. The device call carries both: carry [".whl", ".seed"].
#
#   bash bench/prepare_wheels.sh                 # CPython 3.12, x86-64 (the H200 image)
#   PY_VERSION=3.11 bash bench/prepare_wheels.sh # for a local rehearsal with this machine's python
#
# The image has torch 2.11, numpy, ml-dtypes, cloudpickle, psutil, tqdm, typing-extensions,
# jinja2 (KINDS.md); it lacks tilelang and three of its requirements. Pins are tilelang
# 0.1.15's (apache-tvm-ffi <0.1.13, z3-solver <4.15.5) at the versions installed here.
# z3 cannot be left behind: libtilelang.so links libz3.so.4.15 (`ldd` shows it), so the
# z3-solver wheel is cut down to that one library (bench/slim_z3_wheel.py: 29 MB -> 9.6 MB),
# which keeps the tree that travels under its 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHEEL_DIR:-.whl}
PYV=${PY_VERSION:-3.12}
PINS=(tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5)
Z3=z3-solver==4.15.4.0
LIMIT=$((64 * 1024 * 1024))

download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"
}

mkdir -p "$DEST"
download -d "$DEST" "${PINS[@]}"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
download -d "$TMP" "$Z3"
rm -f "$DEST"/z3_solver-*.whl
python3 bench/slim_z3_wheel.py "$TMP"/z3_solver-*.whl "$DEST" >/dev/null

# One version of each distribution: two stop the whole install on the GPU machine.
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
if [[ -n "$dupes" ]]; then
  echo "more than one wheel of: $dupes (in $DEST); remove the old ones" >&2
  exit 1
fi

ls -l "$DEST"/*.whl | awk '{printf "%10d  %s\n", $5, $9}'
# The hand-written seed kernel, cut from ../shared (which does not travel) into the git-ignored .seed/
python3 bench/seed_kernel.py --out .seed || echo "no seed kernel: the benchmark will run without the seed row" >&2
wheels=$(cat "$DEST"/*.whl .seed/*.py 2>/dev/null | wc -c)
tree=$(git ls-files -co --exclude-standard -z | xargs -0 cat 2>/dev/null | wc -c)
total=$((wheels + tree))
awk -v w="$wheels" -v t="$tree" 'BEGIN { m = 1048576; printf "wheels %.1f MiB + working tree %.1f MiB = %.1f MiB of the 64 MiB a device call may carry\n", w / m, t / m, (w + t) / m }'
if ((total > LIMIT)); then
  echo "over the limit: the device call would refuse this tree" >&2
  exit 1
fi
