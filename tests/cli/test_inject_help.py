"""`rankguard inject --help` lists the fault kinds from the grammar's table
(contract/faults.py KINDS), not from a list written beside it."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from rankguard.cli.main import build
from rankguard.contract import faults as grammar

app = build()


def inject_help() -> str:
    # a wide terminal: a kind's name is never broken across lines
    r = CliRunner().invoke(app, ["inject", "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return r.output


def test_every_fault_kind_is_in_inject_help():
    text = inject_help()
    listed = set(re.findall(r"[a-z][a-z-]*[a-z]", text))
    assert set(grammar.KINDS) <= listed, sorted(set(grammar.KINDS) - listed)


def test_each_trainer_kind_is_said_to_go_through_the_fault_file_and_keys_name_their_kinds():
    text = " ".join(inject_help().split())
    trainer = [k.name for k in grammar.KINDS.values() if grammar.PROCESS not in k.by
               and grammar.TRAINER in k.by]  # fmt: skip
    assert f"{', '.join(trainer)}: written to the job's fault file" in text
    for key in ("factor", "seconds"):
        for kind in (k.name for k in grammar.KINDS.values() if key in k.keys):
            assert re.search(rf"the {key}= of [^│]*\b{re.escape(kind)}\b", text), (key, kind)
