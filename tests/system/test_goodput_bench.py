"""bench/goodput.py --quick end to end for plain torchrun and rankguard: every fault of the
schedule reaches the timeline and the accounting adds up (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "goodput.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("goodput")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--stacks", "plain,rankguard",
         "--json", str(out / "g.json"), "--out", str(out / "g.md")],
        capture_output=True, text=True, timeout=900, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**json.loads((out / "g.json").read_text()), "md": (out / "g.md").read_text()}


def test_every_scheduled_fault_is_in_each_stacks_timeline(quick):
    ids = sorted(f["id"] for f in quick["schedule"])
    assert len(ids) == 7
    for r in quick["results"]:
        assert r["not_injected"] == [], r["stack"]
        assert sorted(f["id"] for f in r["faults"]) == ids, r["stack"]
        for f in r["faults"]:
            assert f["kind"] in quick["md"] and f["outcome"]


def test_the_accounting_adds_up(quick):
    for r in quick["results"]:
        assert 0 < r["useful"] <= r["wall"], r["stack"]
        assert 0 < r["goodput"] <= 1
        assert r["executed"] == r["kept"] + r["lost"]
        assert r["useful_steps"] <= r["kept"] <= r["executed"]
        if r["finished"]:
            assert r["kept"] == r["final_step"] == 1000  # the whole history, each step once
        # every step rolled back is one some fault's restart threw away
        assert sum(f["lost"] or 0 for f in r["faults"]) == r["lost"], r["stack"]
        # a fault's window cost cannot exceed the window
        for f in r["faults"]:
            assert f["cost"] <= r["wall"]


def test_rankguard_recovers_what_plain_torchrun_cannot(quick):
    by = {r["stack"]: {f["kind"]: f for f in r["faults"]} for r in quick["results"]}
    for kind in ("spin", "stop"):  # plain torchrun never notices a hang: the bench gives up
        assert by["plain"][kind]["outcome"].startswith("not recovered"), by["plain"][kind]
        assert by["rankguard"][kind]["outcome"].startswith("recovered"), by["rankguard"][kind]
    assert by["plain"]["nan"]["outcome"].startswith("not recovered")
    assert by["rankguard"]["nan"]["outcome"].startswith("recovered")


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "s.toml"
    bad.write_text("seed = 1\n")
    for args in (["--stacks", "nope"], ["--schedule", str(bad)]):
        proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2
        assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("goodput: ")
