"""A checkpoint filesystem that fills up mid-run: training goes on, nothing bogus is
validated, and saves validate again once space is freed (a real tmpfs, real torchrun).
Under `rankguard up`, an incident names the full filesystem, and the agent's real metrics
make the CheckpointFilesystemFull alert fire naming it (promtool evaluates the rules)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from builders import small_tmpfs
from harness import http_json, read_json, trainer_command, wait_until
from prometheus_client.parser import text_string_to_metric_families
from prometheus_harness import prometheus_bin

from rankguard.dashboards import build, yamlout
from rankguard.dashboards.rules import alerting_rules, runbook_url

pytestmark = pytest.mark.slow


@pytest.fixture
def small_fs(tmp_path):
    """A 32 MiB tmpfs of our own: filling it touches nothing else."""
    with small_tmpfs(tmp_path / "ckfs", "32m") as mnt:
        yield mnt


def fill(directory: Path) -> Path:
    """Write a file until the filesystem says ENOSPC; returns it."""
    filler = directory / "filler"
    chunk = b"\0" * (256 * 1024)
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left to flush at close
        try:
            while True:
                f.write(chunk)  # a partial write first, then ENOSPC
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def killed_at_exit(proc: subprocess.Popen):
    """The launcher started in a session of its own, and its whole tree killed if it is
    still running when the block ends."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def failed_saves(log: Path) -> int:
    """The saves the trainer's log says were not committed or were skipped."""
    text = log.read_text()
    return text.count("not committed") + text.count("skipped")


def space_returns(proc: subprocess.Popen, filler: Path, log: Path, timeout: float, output) -> None:
    """Once two saves failed and the trainer is still training (`output()`: what to show
    if it is not), free the space and wait `timeout` for the run to end."""
    wait_for(lambda: failed_saves(log) >= 2 or proc.poll() is not None, 60, "two failed saves")
    assert proc.poll() is None, output()  # still training
    print(
        "space returns; the trainer's log last named step",
        re.findall(r"step (\d+)", log.read_text())[-1:],
    )
    filler.unlink()  # space returns
    proc.wait(timeout=timeout)


def verify(root: Path) -> dict:
    report = subprocess.run(
        [sys.executable, "-m", "rankguard.cli.main", "checkpoints", "verify", "--json", str(root)],
        capture_output=True, text=True,
    )  # fmt: skip
    doc = json.loads(report.stdout)
    assert report.returncode == 0, doc
    return doc


def test_full_checkpoint_disk_mid_run_training_completes_and_saves_resume(tmp_path, small_fs):
    root, log = small_fs / "ckpt", tmp_path / "train.log"
    cmd, env = trainer_command(
        ["--steps", "400", "--ckpt-dir", str(root), "--ckpt-every", "10", "--keep", "3",
         "--summary", str(tmp_path / "s.json")],
    )  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    with killed_at_exit(proc):
        wait_for(lambda: (root / "step-00000020").is_dir(), 120, "step 20 validated")
        space_returns(proc, fill(small_fs), log, 180, lambda: log.read_text()[-4000:])
    assert proc.returncode == 0, log.read_text()[-4000:]
    s = read_json(tmp_path / "s.json")
    assert s["final_step"] == 400 and s["checkpoint_failures"] >= 1
    assert s["newest_validated_checkpoint"] == 400  # saves validate again by themselves
    doc = verify(root)
    bogus = [c for c in doc["checkpoints"] if c["state"] in ("incomplete", "corrupt")]
    assert not bogus, bogus  # failed saves were quarantined once a later step committed
    assert any(c["state"] == "quarantined" for c in doc["checkpoints"]), doc


def scrape(agent_url: str, names: set[str]) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(agent_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name in names]  # fmt: skip


