"""Checkpoint tiers: CRC-32 manifests (and old SHA-256 ones), the backup tier (copy, verify,
retention, quarantine, a full target), resume across tiers, `rankguard checkpoints` on both
tiers, and, on real torchrun, an exact resume from the backup with the disk tier deleted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from builders import small_tmpfs
from harness import read_json, run_ok, torchrun
from typer.testing import CliRunner

from rankguard.cli.checkpoints import app
from rankguard.client import checkpoint_store as cs
from rankguard.client.checkpoints import CheckpointStore

KEY = b"k" * 32


def make_ckpt(root: Path, step: int, *, key: bytes | None = None, size: int = 64 * 1024) -> Path:
    """A checkpoint through the trainer's write path (per-rank hash_file, commit), with the
    checksum the trainer picks for this key."""
    partial = cs.partial_dir(root, step)
    entries = []
    for name, n in ((".metadata", 64), ("__0_0.distcp", size), ("__1_0.distcp", size)):
        (partial / name).write_bytes(os.urandom(n))
        entries.append(cs.hash_file(partial / name, algorithm=cs.checksum_for(key)))
    return cs.commit(partial, step, 2, entries, {"loss": 1.0}, key=key)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def all_files(root: Path) -> set[str]:
    """Every data file under root, quarantine included (so 'nothing deleted' can be checked)."""
    return {p.name + "@" + p.parent.name.split(".")[0] for p in root.rglob("*.distcp")}


# --------------------------------------------------------------------------- checksums


def test_crc32_manifest_without_key_catches_a_flipped_byte(tmp_path):
    final = make_ckpt(tmp_path, 10)
    doc = json.loads((final / "manifest.json").read_text())
    assert all("crc32" in f and "sha256" not in f for f in doc["files"])
    assert cs.inspect(final).state == cs.VALIDATED
    flip_byte(final / "__1_0.distcp")
    st = cs.inspect(final)
    assert st.state == cs.CORRUPT and "crc32 mismatch" in st.reason


def test_old_sha256_manifest_still_verifies_and_a_keyed_one_stays_sha256(tmp_path):
    old = make_ckpt(tmp_path / "old", 10, key=None)
    # rewrite as an old manifest would be: sha256 only
    doc = json.loads((old / "manifest.json").read_text())
    for f in doc["files"]:
        f.pop("crc32")
        f["sha256"] = cs.hash_file(old / f["path"], fsync=False).sha256
    (old / "manifest.json").write_text(json.dumps(doc))
    assert cs.inspect(old).state == cs.VALIDATED
    flip_byte(old / "__0_0.distcp")
    assert "sha256 mismatch" in cs.inspect(old).reason

    keyed = make_ckpt(tmp_path / "keyed", 10, key=KEY)
    doc = json.loads((keyed / "manifest.json").read_text())
    assert doc["hmac"] and all("sha256" in f and "crc32" not in f for f in doc["files"])
    assert cs.inspect(keyed, key=KEY).state == cs.VALIDATED
    # a CRC-32 entry can never be signed, nor trusted when a key is in use
    partial = cs.partial_dir(tmp_path / "keyed", 20)
    (partial / "x").write_bytes(b"x" * 10)
    with pytest.raises(cs.CheckpointError, match="SHA-256"):
        cs.commit(partial, 20, 1, [cs.hash_file(partial / "x", algorithm="crc32")], key=KEY)


# --------------------------------------------------------------------------- backup tier


def test_backup_copy_is_verified_kept_by_its_own_retention(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    for step in (10, 20, 30):
        cs.backup_checkpoint(make_ckpt(disk, step), backup, keep=2)
    assert [s.step for s in cs.scan(backup)] == [20, 30]
    assert all(s.state == cs.VALIDATED for s in cs.scan(backup))
    # the copy is byte for byte (the manifest too)
    for name in ("manifest.json", "__0_0.distcp"):
        a = (disk / "step-00000030" / name).read_bytes()
        assert (backup / "step-00000030" / name).read_bytes() == a
    # already backed up: nothing copied again
    assert cs.backup_checkpoint(disk / "step-00000030", backup, keep=2) == backup / "step-00000030"


def test_a_corrupt_source_is_never_backed_up(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    final = make_ckpt(disk, 10)
    flip_byte(final / "__0_0.distcp")
    with pytest.raises(cs.CheckpointError, match="does not match its manifest"):
        cs.backup_checkpoint(final, backup)
    assert cs.scan(backup) == []  # no validated copy, and no leftover partial either
    assert not list(backup.glob("step-*"))


def test_resume_candidates_newest_first_fastest_tier_first(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    for step in (10, 20):
        cs.backup_checkpoint(make_ckpt(disk, step), backup)
    make_ckpt(disk, 30)
    got = [(c.step, c.tier) for c in cs.resume_candidates([("disk", disk), ("backup", backup)])]
    assert got == [(30, "disk"), (20, "disk"), (20, "backup"), (10, "disk"), (10, "backup")]
    tier0 = cs.Candidate(30, "memory", 0, Path("/dev/shm/x"))
    got = cs.resume_candidates([("disk", disk), ("backup", backup)], extra=[tier0])
    assert (got[0].tier, got[1].tier) == ("memory", "disk")
    # a lost tier holds nothing
    assert cs.resume_candidates([("disk", tmp_path / "gone"), ("backup", backup)])[0].step == 20


def test_disk_lost_resumes_from_backup_corrupt_copy_refused_nothing_deleted(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    for step in (10, 20, 30):
        cs.backup_checkpoint(make_ckpt(disk, step), backup)
    tiers = [("disk", disk), ("backup", backup)]
    found, moved = cs.select_resume_tiers(tiers)
    assert found[0] == "disk" and found[1].step == 30 and not moved

    flip_byte(disk / "step-00000030" / "__1_0.distcp")  # disk 30 corrupt: backup 30 is next
    found, moved = cs.select_resume_tiers(tiers)
    assert (found[0], found[1].step) == ("backup", 30)
    assert [m.original_state for m in moved] == [cs.CORRUPT]

    shutil.rmtree(disk)  # disk tier lost
    flip_byte(backup / "step-00000030" / "__0_0.distcp")  # and the backup's 30 corrupt
    before = all_files(backup)
    found, moved = cs.select_resume_tiers(tiers)
    assert (found[0], found[1].step) == ("backup", 20)
    assert moved[0].path.parent == backup / "quarantine" and "crc32 mismatch" in moved[0].reason
    assert all_files(backup) == before  # quarantined, never deleted


def test_a_copy_that_reads_back_wrong_is_quarantined_never_validated(tmp_path, monkeypatch):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    final = make_ckpt(disk, 10)
    real = cs.backup._copy_one

    def bad_target(src_fd, part_fd, entry, chunk):  # the target flips a bit after the write
        real(src_fd, part_fd, entry, chunk)
        if entry.path == "__1_0.distcp":
            fd = os.open(entry.path, os.O_RDWR, dir_fd=part_fd)
            os.pwrite(fd, bytes([os.pread(fd, 1, 100)[0] ^ 0xFF]), 100)  # always a change
            os.close(fd)

    monkeypatch.setattr(cs.backup, "_copy_one", bad_target)
    with pytest.raises(cs.CheckpointError, match="backup copy of step-00000010 is wrong"):
        cs.backup_checkpoint(final, backup)
    assert [(s.state, s.original_state) for s in cs.scan(backup)] == [(cs.QUARANTINED, cs.CORRUPT)]


def test_client_store_backs_up_and_resumes_from_backup_when_disk_is_gone(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    store = CheckpointStore(disk, backup=backup, backup_keep=2, world_size=1)
    for step in (1, 2, 3):
        assert store.save(step, {"w": [step] * 1000, "step": step}) is not None
    assert store.close(timeout=30)
    status = store.backup_status()
    assert status["copies_failed"] == 0 and status["newest_backed_up"] == 3
    # a save made while a copy runs replaces the one waiting: the newest always gets copied
    assert status["copies_ok"] + status["copies_skipped"] == 3
    kept = [s.step for s in cs.scan(backup)]
    assert kept[-1] == 3 and len(kept) <= 2
    shutil.rmtree(disk)
    again = CheckpointStore(disk, backup=backup, world_size=1)
    step, state = again.resume()
    assert step == 3 and state["w"] == [3] * 1000
    with pytest.raises(cs.CheckpointError, match="outside"):
        CheckpointStore(disk, backup=disk / "sub")


@pytest.fixture
def tiny_fs(tmp_path):
    """A 512 KiB tmpfs of our own: a backup target that is full at once."""
    with small_tmpfs(tmp_path / "tinyfs", "512k") as mnt:
        yield mnt


def test_full_backup_target_is_counted_and_leaves_no_copy(tmp_path, tiny_fs):
    disk = tmp_path / "disk"
    worker = cs.BackupWorker(tiny_fs / "b", keep=2, status_path=disk / cs.BACKUP_STATUS_NAME)
    worker.submit(make_ckpt(disk, 10, size=400 * 1024))  # 800 KiB: cannot fit
    assert worker.close(timeout=30)
    st = cs.read_backup_status(disk)
    assert st["failing"] and st["copies_failed"] == 1 and st["copies_ok"] == 0
    assert "No space left" in st["last_error"]
    assert cs.scan(tiny_fs / "b") == []  # nothing validated, and the partial copy removed
    r = CliRunner().invoke(app, ["list", str(disk)])
    assert r.exit_code == 0 and "BACKUP FAILING" in r.stdout, r.output


# --------------------------------------------------------------------------- CLI


def test_cli_lists_both_tiers_and_falls_back_to_backup(tmp_path):
    disk, backup = tmp_path / "disk", tmp_path / "backup"
    for step in (10, 20):
        cs.backup_checkpoint(make_ckpt(disk, step), backup)
    runner = CliRunner()
    r = runner.invoke(app, ["verify", str(disk), "--backup", str(backup), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [t["tier"] for t in doc["tiers"]] == ["disk", "backup"]
    assert doc["tiers"][1]["newest_validated"] == 20
    shutil.rmtree(disk)  # disk tier lost: degraded, the backup still resumes
    r = runner.invoke(app, ["list", str(disk), "--backup", str(backup)])
    assert r.exit_code == 1 and "a resume uses backup step 20" in r.stdout, r.output
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["list", str(disk)])  # no backup known: unhealthy as before
    assert r.exit_code == 2 and "does not exist" in r.stderr


# --------------------------------------------------------------------------- torchrun


@pytest.mark.slow
def test_exact_resume_from_backup_with_disk_tier_deleted(tmp_path, clean_40):
    ckpt, backup = tmp_path / "ckpt", tmp_path / "backup"
    proc = torchrun(
        ["--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "10",
         "--ckpt-backup", str(backup), "--fault", "crash:step=27:rank=1",
         # idle time after step 20 (tiny steps take milliseconds), so the low-priority save
         # and backup of step 20 finish before the kill on a loaded machine too
         "--fault", "comm-delay:step=21:seconds=0.3"],
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0  # killed mid-way, no restart
    assert {s.step for s in cs.scan(backup) if s.state == cs.VALIDATED} == {10, 20}
    shutil.rmtree(ckpt)  # tier 1 lost
    flip_byte(backup / "step-00000020" / "__0_0.distcp")  # and the newest backup corrupt
    run_ok(
        ["--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "10",
         "--ckpt-backup", str(backup), "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["resumed_from"] == 10 and s["resumed_tier"] == "backup"
    assert s["final_step"] == 40 and s["param_digest"] == clean_40["param_digest"]
    assert s["backup"]["copies_ok"] >= 1 and s["backup"]["copies_failed"] == 0
    quarantined = [x for x in cs.scan(backup) if x.state == cs.QUARANTINED]
    assert [(q.step, q.original_state) for q in quarantined] == [(20, cs.CORRUPT)]


@pytest.mark.slow
def test_full_backup_target_training_completes_nothing_bad_validated(tmp_path, tiny_fs):
    ckpt = tmp_path / "ckpt"
    run_ok(
        ["--steps", "30", "--ckpt-dir", str(ckpt), "--ckpt-every", "10",
         "--ckpt-backup", str(tiny_fs / "b"), "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert s["final_step"] == 30 and s["checkpoint_failures"] == 0
    assert s["newest_validated_checkpoint"] == 30  # tier 1 unaffected
    assert s["backup"]["copies_ok"] == 0 and s["backup"]["copies_failed"] >= 1
    assert "No space left" in s["backup"]["last_error"]
    status = cs.read_backup_status(ckpt)
    assert status["failing"] and status["consecutive_failures"] >= 1
    assert not [x for x in cs.scan(tiny_fs / "b") if x.state == cs.VALIDATED]


def test_agent_backup_collector_surfaces_the_status_file(tmp_path):
    from rankguard.agent.collectors import CollectorContext
    from rankguard.agent.collectors.backup import BackupCollector

    disk = tmp_path / "disk"
    disk.mkdir()
    collector = BackupCollector(CollectorContext(watch_dirs={"checkpoint": disk}))

    def values():
        return {m.name: m.samples[0][1] for m in collector.collect().metrics}

    assert values() == {"rankguard_checkpoint_backup_failing": 0}  # no backup tier yet
    # a real failing worker's file: the target is a file, so every copy fails
    (tmp_path / "not-a-dir").write_text("")
    worker = cs.BackupWorker(tmp_path / "not-a-dir" / "b", status_path=disk / cs.BACKUP_STATUS_NAME)
    worker.submit(make_ckpt(disk, 10))
    assert worker.close(timeout=30)
    got = values()
    assert got["rankguard_checkpoint_backup_failing"] == 1
    assert got["rankguard_checkpoint_backup_copies_failed_total"] == 1
    assert got["rankguard_checkpoint_backup_copies_total"] == 0
    (disk / cs.BACKUP_STATUS_NAME).write_text('{"format": "rankguard-backup-status"}')
    with pytest.raises(ValueError, match="copies_ok must be"):
        collector.collect()


def test_backup_options_are_validated(tmp_path):
    from rankguard.trainer.config import ConfigError, config_from_args

    cfg = config_from_args(["--ckpt-dir", "c", "--ckpt-backup", "b", "--backup-keep", "5"], {})
    assert (cfg.ckpt.backup, cfg.ckpt.backup_keep) == (Path("b"), 5)
    for argv, msg in ((["--ckpt-backup", "b"], "needs --ckpt-dir"),
                      (["--ckpt-dir", "c", "--ckpt-backup", "c/b"], "outside"),
                      (["--ckpt-dir", "c/d", "--ckpt-backup", "c"], "outside")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            config_from_args(argv, {})


@pytest.mark.slow
def test_process_writer_validates_and_resumes_exactly(tmp_path, clean_40):
    ckpt = tmp_path / "ckpt"
    proc = torchrun(
        ["--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--ckpt-writer",
         "process", "--fault", "crash:step=27:rank=1",
         "--fault", "comm-delay:step=21:seconds=0.5"],  # time for the save of step 20
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert {s.step for s in cs.scan(ckpt) if s.state == cs.VALIDATED} == {10, 20}
    run_ok(
        ["--steps", "40", "--ckpt-dir", str(ckpt), "--ckpt-every", "10", "--ckpt-writer",
         "process", "--summary", str(tmp_path / "s.json")],
        cwd=tmp_path,
    )  # fmt: skip
    s = read_json(tmp_path / "s.json")
    assert (s["resumed_from"], s["resumed_tier"]) == (20, "disk")
    assert s["param_digest"] == clean_40["param_digest"] and s["checkpoint_failures"] == 0
    assert {x.step for x in cs.scan(ckpt) if x.state == cs.VALIDATED} == {20, 30, 40}
