"""Issue 13, checkpoint roots: what another user who can write into a checkpoint root can no
longer do. Each attack plants real files, symlinks and manifests in a tmp root, then runs
the real store code (resume selection, quarantine, retention, incarnation, load); nothing
outside the root is touched or reported valid, nothing non-checkpoint is deleted, and good
older checkpoints survive a bad newest one."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
from builders import flip_byte, json_values, make_ckpt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rankguard.cli.checkpoints import app
from rankguard.client import checkpoint_store as cs
from rankguard.client.checkpoint_store import CheckpointError
from rankguard.client.checkpoints import CheckpointStore

NOBODY = 65534

# --------------------------------------------------------------------------- helpers


def forge(root: Path, step: int, files: dict[str, bytes], *, key: bytes | None = None) -> Path:
    """An attacker's step dir: its files and a self-consistent manifest written by hand
    (sha256 right; an HMAC only when the attacker holds ``key``)."""
    d = root / cs.step_dir_name(step)
    d.mkdir(parents=True)
    entries = []
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
        entries.append({"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    doc = {"format": cs.FORMAT, "format_version": cs.FORMAT_VERSION, "step": step,
           "world_size": 1, "created_at": 1.0, "files": entries, "extra": {}}  # fmt: skip
    if key is not None:
        doc = cs.sign_manifest(doc, key)
    (d / cs.MANIFEST_NAME).write_text(json.dumps(doc))
    return d


def point_outside(link: Path, target: Path) -> None:
    """Replace ``link`` (a file or dir in a step dir) by a symlink to ``target``."""
    if link.is_dir():
        shutil.rmtree(link)
    else:
        link.unlink()
    link.symlink_to(target)


def manifest_entry(data: bytes, path: str) -> dict:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def add_to_manifest(step_dir: Path, entry: dict) -> None:
    doc = json.loads((step_dir / cs.MANIFEST_NAME).read_text())
    doc["files"].append(entry)
    (step_dir / cs.MANIFEST_NAME).write_text(json.dumps(doc))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def write_key(path: Path, key: bytes = b"k" * 32) -> Path:
    path.write_bytes(key + b"\n")
    path.chmod(0o600)
    return path


class Marker:
    """Unpickling this touches a file: proof that a crafted pickle was deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside the checkpoint root with a file worth protecting."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "victim").write_bytes(b"precious data\n")
    return d


@pytest.fixture
def root(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    return d


# --------------------------------------------------------------------------- symlinks out of the root


def test_a_file_symlinked_outside_is_never_reported_validated(root, outside):
    victim = outside / "victim"
    direct = make_ckpt(root, 10)
    add_to_manifest(direct, manifest_entry(victim.read_bytes(), "extra.bin"))
    (direct / "extra.bin").symlink_to(victim)  # listed, with the victim's size and sha256
    nested = make_ckpt(root, 20)
    (outside / "sub").mkdir()
    (outside / "sub" / "x").write_bytes(b"x" * 10)
    add_to_manifest(nested, manifest_entry(b"x" * 10, "sub/x"))
    (nested / "sub").symlink_to(outside / "sub")  # a symlinked folder inside
    (root / "step-00000030").symlink_to(make_ckpt(outside, 30))  # the step dir itself
    unlisted = make_ckpt(root, 40)
    (unlisted / "stray").symlink_to(victim)

    for verify in (False, True):
        states = {s.step: (s.state, s.reason) for s in cs.scan(root, verify_checksums=verify)}
        assert set(states) == {10, 20, 40}, "a symlinked step dir is not listed"
        for step in (10, 20, 40):
            assert states[step][0] == "corrupt" and "symbolic link (refused)" in states[step][1]
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.inspect(root / "step-00000030")
    chosen, moved = cs.select_resume(root)
    assert chosen is None and {q.step for q in moved} == {10, 20, 40}
    assert victim.read_bytes() == b"precious data\n"  # moved aside: the link, not its target
    assert (outside / "step-00000030" / cs.MANIFEST_NAME).is_file()
    out = CliRunner().invoke(app, ["verify", str(root)])
    assert out.exit_code == 2 and "step 30" not in out.output


def test_a_fifo_under_a_listed_name_does_not_block_verification(root):
    d = make_ckpt(root, 10)
    (d / "__0_0.distcp").unlink()
    os.mkfifo(d / "__0_0.distcp")
    [s] = cs.scan(root)
    assert s.state == "corrupt" and "not a regular file" in s.reason


def test_incarnation_never_writes_through_a_planted_symlink(root, outside):
    victim = outside / "victim"
    (root / "incarnation.tmp").symlink_to(victim)
    assert cs.claim_incarnation(root) == 0
    (root / "incarnation").unlink()
    (root / "incarnation").symlink_to(victim)  # the file itself: read nothing, replace the link
    assert cs.claim_incarnation(root, at_least=3) == 3
    assert victim.read_bytes() == b"precious data\n"
    assert not (root / "incarnation").is_symlink()
    assert (root / "incarnation").read_text() == "4\n"
    assert cs.claim_incarnation(root) == 4


def test_quarantine_never_moves_a_checkpoint_through_a_symlinked_folder(root, outside):
    make_ckpt(root, 10)
    bad = make_ckpt(root, 20)
    flip_byte(bad / "__0_0.distcp")
    (root / "quarantine").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.quarantine(bad, "test")
    chosen, moved = cs.select_resume(root)  # the bad one is left in place, never chosen
    assert chosen.step == 10 and moved == []
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]
    assert bad.is_dir()
    cs.partial_dir(root, 30)
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.partial_dir(root, 30)  # a stale .partial cannot be put aside either: refused


