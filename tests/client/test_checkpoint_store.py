"""The on-disk checkpoint store (client/checkpoint_store/) and `rankguard checkpoints`.

Real files in tmp dirs; fault injection only for the full-disk cases (os.fsync/os.write raising
ENOSPC)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from builders import FAST, flip_byte, json_values, make_ckpt
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from rankguard.cli.checkpoints import app
from rankguard.client import checkpoint_store as cs
from rankguard.client.checkpoint_store import CheckpointError, FileEntry

# --------------------------------------------------------------------------- helpers


def data_files(root: Path) -> dict[str, bytes]:
    """Every checkpoint data file under root (anywhere, quarantine included), by name+content."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and p.name != cs.QUARANTINE_RECORD:
            out[f"{p.parent.name.split('.')[0]}/{p.name}"] = p.read_bytes()
    return out


def by_step(statuses):
    return {s.step: s for s in statuses}


# --------------------------------------------------------------------------- commit, inspect


def test_commit_produces_validated_checkpoint(tmp_path):
    final = make_ckpt(tmp_path, 20)
    assert final == tmp_path / "step-00000020"
    assert not (tmp_path / "step-00000020.partial").exists()
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["format"] == "rankguard-checkpoint" and manifest["format_version"] == 1
    assert manifest["step"] == 20 and manifest["world_size"] == 2
    assert manifest["extra"] == {"loss": 2.5, "tokens": 20000}
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {p.name for p in final.iterdir()} - {"manifest.json"}
    assert listed == on_disk
    st = cs.inspect(final)
    assert (st.state, st.reason, st.step, st.world_size) == ("validated", "", 20, 2)
    assert st.extra["tokens"] == 20000 and st.size_bytes > 2 * 4096
    assert cs.read_manifest(final).step == 20
    assert cs.STEP_DIR_RE.match(final.name) and cs.step_dir_name(7) == "step-00000007"


def test_hash_file_nested_path_and_roundtrip(tmp_path):
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "x.bin"
    f.write_bytes(b"abc")
    e = cs.hash_file(f, base=tmp_path)
    assert e.path == "sub/x.bin" and e.size == 3
    assert e.sha256 == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert FileEntry.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    for bad in ({"path": "../etc", "size": 1, "sha256": e.sha256}, {"path": "a", "size": -1}):
        with pytest.raises(CheckpointError):
            FileEntry.from_dict(bad)


def test_a_large_file_is_crc32d_in_parts_on_several_cores_to_zlibs_value(tmp_path):
    import zlib

    from rankguard.contract import crc

    f = tmp_path / "big.distcp"
    data = os.urandom(1 << 20) * (crc.PARALLEL_MIN >> 20) + os.urandom(12345)
    f.write_bytes(data)
    seen = []
    e = cs.hash_file(f, algorithm="crc32", fsync=False)
    assert e.crc32 == f"{zlib.crc32(data):08x}" and e.size == len(data)
    assert (
        cs.fsio._checksum_file(f, cs.DEFAULT_CHUNK, on_bytes=seen.append, algorithm="crc32")[1]
        == e.crc32
    )
    assert sum(seen) == len(data) and max(seen) <= cs.DEFAULT_CHUNK  # progress, chunk by chunk
    flip_byte(f)
    assert cs.hash_file(f, algorithm="crc32", fsync=False).crc32 != e.crc32


def test_truncated_file_is_corrupt_with_reason(tmp_path):
    final = make_ckpt(tmp_path, 20, size=4096)
    with open(final / "__1_0.distcp", "r+b") as f:
        f.truncate(1200)
    for verify in (False, True):
        st = cs.inspect(final, verify_checksums=verify)
        assert st.state == "corrupt"
        assert "__1_0.distcp: size 1200 != manifest 4096 (truncated)" in st.reason


def test_flipped_byte_fails_checksum_but_passes_size_check(tmp_path):
    final = make_ckpt(tmp_path, 20)
    flip_byte(final / "__0_0.distcp")
    assert cs.inspect(final, verify_checksums=False).state == "validated"
    st = cs.inspect(final, verify_checksums=True)
    assert st.state == "corrupt"
    assert st.reason.startswith("__0_0.distcp: sha256 mismatch")


