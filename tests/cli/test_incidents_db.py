"""`rankguard incidents --db` on a finished run's database: lists what happened and leaves
the file exactly as it was (issue 17: a supervisor opened on it used to append)."""

from __future__ import annotations

import hashlib
import json

from typer.testing import CliRunner

from rankguard.cli.main import build
from rankguard.supervisor.model import Finding
from rankguard.supervisor.store import IncidentStore

app = build()


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_incidents_db_lists_and_leaves_the_file_unchanged(tmp_path):
    db = tmp_path / "rankguard.db"
    store = IncidentStore(db)
    finding = Finding("rank_dead", "run:1:dead", "critical", "rank 1 exited", job="run", rank=1,
                      occurred_at=1000.0)  # fmt: skip
    inc, _ = store.upsert_finding(finding, now=1000.5)
    store.set_state(inc.id, "resolved", 1004.0, first_step_at=1004.0)
    store.close()
    before = digest(db)
    files = sorted(p.name for p in tmp_path.iterdir())

    runner = CliRunner()
    r = runner.invoke(app, ["incidents", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "rank_dead job=run rank=1" in r.stdout and "rank 1 exited" in r.stdout
    # the live view's timeline: offsets from the fault
    assert "+  0.5s detected  +  4.0s first step  +  4.0s resolved" in r.stdout, r.stdout
    r = runner.invoke(app, ["incidents", "--db", str(db), "--json"])
    assert [i["kind"] for i in json.loads(r.stdout)["incidents"]] == ["rank_dead"]

    assert digest(db) == before  # not a byte changed
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # and nothing left beside it


def test_the_timeline_says_who_acted_and_why_and_an_empty_one_says_so(tmp_path):
    db = tmp_path / "rankguard.db"
    runner = CliRunner()
    with IncidentStore(db):
        pass
    r = runner.invoke(app, ["incidents", "--db", str(db)])
    assert r.exit_code == 0 and r.stdout.strip() == "no incidents recorded", r.output
    with IncidentStore(db) as store:
        dead = Finding("rank_dead", "run:1:dead", "critical", "rank 1 exited", job="run",
                       rank=1, occurred_at=1000.0, evidence={"exit_code": 1 << 8})  # fmt: skip
        inc, _ = store.upsert_finding(dead, now=1000.5)
        store.set_state(inc.id, "resolved", 1004.0, restarted_at=1002.0, first_step_at=1004.0)
        hung = Finding("rank_hung", "run:0:hung", "critical", "rank 0 hung", job="run", rank=0,
                       occurred_at=2000.0, evidence={"decided_by": "stopped"})  # fmt: skip
        inc, _ = store.upsert_finding(hung, now=2000.5)
        store.set_state(inc.id, "acting", 2001.0, action="kill_rank")
        disk = Finding("node_fault", "n0:disk", "warning", "disk low", node="n0",
                       evidence={"code": "checkpoint_disk_low"})  # fmt: skip
        store.upsert_finding(disk, now=3000.0)
    out = runner.invoke(app, ["incidents", "--db", str(db)]).stdout
    assert "[resolved] torchrun restarted the group" in out, out
    assert "[acting] rankguard killed rank 0" in out, out
    assert "[open] reported, nothing done" in out, out
    assert "cause: user_code (medium confidence): the process exited with code 1" in out, out
    table = runner.invoke(app, ["incidents", "--db", str(db), "--by-cause"]).stdout
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    assert rows["user_code"][:2] == ["1", "33.3%"] and rows["host"][:2] == ["1", "33.3%"], table
    assert rows["storage"][0] == "1" and rows["user_code"][2] == "4.0", table  # lost seconds
    by_json = json.loads(runner.invoke(app, ["incidents", "--db", str(db), "--by-cause",
                                             "--json"]).stdout)  # fmt: skip
    assert {c["cause"] for c in by_json["causes"]} >= {"gpu", "unknown", "user_code"}
