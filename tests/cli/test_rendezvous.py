"""`rankguard rendezvous` (the job's store on the control node) and torchrun's
`--rdzv-backend rankguard` against it: real processes, a real TCPStore, real torchrun.

The multi-node case (node 0 lost, the store outside every training node) is in
tests/system/test_multinode.py; here the store's own restart, on one machine."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from harness import check_sd_notify_lifecycle, free_port, read_json, wait_until

from rankguard.contract.secrets import write_secret_file

pytestmark = pytest.mark.slow

RANKGUARD = [sys.executable, "-m", "rankguard.cli.main"]


class Rendezvous:
    """`rankguard rendezvous --port PORT`, restartable on the same port."""

    def __init__(self, tmp: Path, port: int | None = None):
        self.tmp, self.port, self.proc, self.starts = tmp, port or free_port(), None, 0

    def start(self, env: dict | None = None) -> Rendezvous:
        self.starts += 1
        self.log = self.tmp / f"rendezvous-{self.starts}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [*RANKGUARD, "rendezvous", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            )  # fmt: skip
        wait_until(lambda: self._listening(), 60, f"the rendezvous store ({self.log.read_text()})")
        return self

    def _listening(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def store(tmp_path):
    r = Rendezvous(tmp_path).start()
    yield r
    r.stop()


SECRET = "a-rendezvous-secret-0123456789abcdef"


@pytest.fixture
def secret_file(tmp_path, monkeypatch) -> Path:
    """The job's rendezvous secret, named by the variable torchrun's launchers read."""
    path = tmp_path / "rendezvous.key"
    write_secret_file(path, SECRET)
    monkeypatch.setenv("RANKGUARD_RDZV_SECRET_FILE", str(path))
    return path


def client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


# ------------------------------------------------------------------------- the service


def test_serves_a_store_and_stops_cleanly_on_sigterm(store):
    c = client(store.port)
    c.set("k", "v")
    assert client(store.port).get("k") == b"v"  # a second client sees the first one's write
    assert store.stop() == 0
    assert "rendezvous store listening on port" in store.log.read_text()


def test_tells_systemd_ready_watchdog_and_stopping(tmp_path):
    # WatchdogSec=1s: a ping every half second, each after a round trip through the store
    check_sd_notify_lifecycle(
        tmp_path, ["rendezvous", "--port", str(free_port())], env={"WATCHDOG_USEC": "1000000"}
    )


def test_port_in_use_is_a_clear_error(store):
    out = subprocess.run([*RANKGUARD, "rendezvous", "--port", str(store.port)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2, out
    assert f"cannot listen on every address port {store.port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_bad_port_is_refused(port):
    out = subprocess.run([*RANKGUARD, "rendezvous", "--port", port],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "--port" in out.stderr and "Traceback" not in out.stderr, out


# ------------------------------------------------------------ the reconnecting client


def test_client_reconnects_to_a_restarted_store_and_reseeds(store):
    from rankguard.trainer.rendezvous import ReconnectingStore

    rs = ReconnectingStore("127.0.0.1", store.port, timedelta(seconds=30))
    rs.on_reconnect.append(lambda c: c.set("seeded", "yes"))
    rs.set("before", "1")
    assert rs.get("before") == b"1"
    store.kill()
    time.sleep(1)
    store.start()
    # the call that finds the connection broken reconnects, seeds, and is retried
    assert rs.add("counter", 5) == 5
    assert rs.reconnects == 1
    assert rs.get("seeded") == b"yes"
    assert not rs.check(["before"])  # a restarted store starts empty: only the link is kept


def test_client_waits_for_a_store_that_comes_up_late(tmp_path):
    from rankguard.trainer.rendezvous import ReconnectingStore

    late = Rendezvous(tmp_path)
    try:
        timer = __import__("threading").Timer(3, late.start)
        timer.start()
        t0 = time.monotonic()
        rs = ReconnectingStore("127.0.0.1", late.port, timedelta(seconds=60))
        assert time.monotonic() - t0 >= 2.5
        rs.set("k", "v")
        timer.join()
    finally:
        late.stop()


def test_client_gives_up_after_the_read_timeout(tmp_path):
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from rankguard.trainer.rendezvous import ReconnectingStore

    with pytest.raises(RendezvousConnectionError, match="is `rankguard rendezvous` running"):
        ReconnectingStore("127.0.0.1", free_port(), timedelta(seconds=2))


def test_backend_refuses_is_host():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rankguard.trainer.rendezvous import create_rankguard_handler

    params = RendezvousParameters("rankguard", "127.0.0.1:1", "j", 1, 1, is_host="1")
    with pytest.raises(ValueError, match="never a training node"):
        create_rankguard_handler(params)


def test_a_restart_joins_without_torchs_random_first_round_wait(store, secret_file, monkeypatch):
    """torch waits a random 0-0.3 s before a join while the round is 0, which includes a
    job's first restart; our handler's restarts join at once (the fixed poll delay stays)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous

    from rankguard.trainer.rendezvous import create_rankguard_handler

    waits = []

    def record(seconds):
        waits.append(seconds)

    monkeypatch.setattr(dynamic_rendezvous, "_delay", record)
    params = RendezvousParameters("rankguard", f"127.0.0.1:{store.port}", "j", 1, 1)
    handler = create_rankguard_handler(params)
    try:
        first = handler.next_rendezvous()
        assert waits == [(0, 0.3)]  # torch's spreading wait at the first join, as before
        again = handler.next_rendezvous()  # what torchrun's agent calls at a restart
        assert waits == [(0, 0.3)], waits
        assert (first.rank, first.world_size, again.rank, again.world_size) == (0, 1, 0, 1)
        assert dynamic_rendezvous._delay is record  # put back after the call
    finally:
        handler.shutdown()