def test_a_symlinked_step_dir_is_never_quarantined_or_saved_into(root, outside):
    (root / "step-00000005.partial").symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.partial_dir(root, 5)
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.ensure_partial_dir(root, 5)
    with pytest.raises(CheckpointError, match="symbolic link"):
        cs.quarantine(root / "step-00000005.partial", "x")
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a dir as another user")
def test_ranks_never_save_into_another_users_partial_dir(root):
    planted = root / "step-00000007.partial"
    planted.mkdir()
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(CheckpointError, match="owned by uid 65534"):
        cs.ensure_partial_dir(root, 7)
    assert cs.ensure_partial_dir(root, 8).is_dir()


# --------------------------------------------------------------------------- retention


def test_retention_deletes_nothing_that_is_not_a_checkpoint(root, outside):
    for step in (10, 20, 30):
        make_ckpt(root, step)
    # a user's folder renamed to look like a crash's trash: no manifest lists its files
    stray = root / ".trash-step-00000001.x"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    (root / ".trash-step-00000002.y").symlink_to(outside)
    # a trash dir whose manifest lists a path through a symlinked folder out of the root
    via_link = forge(root, 3, {"sub/victim": b"precious data\n"})
    shutil.rmtree(via_link / "sub")
    (via_link / "sub").symlink_to(outside)
    via_link.rename(root / ".trash-step-00000003.z")
    # a validated checkpoint with a file nobody listed added after the check
    (root / "step-00000004").symlink_to(make_ckpt(outside, 4))
    before = snapshot(outside)

    removed = cs.apply_retention(root, 1)
    assert [p.name for p in removed] == ["step-00000020", "step-00000010"]
    assert snapshot(outside) == before
    assert (stray / "notes.txt").read_text() == "mine"
    assert (root / ".trash-step-00000003.z").is_dir()  # left: its link is not a listed file
    names = sorted(p.name for p in root.iterdir())
    assert names == [".trash-step-00000001.x", ".trash-step-00000002.y",
                     ".trash-step-00000003.z", "step-00000004", "step-00000030"]  # fmt: skip


def test_retention_removes_only_listed_files_of_a_checkpoint(root):
    for step in (10, 20):
        make_ckpt(root, step)
    trash = root / ".trash-step-00000010.crash"
    (root / "step-00000010").rename(trash)  # a crash between the rename and the delete
    (trash / "added-later.txt").write_text("not in the manifest")
    cs.apply_retention(root, 1)
    assert sorted(p.name for p in trash.iterdir()) == ["added-later.txt"]


