"""Fuzz the `attngen` command and the spec loader: any input gives a result or one error line.

Hypothesis draws spec files (wrong types, unknown keys, extreme values, arrays, tables, random
bytes, latin-1, a BOM, empty files) and command lines (subcommands, options with negative, huge
and non-numeric values, missing values, unknown options). Every draw must end in

- exit 0 or 1 with the command's normal output (a file path, source, a diff, an emulation; exit 1
  may add one `attngen: error:` line when the toolchain or the file system refused), or
- exit 2 with exactly one stderr line starting `attngen: error:` (argparse's own errors are made
  one line of that form too: see cli.Parser),

and never a traceback. The CLI runs in-process through attngen.cli.main for speed;
test_cli.py::test_subprocess_matches_in_process shows in-process equals the real command.
`build` and `check` would run nvcc: `build` is drawn with its nvcc step stubbed out (the
options and the spec are still checked first), `check` only with options that fail before
building. Shapes are bounded so an emulation stays under a second.
"""

from __future__ import annotations

import io
import os
import string
import tempfile
from contextlib import chdir, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from attngen.cli import main
from attngen.spec import FIELDS

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "examples" / "default.toml"
TRIED = {"runs": 0, "exit": {}}


def toml_scalar():
    return st.one_of(
        st.integers(-3, 300), st.sampled_from([0, -1, 10**23, 2**63 - 1, 64, 96, 128, 192, 256]),
        st.booleans(), st.floats(allow_nan=True, allow_infinity=True, width=32),
        st.sampled_from(['"float16"', '"bfloat16"', '"float32"', '"yes"', '""', "nan", "inf", "-inf"]),
        st.text(string.ascii_letters + " -_", max_size=6).map(lambda t: '"' + t + '"'),
    )


def render_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v).replace("nan", "nan").replace("inf", "inf")
    return str(v)


@st.composite
def toml_text(draw) -> bytes:
    keys = st.sampled_from(FIELDS + ("casual", "stages", "head-dim", "Head_Dim", "block_k", "x"))
    lines = []
    for key in draw(st.lists(keys, max_size=6)):
        kind = draw(st.sampled_from(["scalar", "scalar", "scalar", "array", "table", "dup"]))
        if kind == "scalar":
            lines.append(f"{key} = {render_value(draw(toml_scalar()))}")
        elif kind == "array":
            lines.append(f"{key} = [{', '.join(render_value(draw(toml_scalar())) for _ in range(draw(st.integers(0, 3))))}]")
        elif kind == "table":
            lines.append(f"[{key}]\nhead_dim = 128")
        else:
            lines += [f"{key} = 1", f"{key} = 2"]
    text = "\n".join(lines) + draw(st.sampled_from(["", "\n", "\n# caf\u00e9\n"]))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8", "latin-1", "utf-8-sig", "utf-16", "random"]))
    if encoding == "random":
        return draw(st.binary(max_size=64))
    return text.encode(encoding, errors="replace")


INT_VALUES = st.one_of(
    st.integers(-5, 300).map(str), st.sampled_from(["0", "-1", "1000000000", "70000", "12345678901234567890123", "1e9",
                                                    "abc", "", "3.5", "0x10", " 7", "--", "nan"]))
OPTIONS = {
    "generate": {"-o": "dir", "--output": "dir", "--backward": None, "--presets": None},
    "show": {"--backward": None},
    "diff": {},
    "build": {"--json": None, "--shape": "shape", "--cuda": "file", "--cache-dir": "dir", "--backward": None},
    "precompile": {"-j": "small", "--shape": "shape", "--cache-dir": "dir"},  # one spec: in-process, like build
    "check": {"-o": "dir", "--cache-dir": "dir", "--q-len": "int", "--kv-len": "int", "--seed": "int"},
    "emulate": {"--batch": "small", "--heads": "small", "--kv-heads": "small", "--q-len": "len", "--kv-len": "len",
                "--seed": "int", "--policy": "policy", "--source": "file", "--backward": None},
    "tune": {"--seq-len": "int", "--shape": "shape", "--dry-run": None, "--max-candidates": "small", "-j": "small",
             "--cache-dir": "dir", "--table": "out"},
    "timeline": {"--batch": "small", "--kv-heads": "small", "--q-len": "len", "--kv-len": "len", "--block": "small",
                 "--compare": "file", "--gpu": None, "--latency": "file", "--seed": "int", "--policy": "policy",
                 "--max-blocks": "small", "-o": "out"},
}
BOUNDED = {"emulate": (("--batch", 2), ("--kv-heads", 2), ("--heads", 8), ("--q-len", 200), ("--kv-len", 200)),
           "timeline": (("--batch", 2), ("--kv-heads", 2), ("--q-len", 200), ("--kv-len", 200))}


