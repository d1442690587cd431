"""The zero-code collective watch (client/collective_watch.py) and the bootstrap folder
that starts it in torchrun workers (client/bootstrap): when it sends a wavefront, what it
sends, and that the bootstrap runs in workers only, imports nothing at start-up and still
runs the sitecustomize it shadows."""

from __future__ import annotations

import os
import subprocess
import sys

from rankguard.client import bootstrap, collective_watch
from rankguard.client.collective_watch import REPEAT_SECONDS, STILL_SECONDS, CollectiveWatch
from rankguard.contract.telemetry import Collective, TelemetryRecord

FRONT = (Collective("0", "default_pg", 13, 12, "gloo:all_reduce", "[[4]]", 1800.0),)


class Recorder:
    """The flight recorder as the watch reads it: a status that moves or holds."""

    def __init__(self):
        self.status, self.reads = ["ids 1"], 0

    def read_status(self):
        return self.status

    def read(self):
        self.reads += 1
        return self.status, FRONT


def test_the_wavefront_is_sent_once_collectives_stand_still_then_again_when_it_repeats():
    rec = Recorder()
    watch = CollectiveWatch(rec.read_status, rec.read)
    assert watch.look(0.0) is None  # first look: nothing to compare with
    assert watch.look(STILL_SECONDS - 0.1) is None  # still, not for long enough
    assert watch.look(STILL_SECONDS) == FRONT
    assert watch.look(STILL_SECONDS + 1) is None  # sent: not again at once
    assert watch.look(STILL_SECONDS + REPEAT_SECONDS) == FRONT  # ... but to keep it fresh
    rec.status = ["ids 2"]  # collectives moved: the stall is over, its evidence taken back
    assert watch.look(20.0) == ()
    assert watch.look(20.1) is None and watch.look(20.0 + STILL_SECONDS - 0.1) is None
    assert rec.reads == 2  # the whole dump is read only to send it


def test_without_a_process_group_nothing_is_read_or_sent():
    rec = Recorder()
    rec.status = None
    watch = CollectiveWatch(rec.read_status, rec.read)
    assert all(watch.look(t) is None for t in (0.0, 5.0, 50.0)) and rec.reads == 0


def test_the_evidence_record_is_a_valid_record_that_is_no_progress():
    env = {"TORCHELASTIC_RUN_ID": "run-1", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
           "TORCHELASTIC_RESTART_COUNT": "2"}  # fmt: skip
    rec = TelemetryRecord.from_dict(collective_watch.evidence_record(env, FRONT))
    assert (rec.job, rec.rank, rec.local_rank, rec.world_size, rec.restart) == ("run-1", 3, 1, 4, 2)
    assert rec.progress is False and rec.collectives == FRONT and rec.pid == os.getpid()


def test_the_bootstrap_folder_goes_first_on_the_path_once():
    env = {"PYTHONPATH": f"/a{os.pathsep}{bootstrap.FOLDER}"}
    bootstrap.put_on_path(env)
    bootstrap.put_on_path(env)
    assert env["PYTHONPATH"] == os.pathsep.join([bootstrap.FOLDER, "/a"])
    empty: dict[str, str] = {}
    bootstrap.put_on_path(empty)
    assert empty["PYTHONPATH"] == bootstrap.FOLDER


PROBE = """
import sys, threading
names = [t.name for t in threading.enumerate()]
print("watch" if "rankguard-collectives" in names else "no watch")
print("client imported" if "rankguard.client" in sys.modules else "nothing imported")
"""


def _probe(tmp_path, **env):
    theirs = tmp_path / "theirs"
    theirs.mkdir(exist_ok=True)
    (theirs / "sitecustomize.py").write_text("print('their sitecustomize ran')\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    path = os.pathsep.join([bootstrap.FOLDER, str(theirs)])
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": path, **env}, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")


def test_the_bootstrap_starts_the_watch_in_a_torchrun_worker_only(tmp_path):
    worker = {"RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r"}
    assert _probe(tmp_path, **worker)[:3] == [
        "their sitecustomize ran",
        "watch",
        "nothing imported",
    ]
    assert _probe(tmp_path)[:2] == ["their sitecustomize ran", "no watch"]  # the launcher
    off = {**worker, "RANKGUARD_COLLECTIVE_WATCH": "0"}
    assert _probe(tmp_path, **off)[1] == "no watch"