# --------------------------------------------------------- torchrun across a restart


def _workers(torchrun_pid: int) -> list[int]:
    """The trainer processes under torchrun (its children: torchrun forks them)."""
    tasks = Path(f"/proc/{torchrun_pid}/task").glob("*/children")
    return sorted(int(p) for t in tasks for p in t.read_text().split())


def test_job_survives_a_store_restart_and_reforms_through_the_new_store(
    store, secret_file, tmp_path
):
    """The store is SIGKILLed mid-run and started again on its port: training goes on, and
    a later rank failure re-forms the group through the new (empty) store, from the newest
    checkpoint, to the last step."""
    # about 25 ms a step here: the store's restart and the kill fall mid-run
    steps = 1000
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANKGUARD_TELEMETRY_SOCKET": "off",
           "RANKGUARD_RDZV_SECRET_FILE": str(secret_file),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--max-restarts", "2", "--rdzv-backend", "rankguard",
        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "storejob",
        "--rdzv-conf", "keep_alive_interval=1", "--monitor-interval", "0.2",
        "-m", "rankguard.trainer", "--preset", "tiny", "--log-every", "0", "--deterministic",
        "--steps", str(steps), "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "50",
        "--summary", str(tmp_path / "summary.json"), "--job", "storejob",
    ]  # fmt: skip
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        tr = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def running(pred):
        assert tr.poll() is None, log.read_text()[-6000:]
        return pred()

    try:
        ckpts = lambda: sorted((tmp_path / "ckpt").glob("step-*"))  # noqa: E731
        wait_until(lambda: running(lambda: len(ckpts()) >= 2), 120, "two checkpoints")
        first_workers = _workers(tr.pid)
        store.kill()
        time.sleep(3)  # down for at least one keep-alive: torchrun notices
        assert tr.poll() is None, log.read_text()[-4000:]
        store.start()
        # the running group was not disturbed, and torchrun came back to the new store
        back = lambda: client(store.port).check(["torch.rendezvous.storejob"])  # noqa: E731
        wait_until(lambda: running(back), 30, "torchrun back in the new store")
        assert _workers(tr.pid) == first_workers
        os.kill(first_workers[1], signal.SIGKILL)  # now a restart needs a new round
        print(f"a worker killed after {ckpts()[-1].name} of {steps} steps")
        assert tr.wait(timeout=240) == 0, log.read_text()[-6000:]
    finally:  # torchrun and its workers: a SIGKILLed torchrun leaves its workers behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(tr.pid, signal.SIGKILL)
        tr.wait()
    text = log.read_text()
    assert "reconnected" in text, text[-4000:]
    # the new store holds torchrun's own state now (the re-formed round, then its close),
    # not only the empty marker the reconnect wrote
    state = client(store.port).get("torch.rendezvous.storejob")
    assert state and state != b"Y2FuaW1hZGFt", state
    s = read_json(tmp_path / "summary.json")
    assert (s["final_step"], s["world_size"]) == (steps, 2), s
    assert s["resumed_from"] is not None and s["resumed_from"] >= 100, s