def alerts_fired_on(samples, instance: str, tmp_path: Path, alert: str, labels: dict) -> str:
    """Feed scraped samples (held for 10 minutes, as Prometheus would see a full disk
    stay full) into the generated rules with `promtool test rules`, expecting `alert` to
    fire with `labels`; returns promtool's output (it fails the test otherwise)."""
    files = build.render_all()
    build.write(tmp_path, files)
    target = {"job": "rankguard-agent", "instance": instance}
    series = [{"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in
                                                sorted({**lbls, **target}.items())) + "}",
               "values": f"{value}x10"} for name, lbls, value in samples]  # fmt: skip
    rule = next(a for a in alerting_rules() if a.name == alert)
    summary = (f"Checkpoint filesystem {labels['mountpoint']} on node {labels['node']} is "
               "0% free")  # fmt: skip
    test = {"rule_files": ["rankguard-rules.yml"], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
                {"eval_time": "5m", "alertname": alert, "exp_alerts": [
                    {"exp_labels": {"severity": rule.severity, **target, **labels},
                     "exp_annotations": {"summary": summary,
                                         "description": rule.description,
                                         "runbook_url": runbook_url(alert)}}]}]}]}  # fmt: skip
    (tmp_path / "prometheus" / "full.test.yml").write_text(yamlout.dump(test))
    proc = subprocess.run([prometheus_bin("promtool"), "test", "rules", "full.test.yml"],
                          cwd=tmp_path / "prometheus", capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# Enough steps to be still training once the disk is full, the incident is in and two saves
# failed (before step 100 here), and to save again after.
STEPS = 800


def test_up_names_the_full_checkpoint_filesystem_and_training_completes(tmp_path, small_fs):
    run, root = tmp_path / "run", small_fs / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rankguard.cli.main", "up", "--steps", str(STEPS), "--ckpt-every", "10",
         "--ckpt-dir", str(root), "--run-dir", str(run), "--trainer-arg=--d-model=64",
         "--trainer-arg=--n-layer=2", "--trainer-arg=--n-head=2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    with killed_at_exit(proc):
        urls = wait_until(
            lambda: re.search(r"agent (http://\S+) \| supervisor (http://\S+)", "".join(lines)),
            60, "up's first line",
        )  # fmt: skip
        agent_url, sup_url = urls.group(1), urls.group(2)
        wait_for(lambda: (root / "step-00000020").is_dir(), 120, "step 20 validated")
        filler = fill(small_fs)

        def full_disk_incident():
            return next((i for i in http_json(sup_url + "/v1/incidents")["incidents"]
                         if i["kind"] == "node_fault" and "no space left" in i["summary"]), None)  # fmt: skip

        incident = wait_until(full_disk_incident, 30, "an incident naming the full filesystem")
        samples = scrape(agent_url, {"rankguard_filesystem_free_ratio", "rankguard_filesystem_info",
                                     "rankguard_agent_info"})  # fmt: skip
        space_returns(proc, filler, run / "trainer.log", 300, lambda: "".join(lines)[-3000:])
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-4000:]
    assert f"training completed: step {STEPS}" in out
    assert str(small_fs) in incident["summary"] and "(tmpfs)" in incident["summary"]
    assert incident["severity"] == "critical" and incident["action"] == "none"
    assert incident["cause"] == "storage", incident
    with sqlite3.connect(run / "rankguard.db") as db:
        state, kinds = (
            db.execute("SELECT state FROM incidents WHERE id = ?", (incident["id"],)).fetchone()[0],
            [k for (k,) in db.execute("SELECT kind FROM incidents")],
        )
    assert state == "resolved"  # space came back
    assert not {"rank_dead", "rank_hung", "crash_loop"} & set(kinds), kinds  # no rank lost
    s = read_json(run / "summary.json")
    assert s["checkpoint_failures"] >= 1
    assert s["newest_validated_checkpoint"] == STEPS  # saves validate again by themselves
    doc = verify(root)
    bogus = [c for c in doc["checkpoints"] if c["state"] in ("incomplete", "corrupt")]
    assert not bogus, bogus
    # the alert, evaluated by promtool over the agent's own series while the disk was full
    ratios = [v for name, lbls, v in samples
              if name == "rankguard_filesystem_free_ratio" and lbls["role"] == "checkpoint"]  # fmt: skip
    assert ratios == [0.0], samples  # full, as the kernel said
    instance = agent_url.removeprefix("http://")
    node = next(lbls["node"] for name, lbls, _ in samples if name == "rankguard_agent_info")
    fired = alerts_fired_on(samples, instance, tmp_path, "CheckpointFilesystemFull",
                            {"node": node, "role": "checkpoint", "mountpoint": str(small_fs),
                             "fstype": "tmpfs", "path": str(root)})  # fmt: skip
    assert "SUCCESS" in fired


def test_incarnation_numbers_keep_growing_on_a_full_disk(small_fs):
    """A restart while the disk is full still claims a new incarnation number (its file
    is rewritten in place): falling back to torchrun's restart count could reuse an
    earlier incarnation's number, and with it the keys of that incarnation's incidents."""
    from rankguard.client.checkpoint_store import claim_incarnation

    root = small_fs / "ckpt"
    assert claim_incarnation(root) == 0
    fill(small_fs)
    with pytest.raises(OSError) as full:
        (root / "probe").write_bytes(b"1")  # what the atomic write would need
    assert full.value.errno == errno.ENOSPC
    assert [claim_incarnation(root) for _ in range(3)] == [1, 2, 3]
    assert (root / "incarnation").read_text() == "4\n"
    assert not (root / "incarnation.tmp").exists()