def test_a_corrupt_newest_never_costs_the_good_older_ones(root):
    for step in (10, 20, 30):
        make_ckpt(root, step)
    before = sorted(p.name for p in root.iterdir())
    flip_byte(root / "step-00000030" / "__1_0.distcp")  # same size: only a checksum sees it
    forged = forge(root, 99, {"__0_0.distcp": b"x" * 4096})  # a planted "newest"
    doc = json.loads((forged / cs.MANIFEST_NAME).read_text())
    doc["files"][0]["sha256"] = "0" * 64
    (forged / cs.MANIFEST_NAME).write_text(json.dumps(doc))
    for keep in (1, 2, 3):
        assert cs.apply_retention(root, keep) == []
    assert sorted(p.name for p in root.iterdir()) == [*before, "step-00000099"]
    chosen, _ = cs.select_resume(root)
    assert chosen.step == 20


def test_retention_counts_only_fully_verified_checkpoints(root):
    for step in (10, 20, 30):
        make_ckpt(root, step)
    flip_byte(root / "step-00000020" / "__0_0.distcp")
    assert cs.apply_retention(root, 2) == []  # 30 and 10 are the two good ones
    make_ckpt(root, 40)
    removed = cs.apply_retention(root, 2)  # 40 and 30 kept: the older two may go
    assert [p.name for p in removed] == ["step-00000020", "step-00000010"]


def test_retention_does_not_reread_what_the_caller_verified(root, monkeypatch):
    verified = {cs.identity(make_ckpt(root, step)) for step in (10, 20, 30)}
    hashed = []
    real = cs.read._checksum_fd  # what verification reads with
    monkeypatch.setattr(cs.read, "_checksum_fd", lambda fd, *a: hashed.append(fd) or real(fd, *a))
    assert [p.name for p in cs.apply_retention(root, 2, verified=verified)] == ["step-00000010"]
    assert hashed == []
    cs.apply_retention(root, 2)
    assert len(hashed) == 2 * 5  # without it: both kept ones, five files each


# --------------------------------------------------------------------------- keyed manifests


def test_a_keyed_store_refuses_a_self_consistent_forgery_before_unpickling(root, tmp_path):
    key_file = write_key(tmp_path / "key")
    store = CheckpointStore(root, key_file=key_file)
    assert store.save(10, {"w": [1.0, 2.0]}) is not None
    marker = tmp_path / "unpickled"
    crafted = pickle.dumps(Marker(str(marker)))
    forge(root, 20, {"state.pkl": crafted})  # unsigned, sha256 right
    forge(root, 30, {"state.pkl": crafted}, key=b"not the key".ljust(32, b"!"))

    step, state = store.resume()
    assert (step, state) == (10, {"w": [1.0, 2.0]})
    assert not marker.exists()
    reasons = {s.step: s.reason for s in cs.scan(root, key=store.key) if s.state == "quarantined"}
    assert "not signed" in reasons[20] and "another key" in reasons[30]
    # without the key the same forgery would pass: the SHA-256 is unkeyed
    forge(root, 40, {"state.pkl": crafted})
    assert CheckpointStore(root, key_file=None).latest().step == 40
    with pytest.raises(CheckpointError, match="not signed"):
        store.load(40)
    assert not marker.exists()


def test_a_keyed_load_verifies_checksums_before_unpickling(root, tmp_path):
    store = CheckpointStore(root, key_file=write_key(tmp_path / "key"))
    final = store.save(10, {"w": 1})
    marker = tmp_path / "unpickled"
    crafted = pickle.dumps(Marker(str(marker)))
    [state] = [p for p in final.iterdir() if p.name.startswith("state.")]  # .pt with torch
    state.write_bytes(crafted.ljust(state.stat().st_size, b"."))  # same size, signed manifest
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        store.load(10)
    assert not marker.exists()


