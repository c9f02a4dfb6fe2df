"""Repack the z3-solver wheel down to the one file TileLang needs: z3/lib/libz3.so.4.15.

libtilelang.so and libtvm_compiler.so link libz3.so.4.15 (found through their
rpath $ORIGIN/../../z3/lib), so the library must travel; the z3 Python API,
the z3 binary and the second copy of the library (68 MB unpacked, a 29 MB
wheel) need not. Without z3/__init__.py, `import z3` in tilelang/env.py finds
a namespace package and stays quiet. The result is a valid wheel with a local
version tag (+libonly) so nobody takes it for the real one.

    python3 bench/slim_z3_wheel.py z3_solver-4.15.4.0-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl .whl/
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

KEEP = "z3/lib/libz3.so.4.15"


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def slim(src: Path, dest_dir: Path) -> Path:
    name, version, *tags = src.name[: -len(".whl")].split("-")
    local = f"{version}+libonly"
    out = dest_dir / f"{name}-{local}-{'-'.join(tags)}.whl"
    info = f"{name}-{local}.dist-info"
    with zipfile.ZipFile(src) as zin:
        lib = zin.read(KEEP)
        old_info = next(n.split("/")[0] for n in zin.namelist() if n.endswith(".dist-info/WHEEL"))
        wheel = zin.read(f"{old_info}/WHEEL")
        meta = zin.read(f"{old_info}/METADATA").decode()
    meta = "\n".join(f"Version: {local}" if line.startswith("Version:") else line for line in meta.splitlines()) + "\n"
    files = {KEEP: lib, f"{info}/WHEEL": wheel, f"{info}/METADATA": meta.encode()}
    record = [record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    dest_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for n, d in files.items():
            zi = zipfile.ZipInfo(n, date_time=(2025, 1, 1, 0, 0, 0))
            zi.external_attr = 0o755 << 16 if n == KEEP else 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, d, compresslevel=9)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(slim(Path(sys.argv[1]), Path(sys.argv[2])))
