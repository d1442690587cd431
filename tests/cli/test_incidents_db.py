"""`rankguard incidents --db` on a finished run's database: lists what happened and leaves
the file exactly as it was (issue 17: a supervisor opened on it used to append)."""

from __future__ import annotations

import hashlib
import json

from typer.testing import CliRunner

from rankguard.cli.main import app
from rankguard.supervisor.model import Finding
from rankguard.supervisor.store import IncidentStore


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
    assert "fault to first step 4.00s" in r.stdout
    r = runner.invoke(app, ["incidents", "--db", str(db), "--json"])
    assert [i["kind"] for i in json.loads(r.stdout)["incidents"]] == ["rank_dead"]

    assert digest(db) == before  # not a byte changed
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # and nothing left beside it
