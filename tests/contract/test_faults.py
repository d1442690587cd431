"""The one fault grammar (contract/faults.py): every spelling it prints parses back to the
same fault, old spellings are named, and each place refuses what does not apply there."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard.contract import faults as g

NUMBER = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def faults(draw) -> g.Fault:
    kind = draw(st.sampled_from(list(g.KINDS)))
    k = g.KINDS[kind]
    if k.by == (g.CHECKPOINT,):
        return g.Fault(kind, at=draw(st.none() | NUMBER))
    when = draw(st.sampled_from(["step", "at", None] if g.TRAINER in k.by else ["at", None]))
    fields = {
        "rank": draw(st.none() | st.integers(0, 10_000)),
        "step": draw(st.integers(0, 10**9)) if when == "step" else None,
        "at": draw(NUMBER) if when == "at" else None,
        "restart": draw(st.none() | st.integers(0, 100)),
    }
    if "factor" in k.keys:  # slow, poison: parse() gives each a default factor
        fields["factor"] = draw(st.floats(min_value=1, max_value=100))
    if "seconds" in k.keys:
        fields["seconds"] = draw(st.floats(min_value=0.001, max_value=3599))
    return g.Fault(kind, **fields)


@given(faults())
def test_every_fault_parses_back_from_its_text(fault):
    assert g.parse(fault.text()) == fault


@given(st.text(max_size=40))
def test_any_text_parses_or_fails_with_one_line(text):
    try:
        g.parse(text)
    except g.FaultError as exc:
        assert "\n" not in str(exc).replace(repr(text), "")


def test_examples_and_old_spellings():
    f = g.parse("kill:rank=1:at=30s")
    assert (f.kind, f.rank, f.at, f.step) == ("kill", 1, 30.0, None)
    assert g.parse("kill:rank=1:at=30") == f
    assert g.parse("slow:rank=1:step=5").factor == g.DEFAULT_FACTOR
    old = g.parse("crash:step=3:rank=1")
    assert old.kind == "kill" and "'crash' is now 'kill'" in old.note


@pytest.mark.parametrize(
    "spec,words",
    [
        ("explode:rank=1", "kinds: kill"),
        ("kill:rank=x", "rank takes a whole number"),
        ("kill:rank=1:at=15m", "at takes a number (seconds"),
        ("kill:rank=1:at=10s:step=3", "not both"),
        ("stop:rank=1:step=3", "from outside the trainer"),
        ("kill:rank=1:color=red", "unknown key 'color'"),
        ("kill:rank=1:rank=2", "given twice"),
        ("kill:1", "expected key=value"),
        ("nan:rank=0:factor=2", "nan takes no factor"),
        ("comm-delay:rank=0:step=1", "needs seconds="),
        ("ckpt-delay:rank=0:step=1:seconds=5000", "0 < seconds < 3600"),
        ("slow:rank=0:step=1:factor=0.5", "factor >= 1"),
        ("corrupt-checkpoint:rank=1", "takes only at="),
    ],
)
def test_malformed_specs_are_named(spec, words):
    with pytest.raises(g.FaultError, match=None) as exc:
        g.parse(spec)
    assert words in str(exc.value) and "\n" not in str(exc.value)


def test_each_place_takes_what_applies_there():
    # up --inject: a rank and a time (or a step, for the bundled trainer)
    with pytest.raises(g.FaultError, match="which rank"):
        g.for_up(g.parse("kill:at=10s"), script=False)
    with pytest.raises(g.FaultError, match="when"):
        g.for_up(g.parse("kill:rank=1"), script=False)
    assert g.for_up(g.parse("corrupt-checkpoint:at=5s"), script=False)
    assert g.for_up(g.parse("stop:rank=1:at=5s"), script=True)
    with pytest.raises(g.FaultError, match="with a script only kill, stop"):
        g.for_up(g.parse("nan:rank=1:at=5s"), script=True)
    # rankguard inject: now, and --rank is never a silent 0
    with pytest.raises(g.FaultError, match="needs --rank"):
        g.for_inject(g.parse("kill"))
    with pytest.raises(g.FaultError, match="acts now"):
        g.for_inject(g.parse("kill:rank=1:at=3s"))
    assert g.for_inject(g.parse("corrupt-checkpoint")).rank is None
    # the trainer: its own kinds, at a step
    with pytest.raises(g.FaultError, match="not done by the trainer"):
        g.for_trainer(g.parse("stop:rank=1"))
    with pytest.raises(g.FaultError, match="step=N"):
        g.for_trainer(g.parse("nan:rank=1"))


def test_docs_faults_md_has_one_row_per_kind():
    """docs/faults.md's "Kinds" table and the KINDS table name the same kinds."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "faults.md").read_text()
    section = doc.split("\n## Kinds\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z-]+)` \|", section, re.M)
    assert sorted(rows) == sorted(g.KINDS), rows