# ------------------------------------------------------------ what the store is trusted with


def test_store_bound_to_loopback_listens_there_only(tmp_path):
    port = free_port()
    proc = subprocess.Popen([*RANKGUARD, "rendezvous", "--port", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_until(lambda: _listeners(port), 60, "the store to listen")
        assert _listeners(port) == {"127.0.0.1"}
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _listeners(port: int) -> set[str]:
    """The local addresses listening on TCP `port` (ss, as an operator would look)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True)
    return {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.stdout.splitlines()}


def signed_backend(port: int, job: str = "j", secret: bytes = SECRET.encode()):
    from rankguard.trainer.rendezvous import ReconnectingStore, SignedBackend

    return SignedBackend(ReconnectingStore("127.0.0.1", port, timedelta(seconds=10)), job, secret)


class Touch:
    """Unpickling this creates a file: proof that a forged state was deserialized."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_signed_state_round_trips_and_a_forgery_is_refused_unread(store, tmp_path):
    import base64
    import pickle

    backend = signed_backend(store.port)
    assert backend.get_state() is None  # the empty marker
    state, token, ok = backend.set_state(b"first state")
    assert (state, ok) == (b"first state", True)
    assert backend.get_state() == (b"first state", token)
    assert b"first state" in base64.b64decode(client(store.port).get("torch.rendezvous.j"))

    marker = tmp_path / "unpickled"
    forged = base64.b64encode(pickle.dumps(Touch(marker)))
    for bad in (forged, b"not base64 at all!", base64.b64encode(b"x" * 40)):
        client(store.port).set("torch.rendezvous.j", bad)
        # the last verified state, with the bad value as the token to replace it
        assert backend.get_state() == (b"first state", bad)
    assert backend.refused == 3
    assert not marker.exists()
    # the next honest write, against the bad value, replaces it
    state, token, ok = backend.set_state(b"second state", bad)
    assert (state, ok) == (b"second state", True)
    assert signed_backend(store.port).get_state() == (b"second state", token)


def test_a_state_signed_for_another_job_or_with_another_secret_is_refused(store):
    signed_backend(store.port, job="other").set_state(b"other job's state")
    other = client(store.port).get("torch.rendezvous.other")
    client(store.port).set("torch.rendezvous.j", other)
    mine = signed_backend(store.port)
    assert mine.get_state()[0] != b"other job's state" and mine.refused == 1
    signed_backend(store.port, secret=b"another secret 0123456789").set_state(b"x", other)
    assert mine.get_state()[0] != b"x" and mine.refused == 2


def test_the_backend_needs_a_secret_only_its_user_can_read(store, tmp_path, monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rankguard.trainer.rendezvous import create_rankguard_handler

    monkeypatch.delenv("RANKGUARD_RDZV_SECRET_FILE", raising=False)
    params = RendezvousParameters("rankguard", f"127.0.0.1:{store.port}", "j", 1, 1)
    with pytest.raises(ValueError, match="needs the job's rendezvous secret"):
        create_rankguard_handler(params)
    loose = tmp_path / "loose.key"
    loose.write_text(SECRET)
    loose.chmod(0o644)
    params = RendezvousParameters(
        "rankguard", f"127.0.0.1:{store.port}", "j", 1, 1, secret_file=str(loose)
    )
    with pytest.raises(ValueError, match="accessible by group or others"):
        create_rankguard_handler(params)