def test_signed_manifests_validate_with_their_key_only(root, tmp_path):
    key = b"s" * 32
    for step in (10, 20):
        partial = cs.partial_dir(root, step)
        (partial / "a").write_bytes(os.urandom(100))
        cs.commit(partial, step, 1, cs.hash_tree(partial), {"n": step}, key=key)
    assert {s.state for s in cs.scan(root, key=key)} == {"validated"}
    assert {s.state for s in cs.scan(root)} == {"validated"}  # readable without the key
    other = {s.reason for s in cs.scan(root, key=b"t" * 32)}
    assert all("another key" in r for r in other)
    make_ckpt(root, 30)  # unsigned
    [s30] = [s for s in cs.scan(root, key=key) if s.step == 30]
    assert s30.state == "corrupt" and "not signed" in s30.reason


# --------------------------------------------------------------------------- weights_only

_DATA = {"od": OrderedDict(a=1, b=[2.5, None]), "counts": Counter("abca"), "set": {1, 2},
         "frozen": frozenset({"x"}), "raw": b"\x00\xff", "buf": bytearray(b"ab"), "z": 1 + 2j,
         "t": (True, "\u00e9", 2**70, -0.5)}  # fmt: skip


def test_load_refuses_a_planted_pickles_code_unless_told_to_run_it(root, tmp_path):
    """No key: a planted, self-consistent state.pkl validates, but load() and resume() read
    data only (weights_only, True by default) and refuse its global before calling it."""
    marker = tmp_path / "unpickled"
    forge(root, 20, {"state.pkl": pickle.dumps(Marker(str(marker)))})
    store = CheckpointStore(root, key_file=None)
    assert store.latest().step == 20
    for kw in ({}, {"weights_only": True}):
        with pytest.raises(CheckpointError, match=r"state.pkl refused: .*Path.touch.* not allowed"):
            store.load(20, **kw)
    with pytest.raises(CheckpointError, match="refused"):
        store.resume()
    assert not marker.exists()
    store.load(20, weights_only=False)  # the caller's explicit choice: it runs
    assert marker.exists()


def test_load_refuses_a_planted_torch_files_code(root, tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "unpickled"
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2), "evil": Marker(str(marker))}, buf)
    forge(root, 20, {"state.pt": buf.getvalue()})
    with pytest.raises(CheckpointError, match="state.pt refused"):
        CheckpointStore(root, key_file=None).load(20)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_data_pickles_of_every_protocol_load_with_weights_only(root, protocol):
    forge(root, 10, {"state.pkl": pickle.dumps(_DATA, protocol=protocol)})
    assert CheckpointStore(root, key_file=None).load(10) == _DATA


