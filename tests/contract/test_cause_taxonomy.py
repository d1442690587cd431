"""The cause taxonomy (contract/causes.py) and the runbook's table of it."""

from __future__ import annotations

import re
from pathlib import Path

from rankguard.contract.causes import CAUSE_CLASSES, CAUSES, UNKNOWN


def test_the_runbook_table_is_the_taxonomy():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (.+?) \| (.+?) \|$", doc, re.M)
    assert rows == [(c.name, c.what, c.published) for c in CAUSE_CLASSES]


def test_the_taxonomy_is_closed_and_ends_in_unknown():
    assert len(set(CAUSES)) == len(CAUSES) == 11 and CAUSES[-1] == UNKNOWN
