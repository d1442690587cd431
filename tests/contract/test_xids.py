"""What an XID asks of the node (contract/xids.py), and the runbook's table of it."""

from __future__ import annotations

import re
from pathlib import Path

from rankguard.contract.causes import CAUSES
from rankguard.contract.xids import ACTIONS, DRAIN, RESET_GPU, WATCH, XIDS, hardware_codes, meaning


def test_the_codes_that_take_a_node_away_are_resets_and_drains_only():
    assert meaning(79).action == DRAIN and meaning(48).action == RESET_GPU
    # a row remap recorded and a contained ECC error leave the node in the job
    assert 63 not in hardware_codes() and 94 not in hardware_codes()
    assert set(hardware_codes()) == {c for c, x in XIDS.items() if x.action in (RESET_GPU, DRAIN)}
    assert meaning(31337).action == WATCH  # unknown: a look, not a drain
    assert all(x.action in ACTIONS and x.cause in CAUSES and x.code == c for c, x in XIDS.items())


def test_the_runbook_table_is_the_contracts_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \| `([a-z_]+)` \| `([a-z_]+)` \|$", doc, re.M)
    assert rows == [(str(x.code), x.what, x.action, x.cause) for x in XIDS.values()]
