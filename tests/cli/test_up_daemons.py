"""`rankguard up` keeps its agent and supervisor running: each is SIGKILLed mid-run, `up`
starts it again on the same port with the same database, and a rank killed afterwards is
recorded by the supervisor through the restarted daemon; the job completes (exit 0)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import http_json, wait_until

pytestmark = pytest.mark.slow

SMALL_MODEL = [
    "--trainer-arg=--d-model=64",
    "--trainer-arg=--n-layer=2",
    "--trainer-arg=--n-head=2",
]


def children(pid: int) -> dict[int, str]:
    """Child pid -> command line (NULs as spaces) of a process, read from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except (OSError, ValueError):
            continue
    return out


def daemon_pid(up_pid: int, name: str) -> int | None:
    found = [p for p, cmd in children(up_pid).items() if f"rankguard.cli.main {name} " in cmd]
    return found[0] if len(found) == 1 else None


class Output:
    """The lines a process prints, gathered by a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def ranks(sup_url: str) -> list[dict]:
    try:
        return http_json(sup_url + "/v1/ranks")["ranks"]
    except OSError:
        return []  # the supervisor is being restarted


# long enough for a fault at about step 120 and a restart from the checkpoint before it
STEPS = 400


def test_up_restarts_killed_daemons_and_a_later_rank_death_is_recorded(tmp_path):
    """One run (cold start: the other `up` tests cover warm workers) in which the agent,
    then the supervisor, is SIGKILLed; each comes back, and a rank killed afterwards is
    recorded through both restarted daemons."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", str(STEPS), "--ckpt-every", "20",
         "--run-dir", str(run), *SMALL_MODEL, "--cold-start"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    out = Output(proc)
    try:
        # up prints what a second shell exports to reach this run
        sup_url = wait_until(
            lambda: (m := re.search(r"export RANKGUARD_SUPERVISOR=(http://\S+)", out.text))
            and m.group(1), 60, "up's export line",
        )  # fmt: skip
        wait_until(lambda: min((r.get("step") or 0 for r in ranks(sup_url)), default=0) >= 20,
                   120, "training under way")  # fmt: skip
        for daemon in ("agent", "supervisor"):
            victim = daemon_pid(proc.pid, daemon)
            assert victim is not None, children(proc.pid)
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda d=daemon: f"{d} restarted (1 so far)" in out.text, 60,
                       f"{daemon} restarted")  # fmt: skip
            restarted_at = time.time()
            assert daemon_pid(proc.pid, daemon) not in (None, victim)
            # the restarted daemon sees the ranks training (an agent learns them anew)
            before = {r["rank"]: r.get("step") or 0 for r in ranks(sup_url)}
            live = wait_until(
                lambda b=before: [r for r in ranks(sup_url) if r["state"] == "alive"
                                  and (r.get("step") or 0) > b.get(r["rank"], 0)],
                60, f"ranks training after the {daemon}'s restart",
            )  # fmt: skip
        rank1 = next((r for r in live if r["rank"] == 1), None) or wait_until(
            lambda: next((r for r in ranks(sup_url) if r["rank"] == 1 and r["state"] == "alive"),
                         None), 30, "rank 1 alive")  # fmt: skip
        assert rank1["step"] < STEPS - 40, "training nearly over before the rank could be killed"
        os.kill(rank1["pid"], signal.SIGKILL)
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.text
    print(text)  # the timeline, for a failure or -s
    assert proc.returncode == 0, text[-4000:]
    assert f"training completed: step {STEPS}" in text
    for daemon in ("agent", "supervisor"):
        assert f"rankguard up: {daemon} killed by SIGKILL; restarting it" in text
    assert "rankguard up: restarted during the run: agent 1x, supervisor 1x" in text
    assert not (run / "warm.log").is_file()  # --cold-start: no warm server
    assert f"rankguard incidents --db {run / 'rankguard.db'}" in text
    assert "--supervisor http" not in text  # no URL that dies with `up`
    with sqlite3.connect(run / "rankguard.db") as db:
        dead = db.execute(
            "SELECT rank, detected_at FROM incidents WHERE kind = 'rank_dead'"
        ).fetchall()
    assert [rank for rank, at in dead if at > restarted_at] == [1], dead
    listed = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "incidents", "--db", str(run / "rankguard.db")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert listed.returncode == 0 and "rank_dead" in listed.stdout, listed.stderr


def test_up_warm_start_stopped_stub_is_a_fault_and_up_exits_after_training(tmp_path):
    """The rank runs in a process forked by the warm server; torchrun watches the stub it
    started. A SIGSTOPped stub hid the rank from torchrun, and `up` sat at the last step
    for ever. Now the agent watches the stub, the supervisor kills the rank with its stub,
    torchrun restarts the group, and `up` exits 0 within seconds of the last step."""
    run = tmp_path / "run"
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", str(STEPS),
         "--ckpt-every", "20", "--run-dir", str(run), *SMALL_MODEL],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    out = Output(proc)
    try:
        sup_url = wait_until(
            lambda: (m := re.search(r"supervisor (http://\S+)", out.text)) and m.group(1),
            60, "up's first line",
        )  # fmt: skip
        rank1 = wait_until(
            lambda: next((r for r in ranks(sup_url) if r["rank"] == 1 and (r.get("step") or 0) >= 20
                          and r.get("stand_in")), None), 120, "rank 1 training, its stub known",
        )  # fmt: skip
        stub = rank1["stand_in"]["pid"]
        assert stub != rank1["pid"] and rank1["stand_in"]["state"] == "alive"
        assert rank1["step"] < STEPS - 40, "training nearly over before the stub could be stopped"
        os.kill(stub, signal.SIGSTOP)
        stopped_at = time.time()
        wait_until(lambda: all(r["state"] == "finished" and r["restart"] > rank1["restart"]
                               for r in ranks(sup_url)) and len(ranks(sup_url)) == 2,
                   300, "the restarted job finished")  # fmt: skip
        finished = time.monotonic()
        proc.wait(timeout=60)
        exit_after_training = time.monotonic() - finished
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.text
    print(text)
    print(f"up exited {exit_after_training:.1f}s after training ended; whole run "
          f"{time.monotonic() - started:.0f}s")  # fmt: skip
    assert proc.returncode == 0, text[-4000:]
    assert f"training completed: step {STEPS}" in text
    assert exit_after_training < 20
    with sqlite3.connect(run / "rankguard.db") as db:
        db.row_factory = sqlite3.Row
        hung = db.execute("SELECT * FROM incidents WHERE kind = 'rank_hung'").fetchall()
    assert [(h["rank"], h["action"]) for h in hung] == [(1, "kill_rank")], [dict(h) for h in hung]
    assert ":stand_in:" in hung[0]["key"] and f"pid {stub}" in hung[0]["summary"]
    assert hung[0]["detected_at"] - stopped_at < 10  # the 2 s budget, and a pass or two
    with pytest.raises(ProcessLookupError):
        os.kill(stub, 0)  # the stub was ended, not left stopped