def test_a_store_without_torch_saves_and_resumes_its_pickle(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # a process that never imported torch
    store = CheckpointStore(root, key_file=None)
    assert store.save(10, _DATA) is not None
    assert (root / cs.step_dir_name(10) / "state.pkl").is_file()
    assert store.resume() == (10, _DATA)


_mutations = st.sampled_from(
    ["step", "world_size", "created_at", "size", "sha256", "path", "extra"]
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(field=_mutations, value=st.integers(0, 10**6))
def test_any_edit_of_a_signed_manifest_is_refused(tmp_path, field, value):
    key = b"q" * 32
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    partial = cs.partial_dir(root, 5)
    (partial / "a").write_bytes(b"abc")
    final = cs.commit(partial, 5, 1, cs.hash_tree(partial), {"x": 1}, key=key)
    doc = json.loads((final / cs.MANIFEST_NAME).read_text())
    entry = doc["files"][0]
    if field in ("size", "sha256", "path"):
        entry[field] = {"size": value + 4, "sha256": f"{value:064x}", "path": f"b{value}"}[field]
    elif field == "extra":
        doc["extra"] = {"x": value + 2}
    else:
        doc[field] = doc[field] + value + 1
    (final / cs.MANIFEST_NAME).write_text(json.dumps(doc))
    status = cs.inspect(final, key=key)
    assert status.state == "corrupt" and "HMAC does not match" in status.reason


def test_key_files_are_checked(tmp_path):
    loose = write_key(tmp_path / "loose")
    loose.chmod(0o640)
    with pytest.raises(CheckpointError, match="chmod 600"):
        cs.load_key(loose)
    with pytest.raises(CheckpointError, match="shorter than 16"):
        cs.load_key(write_key(tmp_path / "short", b"abc"))
    with pytest.raises(CheckpointError, match="No such file"):
        cs.resolve_key(None, {cs.KEY_FILE_ENV: str(tmp_path / "missing")})
    assert cs.resolve_key(None, {}) is None
    good = write_key(tmp_path / "good")
    assert cs.resolve_key(None, {cs.KEY_FILE_ENV: str(good)}) == b"k" * 32
    with pytest.raises(CheckpointError, match="chmod 600"):
        CheckpointStore(tmp_path / "ckpt", key_file=loose)


def test_cli_verify_with_a_key_file(root, tmp_path):
    key_file = write_key(tmp_path / "key")
    store = CheckpointStore(root, key_file=key_file)
    store.save(10, {"w": 1})
    forge(root, 20, {"state.pkl": b"forged"})
    runner = CliRunner()
    out = runner.invoke(app, ["verify", str(root), "--key-file", str(key_file), "--json"])
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    assert out.exit_code == 1 and doc["newest_validated"] == 10
    assert runner.invoke(app, ["verify", str(root)]).exit_code == 0  # no key: SHA-256 only
    bad = runner.invoke(app, ["list", str(root), "--key-file", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert bad.output.strip().splitlines()[0].startswith("error: checkpoint key file")


def test_trainer_reads_the_key_file_before_anything_starts(tmp_path):
    from rankguard.trainer.config import ConfigError, config_from_args

    key_file = write_key(tmp_path / "key")
    cfg = config_from_args(["--ckpt-dir", str(tmp_path), "--ckpt-key-file", str(key_file)], {})
    assert cfg.ckpt.key == b"k" * 32 and "kkkk" not in repr(cfg)
    env = {cs.KEY_FILE_ENV: str(key_file)}
    assert config_from_args(["--ckpt-dir", str(tmp_path)], env).ckpt.key == b"k" * 32
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        config_from_args(["--ckpt-dir", str(tmp_path), "--ckpt-key-file", str(key_file)], {})


# --------------------------------------------------------------------------- a real second user


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (setpriv)")
def test_a_second_user_in_a_world_writable_root_gets_nothing_out(tmp_path):
    """``nobody`` plants symlinks and a forged newest checkpoint in a 1777 root; the owner's
    resume, quarantine, retention and incarnation then touch nothing outside it."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv not installed")
    shared = Path(tempfile.mkdtemp(prefix="rg-ckpt-"))
    try:
        shared.chmod(0o1777)
        root = shared / "ckpt"
        root.mkdir()
        root.chmod(0o1777)
        outside = tmp_path / "outside"
        outside.mkdir()
        victim = outside / "victim"
        victim.write_bytes(b"precious data\n")
        for step in (10, 20):
            make_ckpt(root, step)
        flip_byte(root / "step-00000020" / "__0_0.distcp")
        plant = f"""
import hashlib, json, os
root = {str(root)!r}; victim = {str(victim)!r}; outside = {str(outside)!r}
os.symlink(victim, os.path.join(root, "incarnation.tmp"))
os.symlink(outside, os.path.join(root, "quarantine"))
d = os.path.join(root, "step-00000099"); os.mkdir(d)
os.symlink(victim, os.path.join(d, "victim"))
data = open(victim, "rb").read() if os.access(victim, os.R_OK) else b"precious data\\n"
doc = {{"format": "rankguard-checkpoint", "format_version": 1, "step": 99, "world_size": 1,
       "created_at": 1.0, "extra": {{}}, "files": [{{"path": "victim", "size": len(data),
       "sha256": hashlib.sha256(data).hexdigest()}}]}}
open(os.path.join(d, "manifest.json"), "w").write(json.dumps(doc))
"""
        planted = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             sys.executable, "-I", "-c", plant],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert planted.returncode == 0, planted.stderr
        assert (root / "step-00000099").stat().st_uid == NOBODY
        outside.chmod(0o755)

        assert cs.claim_incarnation(root) == 0
        chosen, _ = cs.select_resume(root)
        assert chosen.step == 10  # 99 (a symlink) and 20 (corrupt) refused; neither moved
        assert cs.apply_retention(root, 1) == []  # the newest (99) fails: nothing deleted
        assert victim.read_bytes() == b"precious data\n"
        assert sorted(p.name for p in outside.iterdir()) == ["victim"]
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == [
            "step-00000010", "step-00000020", "step-00000099",
        ]  # fmt: skip
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values, seal=json_values)
def test_with_a_key_no_manifest_content_raises_or_validates(tmp_path, value, seal):
    """Arbitrary JSON as the manifest, or as its seal: judged (never raised) and never valid."""
    key = b"z" * 32
    d = Path(tempfile.mkdtemp(dir=tmp_path)) / "step-00000001"
    d.mkdir()
    (d / "a").write_bytes(b"abc")
    doc = {"format": cs.FORMAT, "format_version": 1, "step": 1, "world_size": 1,
           "created_at": 1.0, "files": [manifest_entry(b"abc", "a")], "extra": {}}  # fmt: skip
    for manifest in (value, {**doc, cs.HMAC_FIELD: seal}):
        (d / cs.MANIFEST_NAME).write_text(json.dumps(manifest))
        status = cs.inspect(d, key=key)
        assert status.state in ("corrupt", "incomplete") and status.reason


TRAINER_RESUME = r"""
import hashlib, json, os, pickle, sys
from pathlib import Path
import torch, torch.distributed as dist
from rankguard.client import checkpoint_store as cs
from rankguard.trainer.checkpoint import AsyncCheckpointer
from rankguard.trainer.config import CheckpointConfig
from rankguard.trainer.distributed import DistInfo

root, marker, key_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{root.parent}/pg", rank=0, world_size=1)
info = DistInfo(0, 0, 1, 1, 0, torch.device("cpu"), dist.new_group(backend="gloo"))
faults = type("NoFaults", (), {"ckpt_delay": staticmethod(lambda step: 0)})()
cfg = CheckpointConfig(dir=root, every=10, keep=3, mode="sync", key=cs.load_key(key_file))
ckpt = AsyncCheckpointer(cfg, info, faults)
model = torch.nn.Linear(4, 4)
optim = torch.optim.AdamW(model.parameters())
ckpt.save(10, model, optim, {"step": 10})
ckpt.wait()

class Marker:
    def __reduce__(self):
        return (Path.touch, (Path(marker),))

# a self-consistent forgery of a newer step: a crafted .metadata pickle, an unkeyed manifest
forged = root / "step-00000020"
forged.mkdir()
(forged / ".metadata").write_bytes(pickle.dumps(Marker()))
data = (forged / ".metadata").read_bytes()
doc = {"format": "rankguard-checkpoint", "format_version": 1, "step": 20, "world_size": 1,
       "created_at": 1.0, "extra": {}, "files": [{"path": ".metadata", "size": len(data),
       "sha256": hashlib.sha256(data).hexdigest()}]}
(forged / "manifest.json").write_text(json.dumps(doc))
state = ckpt.resume(model, optim)
ckpt.close()
print(json.dumps({"resumed": ckpt.newest_validated, "state_step": state["step"]}))
dist.destroy_process_group()
"""


def test_the_trainer_refuses_a_forged_dcp_checkpoint_before_dcp_load(tmp_path):
    pytest.importorskip("torch")
    root = tmp_path / "ckpt"
    marker = tmp_path / "unpickled"
    key_file = write_key(tmp_path / "key")
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER_RESUME, str(root), str(marker), str(key_file)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"resumed": 10, "state_step": 10}
    assert not marker.exists()
    [q] = [s for s in cs.scan(root) if s.state == "quarantined"]
    assert q.step == 20 and "not signed" in q.reason