def test_missing_and_unlisted_files_are_corrupt(tmp_path):
    a = make_ckpt(tmp_path, 10)
    (a / "trainer-state-rank1.pt").unlink()
    st = cs.inspect(a, verify_checksums=False)
    assert st.state == "corrupt" and "trainer-state-rank1.pt: missing" in st.reason
    b = make_ckpt(tmp_path, 20)
    (b / "__2_0.distcp").write_bytes(b"stray")
    st = cs.inspect(b, verify_checksums=False)
    assert st.state == "corrupt" and "__2_0.distcp: not listed in manifest" in st.reason


def test_deleted_manifest_and_partial_are_incomplete(tmp_path):
    final = make_ckpt(tmp_path, 20)
    (final / "manifest.json").unlink()
    st = cs.inspect(final)
    assert st.state == "incomplete" and "manifest.json missing" in st.reason
    partial = cs.partial_dir(tmp_path, 30)
    (partial / "__0_0.distcp").write_bytes(b"x" * 10)
    st = cs.inspect(partial)
    assert (st.state, st.step, st.size_bytes) == ("incomplete", 30, 10)
    assert ".partial" in st.reason


def test_manifest_step_mismatch_is_incomplete(tmp_path):
    final = make_ckpt(tmp_path, 20)
    m = json.loads((final / "manifest.json").read_text())
    m["step"] = 21
    (final / "manifest.json").write_text(json.dumps(m))
    st = cs.inspect(final)
    assert st.state == "incomplete" and "step 21 does not match" in st.reason


def test_commit_refuses_listing_that_does_not_match(tmp_path):
    partial = cs.partial_dir(tmp_path, 5)
    (partial / "a").write_bytes(b"aaaa")
    (partial / "b").write_bytes(b"bb")
    ea = cs.hash_file(partial / "a")
    with pytest.raises(CheckpointError, match="b: not listed"):
        cs.commit(partial, 5, 1, [ea], {})
    ghost = FileEntry("c", 3, ea.sha256)
    with pytest.raises(CheckpointError, match="c: missing"):
        cs.commit(partial, 5, 1, [ea, cs.hash_file(partial / "b"), ghost], {})
    wrong = FileEntry("b", 99, ea.sha256)
    with pytest.raises(CheckpointError, match=r"b: size 2 != manifest 99"):
        cs.commit(partial, 5, 1, [ea, wrong], {})
    with pytest.raises(CheckpointError, match="partial dir of step 6"):
        cs.commit(partial, 6, 1, [ea], {})
    assert partial.is_dir() and not (tmp_path / "step-00000005").exists()
    assert not (partial / "manifest.json").exists()
    assert cs.commit(partial, 5, 1, cs.hash_tree(partial), {}).name == "step-00000005"
    with pytest.raises(CheckpointError, match="already committed"):
        cs.partial_dir(tmp_path, 5)


def test_partial_dir_quarantines_stale_partial(tmp_path):
    stale = cs.partial_dir(tmp_path, 8)
    (stale / "__0_0.distcp").write_bytes(b"old data")
    fresh = cs.partial_dir(tmp_path, 8)
    assert fresh == stale and list(fresh.iterdir()) == []
    [q] = list((tmp_path / "quarantine").iterdir())
    assert q.name.startswith("step-00000008.partial.")
    assert (q / "__0_0.distcp").read_bytes() == b"old data"
    rec = json.loads((q / "QUARANTINE.json").read_text())
    assert rec["state"] == "incomplete" and rec["original"] == "step-00000008.partial"
    assert "quarantined_at" in rec and rec["reason"]


# --------------------------------------------------------------------------- scan


def test_scan_ignores_unrelated_entries_and_missing_root(tmp_path):
    assert cs.scan(tmp_path / "nope") == []
    make_ckpt(tmp_path, 3)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-3").mkdir()  # not canonical: not ours
    (tmp_path / "step-00000004").write_text("a file, not a dir")
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "random").mkdir()
    statuses = cs.scan(tmp_path)
    assert [(s.step, s.state) for s in statuses] == [(3, "validated")]


def test_scan_sorted_with_progress(tmp_path):
    for step in (30, 10, 20):
        make_ckpt(tmp_path, step, size=3000)
    cs.partial_dir(tmp_path, 40)
    calls = []
    statuses = cs.scan(tmp_path, progress=lambda done, total: calls.append((done, total)))
    assert [s.step for s in statuses] == [10, 20, 30, 40]
    assert [s.state for s in statuses] == ["validated"] * 3 + ["incomplete"]
    totals = {t for _, t in calls}
    assert len(totals) == 1
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and dones[-1] == totals.pop()


# --------------------------------------------------------------------------- select_resume


