"""Which CUDA toolkit builds the kernels: found in one place, used by `build` and handed to TileLang.

The first of these that exists wins:

1. `$CUDA_HOME` (or `$CUDA_PATH`): the user named a toolkit; it must hold `bin/nvcc`.
2. `nvcc` on `$PATH`.
3. The pip wheels that attngen depends on (Linux x86-64): `nvidia-cuda-nvcc`, `-crt`,
   `-runtime`, `-cccl`, `nvidia-nvvm`, `-cuobjdump`, `-nvdisasm`, which lay a toolkit out
   under `site-packages/nvidia/cu13/` (`bin/nvcc`, `bin/ptxas`, `nvvm/bin/cicc`, `include/`).

TileLang (tilelang/env.py) looks in the same order for 1 and 2 and so finds the same nvcc by
itself; for 3 attngen sets `CUDA_HOME` before TileLang is imported (`hand_to_tilelang`), so the
runtime's `tilelang.compile` runs the same nvcc as `attngen build`. nvcc always needs a host C
compiler (`gcc`) for its preprocessing, which no wheel provides.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

NVCC_WHEEL = "nvidia-cuda-nvcc"
INSTALL_HINT = (
    "`python -m pip install -e .` installs it from the nvidia-cuda-nvcc wheels (Linux x86-64); "
    "elsewhere install a CUDA toolkit (12.4 or newer) and put its nvcc on PATH or set CUDA_HOME"
)


_handed_home: str | None = None  # the CUDA_HOME that hand_to_tilelang set (so find() still calls it "pip")


class ToolchainError(RuntimeError):
    """No usable CUDA toolkit: one line that says what was looked at and what to install."""


@dataclasses.dataclass
class Toolchain:
    """A CUDA toolkit. Only nvcc's path is looked up eagerly; the rest when first asked for
    (a cache hit needs nvcc's version alone, and must stay cheap)."""

    found_by: str  # "CUDA_HOME", "CUDA_PATH", "PATH" or "pip"
    nvcc: str
    home: str | None = None  # known toolkit root (CUDA_HOME, the wheels); None: ask nvcc (PATH)
    path: str = ""  # the PATH searched for gcc and cuobjdump
    pip_home: Path | bool | None = None  # the wheels' folder; None: look it up; False: none

    @functools.cached_property
    def cuda_home(self) -> str:
        return self.home if self.home is not None else _home_of_nvcc(self.nvcc)

    @functools.cached_property
    def kind(self) -> str:
        """"pip" for a toolkit inside the wheels' folder (however it was found: hand_to_tilelang
        sets CUDA_HOME to it), else "system"."""
        pip_home = pip_cuda_home() if self.pip_home is None else self.pip_home
        return "pip" if pip_home and Path(self.cuda_home).resolve() == Path(pip_home).resolve() else "system"

    @functools.cached_property
    def cuobjdump(self) -> str | None:
        return _cuobjdump(Path(self.cuda_home), self.path)

    @functools.cached_property
    def host_compiler(self) -> str | None:
        return shutil.which("gcc", path=self.path) or shutil.which("cc", path=self.path)

    @functools.cached_property
    def version(self) -> str:
        """nvcc's release, e.g. "13.0.88" (from `nvcc --version`)."""
        try:
            out = subprocess.run([self.nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            raise ToolchainError(f"{self.nvcc} --version failed ({e}); {INSTALL_HINT}") from None
        m = re.search(r"release [\d.]+, V([\d.]+)", out)
        if not m:
            raise ToolchainError(f"{self.nvcc} --version printed no release line; {INSTALL_HINT}")
        return m.group(1)

    @property
    def include_dirs(self) -> list[str]:
        inc = Path(self.cuda_home) / "include"
        return [str(p) for p in (inc, inc / "cccl") if p.is_dir()]

    def subprocess_env(self) -> dict:
        """The environment for nvcc and cuobjdump: their own bin directory first on PATH
        (cuobjdump runs nvdisasm found there)."""
        env = dict(os.environ)
        dirs = [str(Path(self.nvcc).parent)] + ([str(Path(self.cuobjdump).parent)] if self.cuobjdump else [])
        env["PATH"] = os.pathsep.join(dict.fromkeys(dirs + [env.get("PATH", "")]))
        return env

    def require_host_compiler(self) -> None:
        if self.host_compiler is None:
            raise ToolchainError(
                f"nvcc ({self.nvcc}) needs a host C/C++ compiler and none is on PATH: install gcc and g++ "
                "(Debian/Ubuntu: apt-get install g++)"
            )

    def describe(self) -> dict:
        """What `attngen build --json` reports under "toolchain"."""
        return {"kind": self.kind, "found_by": self.found_by, "nvcc": self.nvcc, "version": self.version, "cuda_home": self.cuda_home}


def wheel_binary(dist: str, binary: str) -> Path | None:
    """The path of bin/`binary` inside the installed wheel `dist`, or None."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    path = next((Path(f.locate()) for f in files if f.name == binary and f.parent.name == "bin"), None)
    return path if path is not None and path.is_file() else None


def pip_cuda_home() -> Path | None:
    """The toolkit folder the nvidia-cuda-nvcc wheel installed (site-packages/nvidia/cu13), if any."""
    nvcc = wheel_binary(NVCC_WHEEL, "nvcc")
    return nvcc.parent.parent if nvcc else None


def _home_of_nvcc(nvcc: str) -> str:
    """The toolkit root behind an nvcc on PATH, through symlinks and wrapper scripts
    (nvcc's dry run prints the TOP it resolved); falls back to nvcc's grandparent folder."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
        if m:
            return os.path.normpath(m.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return str(Path(os.path.realpath(nvcc)).parent.parent)


def _cuobjdump(home: Path, path: str) -> str | None:
    """cuobjdump of the same toolkit, else on PATH, else from the nvidia-cuda-cuobjdump wheel."""
    for candidate in (home / "bin" / "cuobjdump", shutil.which("cuobjdump", path=path), wheel_binary("nvidia-cuda-cuobjdump", "cuobjdump")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return None


def find(environ=None, pip_home=None) -> Toolchain:
    """Discover the toolkit (order in the module docstring); raises ToolchainError, one line.

    `environ` and `pip_home` exist so tests can hide toolkits (defaults: os.environ and
    the installed nvidia-cuda-nvcc wheel; pass pip_home=False for "no wheel").
    """
    environ = os.environ if environ is None else environ
    path = environ.get("PATH", "")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = environ.get(var)
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            if not nvcc.is_file():
                raise ToolchainError(f"{var}={home} holds no bin/nvcc: point {var} at a CUDA toolkit, "
                                     "or unset it to use nvcc on PATH or the pip wheels")
            found_by = "pip" if home == _handed_home else var
            return Toolchain(found_by, str(nvcc), str(Path(home)), path, pip_home)
    on_path = shutil.which("nvcc", path=path)
    if on_path:
        return Toolchain("PATH", on_path, None, path, pip_home)
    if pip_home is None:
        pip_home = pip_cuda_home()
    if pip_home and (Path(pip_home) / "bin" / "nvcc").is_file():
        return Toolchain("pip", str(Path(pip_home) / "bin" / "nvcc"), str(pip_home), path, pip_home)
    raise ToolchainError(f"no CUDA toolkit: no nvcc on PATH, CUDA_HOME unset, and no {NVCC_WHEEL} wheel installed; {INSTALL_HINT}")


@functools.lru_cache(maxsize=1)
def current() -> Toolchain:
    """The toolkit of this process (cached; `current.cache_clear()` after changing the environment)."""
    return find()


def hand_to_tilelang() -> str | None:
    """Make TileLang use the toolkit attngen finds; returns the CUDA_HOME handed over, if any.

    Only the pip toolkit needs handing over: TileLang finds $CUDA_HOME and nvcc on PATH by
    itself, in the same order as `find`. Cheap (no subprocess): it runs when attngen.build.lower
    is imported, before TileLang is.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or shutil.which("nvcc"):
        return None
    home = pip_cuda_home()
    if home is None:
        return None  # no toolkit at all: `attngen build` says so; TileLang reports its own error
    global _handed_home
    os.environ["CUDA_HOME"] = _handed_home = str(home)
    current.cache_clear()
    env = sys.modules.get("tilelang.env")
    if env is not None and not getattr(env, "CUDA_HOME", None):
        # TileLang was imported before attngen and found nothing: it reads CUDA_HOME into module constants at import.
        env.CUDA_HOME = env.env.CUDA_HOME = str(home)
        nvcc_mod = sys.modules.get("tilelang.contrib.nvcc")
        if nvcc_mod is not None:
            nvcc_mod.CUDA_HOME = str(home)
    return str(home)