@st.composite
def command_line(draw, spec_path: str, tmp: str):
    command = draw(st.sampled_from(list(OPTIONS) + ["bogus", "--version", "-h"]))
    if command not in OPTIONS:
        return [command]
    specs = st.sampled_from([spec_path, spec_path, str(DEFAULT), tmp, os.path.join(tmp, "missing.toml")])
    argv = [command] + [draw(specs) for _ in range(2 if command == "diff" else 1)]
    if draw(st.integers(0, 9)) == 0:
        argv = argv[:1]  # missing positional
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(list(OPTIONS[command]) + ["--bogus", "-x"]))
        kind = OPTIONS[command].get(name, "int")
        if kind is None:
            argv.append(name)
            continue
        value = {
            "int": INT_VALUES,
            "small": st.one_of(st.integers(-2, 3).map(str), INT_VALUES),
            "len": st.one_of(st.integers(-2, 200).map(str), INT_VALUES),
            "policy": st.sampled_from(["random", "producer-first", "consumers-first", "fastest", ""]),
            "dir": st.sampled_from([tmp, spec_path, os.path.join(tmp, "out")]),
            "file": st.sampled_from([spec_path, tmp, os.path.join(tmp, "none.py"), str(DEFAULT)]),
            "out": st.sampled_from([tmp, os.path.join(tmp, "out.html"), os.path.join(tmp, "no", "dir", "x")]),  # never the repo
            "shape": st.one_of(st.lists(INT_VALUES, min_size=0, max_size=6).map(",".join), st.just("1,1,1,64,64")),
        }[kind]
        argv.append(name)
        if draw(st.integers(0, 12)):  # sometimes the value is missing
            argv.append(draw(value))
    if command == "check" and "--q-len" not in argv:
        argv += ["--q-len", "0"]  # check builds with nvcc: only draws that fail before the build
    if command in BOUNDED:  # bound the emulation: at most 2 x 2 heads of 200 x 200
        for name, cap in BOUNDED[command]:
            for i, a in enumerate(argv[:-1]):
                if a == name and argv[i + 1].lstrip("-").isdigit() and int(argv[i + 1]) > cap:
                    argv[i + 1] = str(cap) if argv[i + 1] not in ("1000000000", "70000", "12345678901234567890123") else argv[i + 1]
    return argv


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 2
    TRIED["runs"] += 1
    TRIED["exit"][rc] = TRIED["exit"].get(rc, 0) + 1
    return rc, out.getvalue(), err.getvalue()


def assert_clean(argv, rc, out, err):
    assert "Traceback" not in out + err, (argv, err)
    lines = err.splitlines()
    if rc in (0, 1):  # a result; exit 1 may carry one line (the toolchain or file system said no)
        assert not lines or (rc == 1 and len(lines) == 1 and lines[0].startswith("attngen: error: ")), (argv, rc, err)
    else:
        lines = err.splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("attngen: error: "), (argv, rc, out, err)


@pytest.fixture
def no_nvcc(monkeypatch):
    """`build` checks its options and the spec, then would lower and run nvcc: stop there."""
    import attngen.build.nvcc

    def stub(plan, cache_dir=None, **kw):
        raise attngen.build.nvcc.BuildError("nvcc not run in the fuzz test (stubbed)")

    monkeypatch.setattr(attngen.build.nvcc, "build", stub)
    monkeypatch.setattr(attngen.build.nvcc, "build_backward", stub)  # build --backward's kernels
    monkeypatch.setattr("attngen.run.tune.build", stub)  # tune's candidates too
    monkeypatch.setattr("attngen.run.forward.precompile", stub)  # and precompile's TileLang build


# 8x the profile's examples: 160 with the ci profile, 2400 with dev
FUZZ = settings(max_examples=8 * settings.default.max_examples,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@FUZZ
@given(spec=toml_text(), data=st.data())
def test_any_spec_file_and_command_line_gives_a_result_or_one_error_line(no_nvcc, spec, data):
    with tempfile.TemporaryDirectory() as tmp, chdir(tmp):  # `generate` without -o writes to ./generated
        path = os.path.join(tmp, "spec.toml")
        with open(path, "wb") as f:
            f.write(spec)
        argv = data.draw(command_line(path, tmp))
        rc, out, err = run(argv)
        assert_clean(argv, rc, out, err)


@FUZZ
@given(spec=toml_text())
def test_the_spec_loader_raises_spec_error_or_loads(spec):
    from attngen.spec import Spec, SpecError, load

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "spec.toml")
        path.write_bytes(spec)
        try:
            assert isinstance(load(path), Spec)
        except SpecError as e:
            assert "\n" not in str(e).strip() or "not valid TOML" in str(e)


def test_the_fuzz_oracle_catches_tracebacks_and_multi_line_errors():
    with pytest.raises(AssertionError):
        assert_clean(["show"], 2, "", "Traceback (most recent call last):\n")
    with pytest.raises(AssertionError):
        assert_clean(["show"], 2, "", "usage: attngen\nattngen: error: x\n")
    with pytest.raises(AssertionError):
        assert_clean(["show"], 3, "", "attngen: error: x\n")
    assert_clean(["show"], 2, "", "attngen: error: x\n")


def test_report_how_many_runs_the_fuzz_tried():
    # runs after the fuzz tests in this module; `pytest -s` prints the count for the docs
    print(f"\ncli fuzz: {TRIED['runs']} command lines run, 0 tracebacks; by exit status {sorted(TRIED['exit'].items())}")