def test_select_resume_falls_back_and_quarantines_without_deleting(tmp_path):
    for step in (10, 20, 30, 40):
        make_ckpt(tmp_path, step)
    flip_byte(tmp_path / "step-00000040" / "__1_0.distcp")  # corrupt (checksum only)
    (tmp_path / "step-00000030" / "manifest.json").unlink()  # incomplete
    partial = cs.partial_dir(tmp_path, 50)
    (partial / "__0_0.distcp").write_bytes(b"half written")
    before = data_files(tmp_path)

    chosen, moved = cs.select_resume(tmp_path)

    assert chosen is not None and chosen.step == 20 and chosen.state == "validated"
    assert chosen.path == tmp_path / "step-00000020"
    assert {(s.step, s.original_state) for s in moved} == {
        (50, "incomplete"),
        (40, "corrupt"),
        (30, "incomplete"),
    }
    for s in moved:
        assert s.state == "quarantined" and s.path.parent == tmp_path / "quarantine"
        rec = json.loads((s.path / "QUARANTINE.json").read_text())
        assert rec["reason"] == s.reason and rec["state"] == s.original_state
    reasons = {s.step: s.reason for s in moved}
    assert "__1_0.distcp: sha256 mismatch" in reasons[40]
    assert "manifest.json missing" in reasons[30]
    assert data_files(tmp_path) == before  # nothing deleted, nothing changed
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "quarantine",
        "step-00000010",
        "step-00000020",
    ]
    # quarantined entries are visible to scan, and a second resume changes nothing
    q = [s for s in cs.scan(tmp_path) if s.state == "quarantined"]
    assert {(s.step, s.original_state) for s in q} == {
        (50, "incomplete"),
        (40, "corrupt"),
        (30, "incomplete"),
    }
    again, moved2 = cs.select_resume(tmp_path)
    assert again.step == 20 and moved2 == []


