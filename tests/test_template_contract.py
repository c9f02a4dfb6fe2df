"""Every template receives exactly the names its header declares ("Receives:", one a line with a
type), and uses every one of them: for the goldens' specs (presets, serving layouts, backward
presets) and the append kernel's layouts. The planted cases show each way the contract breaks."""

from pathlib import Path

import pytest

import attngen
from attngen.cli.generate import BACKWARD_PRESETS
from attngen.kernels.append.plan import append_plan
from attngen.kernels.append.render import APPEND_TEMPLATE, append_context
from attngen.kernels.bwd import render as bwd
from attngen.kernels.common import contract
from attngen.kernels.fwd import render as fwd

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "examples").glob("*.toml"))
BACKWARD = [ROOT / "examples" / f"{name}.toml" for name in BACKWARD_PRESETS]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_forward_contract(preset):
    plan = fwd.as_plan(attngen.load_spec(preset), None)
    assert contract.contract_errors(fwd.TEMPLATE, fwd.template_context(plan)) == []


@pytest.mark.parametrize("preset", BACKWARD, ids=lambda p: p.stem)
def test_backward_contract(preset):
    bp = bwd.as_backward_plan(attngen.load_spec(preset))
    assert contract.contract_errors(bwd.TEMPLATE, bwd.template_context(bp)) == []


@pytest.mark.parametrize("page_size", [16, 256])
def test_append_contract(page_size):
    plan = append_plan("float16", 64, 128, page_size)
    assert contract.contract_errors(APPEND_TEMPLATE, append_context(plan)) == []


def test_the_split_kv_presets_pass_the_combine_names():
    """The combine is included only for a split-KV plan: its names must then all be passed."""
    split = [p for p in PRESETS if attngen.load_spec(p).splits != 1]
    assert split
    context = fwd.template_context(fwd.as_plan(attngen.load_spec(split[0]), None))
    assert set(contract.declared("combine/fa3_combine.py.j2")) <= set(context)


def test_every_template_declares_each_name_with_a_type():
    for name in contract.TEMPLATES:
        names = contract.declared(name)
        assert names and all(t for t in names.values()), name


# -- planted cases: a tiny template, each way the contract can break -----------------------------

GOOD = """{#-
  A planted template.
  Receives:
    kernel: Numbers — the plan's numbers
    rows: list[str] — lines laid out
      one after the other
-#}
N = {{ kernel.n }}
{%- for line in rows %}
{{ line }}
{%- endfor %}
"""


def errors(source: str, context: dict, monkeypatch) -> list[str]:
    monkeypatch.setattr(contract, "load_template", lambda name: source)
    for cached in (contract.declared, contract.used, contract.includes):
        cached.cache_clear()
    try:
        return contract.contract_errors("planted.py.j2", context)
    finally:
        for cached in (contract.declared, contract.used, contract.includes):
            cached.cache_clear()


def test_planted_template_keeps_its_contract(monkeypatch):
    assert contract.declared_in(GOOD) == {"kernel": "Numbers", "rows": "list[str]"}
    assert errors(GOOD, {"kernel": None, "rows": []}, monkeypatch) == []


def test_an_undeclared_name_is_caught(monkeypatch):
    source = GOOD + "{{ secret }}\n"
    assert errors(source, {"kernel": None, "rows": []}, monkeypatch) == [
        "planted.py.j2: uses 'secret', not declared in its header"]


def test_a_declared_name_not_passed_is_caught(monkeypatch):
    assert errors(GOOD, {"kernel": None}, monkeypatch) == ["planted.py.j2: declares 'rows', not passed"]


def test_a_declared_name_never_used_is_caught(monkeypatch):
    source = GOOD.replace("-#}", "    stale: int — a name the template no longer reads\n-#}")
    found = errors(source, {"kernel": None, "rows": [], "stale": 1}, monkeypatch)
    assert found == ["planted.py.j2: declares 'stale', never used"]


def test_a_passed_name_nobody_declares_is_caught(monkeypatch):
    found = errors(GOOD, {"kernel": None, "rows": [], "extra": 1}, monkeypatch)
    assert found == ["planted.py.j2: passed 'extra', declared by no template it renders"]


COND = GOOD.replace("-#}", "    tail: str, when split — only a split plan's\n-#}").replace("N = ", "{{ tail }}\nN = ")


def test_a_conditional_name_follows_its_flag(monkeypatch):
    base = {"kernel": None, "rows": []}
    assert errors(COND, {**base, "split": True, "tail": ""}, monkeypatch) == [
        "planted.py.j2: passed 'split', declared by no template it renders"]  # the flag itself is no input here
    assert errors(COND, base, monkeypatch) == []
    assert errors(COND, {**base, "tail": ""}, monkeypatch) == ["planted.py.j2: passed 'tail' although split is false"]


def test_a_conditional_name_missing_when_due_is_caught(monkeypatch):
    source = COND.replace("-#}", "    split: bool — the flag\n-#}") + "{{ split }}\n"
    assert errors(source, {"kernel": None, "rows": [], "split": True}, monkeypatch) == [
        "planted.py.j2: declares 'tail', not passed (split is true)"]
    assert errors(source, {"kernel": None, "rows": [], "split": False}, monkeypatch) == []


def test_a_header_without_receives_is_refused():
    with pytest.raises(ValueError, match="Receives"):
        contract.declared_in("{#- no section -#}\n{{ x }}\n")
    with pytest.raises(ValueError, match="twice"):
        contract.declared_in("{#-\n Receives:\n    a: int — one\n    a: int — two\n-#}\n")