def test_select_resume_with_nothing_valid(tmp_path):
    assert cs.select_resume(tmp_path / "missing") == (None, [])
    assert cs.select_resume(tmp_path) == (None, [])
    final = make_ckpt(tmp_path, 1)
    with open(final / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    chosen, moved = cs.select_resume(tmp_path)
    assert chosen is None and [s.step for s in moved] == [1]
    assert "truncated" in moved[0].reason


# --------------------------------------------------------------------------- retention


def test_retention_keeps_newest_k(tmp_path):
    for step in (10, 20, 30, 40, 50):
        make_ckpt(tmp_path, step)
    cs.partial_dir(tmp_path, 60)
    assert cs.apply_retention(tmp_path, 0) == []
    removed = cs.apply_retention(tmp_path, 2)
    assert [p.name for p in removed] == ["step-00000030", "step-00000020", "step-00000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000040",
        "step-00000050",
        "step-00000060.partial",
    ]
    assert cs.apply_retention(tmp_path, 2) == []


def test_retention_never_deletes_newest_validated(tmp_path):
    for step in (10, 20, 30, 40):
        make_ckpt(tmp_path, step)
    (tmp_path / "step-00000040" / "manifest.json").unlink()
    with open(tmp_path / "step-00000030" / "__0_0.distcp", "r+b") as f:
        f.truncate(5)
    cs.quarantine(make_ckpt(tmp_path, 5), "test")
    (tmp_path / ".trash-step-00000001.x").mkdir()  # left by a crash mid-delete
    # the newest (40) is not valid: nothing is deleted while the older ones are the good ones
    assert cs.apply_retention(tmp_path, 1) == []
    names = sorted(p.name for p in tmp_path.iterdir())  # the empty trash dir is gone
    assert names == ["quarantine", *(f"step-000000{s}" for s in (10, 20, 30, 40))]
    chosen, _ = cs.select_resume(tmp_path)  # a restart quarantines 40 and 30
    assert chosen.step == 20
    removed = cs.apply_retention(tmp_path, 1)
    assert [p.name for p in removed] == ["step-00000010"]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["quarantine", "step-00000020"]
    assert len(list((tmp_path / "quarantine").iterdir())) == 3


# --------------------------------------------------------------------------- full disk


def _fail_nth(monkeypatch, name: str, n: int) -> list[int]:
    real = getattr(os, name)
    calls = [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == n + 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a, **k)

    monkeypatch.setattr(os, name, flaky)
    return calls


@pytest.mark.parametrize(
    ("name", "n"),
    [("fsync", 0), ("fsync", 1), ("fsync", 2), ("write", 0), ("replace", 0), ("rename", 0)],
)
def test_enospc_during_commit_leaves_it_uncommitted(tmp_path, monkeypatch, name, n):
    make_ckpt(tmp_path, 10)
    partial = cs.partial_dir(tmp_path, 20)
    (partial / "__0_0.distcp").write_bytes(os.urandom(2000))
    entries = cs.hash_tree(partial)
    _fail_nth(monkeypatch, name, n)
    with pytest.raises(OSError) as exc:
        cs.commit(partial, 20, 1, entries, {})
    assert exc.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert partial.is_dir() and not (tmp_path / "step-00000020").exists()
    assert not [p for p in partial.iterdir() if p.name.startswith("manifest.json.tmp")]
    states = {s.step: s.state for s in cs.scan(tmp_path)}
    assert states == {10: "validated", 20: "incomplete"}
    # once there is space again, the same partial commits fine
    assert cs.inspect(cs.commit(partial, 20, 1, entries, {})).state == "validated"


def test_commit_fsync_count_matches_parametrization(tmp_path, monkeypatch):
    partial = cs.partial_dir(tmp_path, 1)
    (partial / "a").write_bytes(b"a")
    entries = cs.hash_tree(partial)
    calls = _fail_nth(monkeypatch, "fsync", 10**9)
    cs.commit(partial, 1, 1, entries, {})
    assert calls[0] == 3  # manifest file, partial dir, root: each one is tested above


@pytest.mark.parametrize(("name", "n"), [("fsync", n) for n in range(5)] + [("rename", 0)])
def test_enospc_during_quarantine_loses_nothing(tmp_path, monkeypatch, name, n):
    make_ckpt(tmp_path, 10)
    bad = make_ckpt(tmp_path, 20)
    flip_byte(bad / "__0_0.distcp")
    before = data_files(tmp_path)
    calls = _fail_nth(monkeypatch, name, n)
    # A full disk must not stop the resume: the bad one is left in place or put aside
    # without its record, and the older validated checkpoint is chosen all the same.
    chosen, _ = cs.select_resume(tmp_path)
    assert chosen.step == 10
    monkeypatch.undo()
    assert calls[0] >= n + 1
    assert data_files(tmp_path) == before
    assert {s.step: s.state for s in cs.scan(tmp_path) if s.state == "validated"} == {
        10: "validated"
    }
    chosen, _ = cs.select_resume(tmp_path)  # with space again, a retry settles it
    assert chosen.step == 10
    assert data_files(tmp_path) == before
    [q] = [s for s in cs.scan(tmp_path) if s.state == "quarantined"]
    assert q.step == 20 and q.reason


# --------------------------------------------------------------------------- manifest robustness

_KEYS = ["format", "format_version", "step", "world_size", "created_at", "files", "extra"]


@pytest.fixture(scope="module")
def fuzz_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    final = make_ckpt(root, 1, size=256)
    return final, json.loads((final / "manifest.json").read_text())


@FAST
@given(
    kind=st.sampled_from(["bytes", "json", "mutate", "mutate_file", "drop"]),
    raw=st.binary(max_size=200),
    value=json_values,
    key=st.sampled_from(_KEYS),
    fkey=st.sampled_from(["path", "size", "sha256"]),
)
def test_garbled_manifest_never_raises(fuzz_ckpt, kind, raw, value, key, fkey):
    final, good = fuzz_ckpt
    if kind == "bytes":
        content = raw
    elif kind == "json":
        content = json.dumps(value).encode()
    else:
        m = json.loads(json.dumps(good))
        if kind == "mutate":
            m[key] = value
        elif kind == "mutate_file":
            m["files"][0][fkey] = value
        else:
            del m[key]
        content = json.dumps(m).encode()
    (final / "manifest.json").write_bytes(content)
    try:
        for verify in (False, True):
            status = cs.inspect(final, verify_checksums=verify)
            assert status.state in ("validated", "incomplete", "corrupt")
            assert (status.reason == "") == (status.state == "validated")
            if kind in ("bytes", "json"):
                assert status.state == "incomplete"
    finally:
        (final / "manifest.json").write_text(json.dumps(good))


def test_manifest_reasons_are_specific(tmp_path):
    final = make_ckpt(tmp_path, 1)
    good = json.loads((final / "manifest.json").read_text())
    cases = {
        b"{not json": "not valid JSON",
        b"[]": "top level is array",
        json.dumps({**good, "format": "x"}).encode(): "format is 'x'",
        json.dumps({**good, "format_version": 2}).encode(): "unsupported format_version 2",
        json.dumps({**good, "world_size": 0}).encode(): "'world_size' must be",
        json.dumps(
            {**good, "files": [{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]}
        ).encode(): "is absolute",
    }
    for content, expected in cases.items():
        (final / "manifest.json").write_bytes(content)
        st_ = cs.inspect(final)
        assert st_.state == "incomplete" and expected in st_.reason, (content, st_.reason)


# --------------------------------------------------------------------------- CLI

runner = CliRunner()


def test_cli_list_healthy(tmp_path):
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20, world_size=4)
    cs.partial_dir(tmp_path, 30)  # a save in progress does not make it degraded
    r = runner.invoke(app, ["list", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["STEP", "STATE", "SIZE", "WORLD", "AGE", "REASON"]
    assert lines[2].split()[:6] == ["20", "committed", "(not", "verified)", "18.0", "KiB"]
    assert "incomplete" in lines[3] and ".partial" in lines[3]
    r = runner.invoke(app, ["list", str(tmp_path), "--json"])
    doc = json.loads(r.stdout)
    assert doc["newest_validated"] == 20 and doc["newest_is_valid"] is True
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20, 30]


def test_cli_verify_degraded_and_read_only(tmp_path):
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    flip_byte(tmp_path / "step-00000020" / "__0_0.distcp")
    listing = sorted(p.name for p in tmp_path.iterdir())
    # size-only list cannot see a flipped byte, so it never calls it validated; verify can
    r = runner.invoke(app, ["list", str(tmp_path)])
    assert r.exit_code == 0 and "validated" not in r.stdout.replace("(not verified)", ""), r.stdout
    assert "20  committed (not verified)" in r.stdout and "checksums not verified" in r.stdout
    assert "--verify reads every file" in r.stdout
    assert runner.invoke(app, ["list", "--verify", str(tmp_path)]).exit_code == 1
    r = runner.invoke(app, ["verify", str(tmp_path)])
    assert r.exit_code == 1, r.output
    assert "corrupt" in r.stdout and "sha256 mismatch" in r.stdout and "DEGRADED" in r.stdout
    assert "hashed" in r.stderr
    r = runner.invoke(app, ["verify", "--json", str(tmp_path)])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1
    assert doc["newest_validated"] == 10 and doc["newest_is_valid"] is False
    assert doc["root"] == str(tmp_path)
    assert {c["step"]: c["state"] for c in doc["checkpoints"]} == {10: "validated", 20: "corrupt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # verify never quarantines


def test_cli_unhealthy_exit_2(tmp_path):
    r = runner.invoke(app, ["verify", str(tmp_path / "missing")])
    assert r.exit_code == 2
    assert r.stderr.strip().count("\n") == 0 and "does not exist" in r.stderr
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["verify", "--json", str(tmp_path / "missing")])
    assert r.exit_code == 2 and json.loads(r.stdout)["newest_validated"] is None
    r = runner.invoke(app, ["verify", str(tmp_path)])  # empty dir
    assert r.exit_code == 2 and "no checkpoints" in r.stdout
    final = make_ckpt(tmp_path, 5)
    (final / "manifest.json").unlink()
    r = runner.invoke(app, ["list", str(tmp_path)])
    assert r.exit_code == 2 and "manifest.json missing" in r.stdout
    cs.select_resume(tmp_path)
    r = runner.invoke(app, ["list", str(tmp_path)])
    assert r.exit_code == 2 and "quarantined (incomplete)" in r.stdout


def test_cli_help_explains_states_and_exit_codes():
    for cmd in ("list", "verify"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0
        text = " ".join(r.output.split())
        assert "validated" in text and "quarantined" in text and "Exit codes" in text


def test_incarnation_numbers_grow_with_every_start_and_survive_damage(tmp_path):
    root = tmp_path / "ckpt"
    assert [cs.claim_incarnation(root) for _ in range(3)] == [0, 1, 2]
    # torchrun's restart count is a floor (a directory wiped mid-job)
    assert cs.claim_incarnation(root, at_least=7) == 7
    assert cs.claim_incarnation(root) == 8
    (root / cs.INCARNATION_FILE).write_text("garbage")
    assert cs.claim_incarnation(root, at_least=2) == 2
    assert cs.scan(root) == []  # not a checkpoint entry
