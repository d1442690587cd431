"""Telemetry trust (issue 13): only a rank's owner speaks for it, quotas bound what one
sender can cost, and missing records are not a hang.

The attacks run as a second local user, uid/gid 61234 (no /etc/passwd entry needed), made
with `setpriv --reuid --regid --clear-groups`; they need root (the suite runs as root in
CI) and are skipped otherwise. The victim is a "rank" of this test's user under a fake
torchrun launcher (a process whose command line says torchrun), watched by a real agent
and supervisor. Each attack ends with the victim alive and the refusal counted on the
agent's /metrics. The unit tests below need neither root nor daemons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from builders import CFG, T0, hung, nodeobs
from harness import TOKEN, Daemon, free_port, http_json, start_supervisor, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankguard.agent.config import AgentConfigError, load_config
from rankguard.agent.processes import process_uid, signal_exact
from rankguard.agent.ranks import ForeignOwnerError, RankQuotaError, RankTable, read_proc_stat
from rankguard.agent.receiver import RECEIVER_REASONS, Quota, TelemetryReceiver
from rankguard.contract.telemetry import TelemetryRecord, encode
from rankguard.supervisor.detectors import hang
from rankguard.supervisor.state import ClusterObs

ATTACKER = 61234  # a second local user: uid and gid
OUTSIDER = 61235  # a user not in the socket's group

as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="acting as a second local user needs root and setpriv (the CI suite runs as root)",
)

# -- processes ----------------------------------------------------------------------------

# stdlib only: run by the attacker with `python -I -S`, and by the victim.
RECORD = """
import json, os, socket, time
def record(job, rank, world=1, step=1, loss=2.0, restart=0, seconds=0.05, pid=None):
    return json.dumps(dict(
        v=1, job=job, rank=rank, local_rank=rank, world_size=world,
        pid=os.getpid() if pid is None else pid, restart=restart, step=step, phase="train",
        time=time.time(), step_seconds=seconds, data_wait_seconds=0.0,
        compute_seconds=seconds, comm_seconds=0.0, comm_exposed_seconds=0.0,
        optimizer_seconds=0.0, checkpoint_block_seconds=0.0, tokens_per_second=1.0,
        mfu=0.0, peak_memory_bytes=0, loss=loss, checkpoint_step=None)).encode()
"""

# A busy rank: computes for `period` seconds, then sends its step (dropped on a full
# queue, as the client library does).
RANK = (
    RECORD
    + """
import sys
path, job, rank, period = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.setblocking(False)
step = 0
while True:
    t = time.monotonic()
    while time.monotonic() - t < period:
        sum(range(1000))
    step += 1
    try:
        s.sendto(record(job, rank, step=step, seconds=period), path)
    except OSError:
        pass
"""
)

# A fake torchrun: its command line says torchrun; it starts one rank and waits.
LAUNCHER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], *sys.argv[3:]])
print(child.pid, flush=True)
child.wait()
"""


def launch_victim(sock: Path, job: str, rank: int = 0, period: float = 0.05):
    """(launcher, worker pid): a fake torchrun of this test's user with one busy rank."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, "torchrun", RANK, str(sock), job, str(rank), str(period)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    return proc, int(proc.stdout.readline())


def as_attacker(code: str, *args: str, uid: int = ATTACKER, wait: bool = True):
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
           sys.executable, "-I", "-S", "-c", RECORD + code, *args]  # fmt: skip
    if wait:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def alive(pid: int) -> bool:
    stat = read_proc_stat(pid)
    return stat is not None and stat.state not in "ZXx"


def stop(proc: subprocess.Popen) -> None:
    """End a process this test started and everything it started (its group or children)."""
    for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


# -- the stack ----------------------------------------------------------------------------


@pytest.fixture
def stack(tmp_path):
    """A real agent (its socket 0660, group ATTACKER: a hostile user allowed to send) and
    a real supervisor. The socket lives in a directory others may enter."""
    run = Path(tempfile.mkdtemp(prefix="rg-trust-", dir="/tmp"))
    run.chmod(0o755)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    port = free_port()
    sock = run / "telemetry.sock"
    agent = Daemon(
        ["agent", "--bind", f"127.0.0.1:{port}", "--interval", "0.5", "--token-file",
         str(token), "--telemetry-socket", str(sock), "--node", "node-a",
         "--telemetry-group", str(ATTACKER)],
        tmp_path / "agent.log", f"http://127.0.0.1:{port}",
    )  # fmt: skip
    agent.socket = sock
    sup = start_supervisor(tmp_path, [agent.url])
    procs: list[subprocess.Popen] = []
    yield agent, sup, procs
    for p in procs:
        stop(p)
    sup.stop()
    agent.stop()
    shutil.rmtree(run, ignore_errors=True)


def metric(url: str, name: str, reason: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    want = f'{name}{{reason="{reason}"}} '
    for line in text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise AssertionError(f"{want!r} not on /metrics")


def ranks(agent) -> dict[tuple[str, int], dict]:
    view = http_json(agent.url + "/v1/ranks")
    return {(r["job"], r["rank"]): r for r in view["ranks"]}


def wait_step(agent, job: str, rank: int, step: int) -> dict:
    return wait_until(
        lambda: (r := ranks(agent).get((job, rank))) and (r["step"] or 0) >= step and r,
        60, f"{job} rank {rank} at step {step}",
    )  # fmt: skip


def victim_at_step(stack, step: int, job: str = "victim", period: float = 0.05):
    """(launcher, worker pid): `launch_victim` of `job`, stopped with the test, once its
    rank 0 reported `step`."""
    agent, _, procs = stack
    launcher, victim = launch_victim(agent.socket, job, period=period)
    procs.append(launcher)
    wait_step(agent, job, 0, step)
    return launcher, victim


def incidents(sup, job: str) -> list[dict]:
    return [i for i in http_json(sup.url + "/v1/incidents")["incidents"] if i["job"] == job]


def supervisor_passes(sup) -> float:
    import urllib.request

    text = urllib.request.urlopen(sup.url + "/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("rankguard_supervisor_passes_total"):
            return float(line.split()[-1])
    return 0.0


# -- attacks ------------------------------------------------------------------------------


@as_root
def test_socket_is_0660_with_the_configured_group_and_refuses_outsiders(stack):
    agent, _, _ = stack
    st_ = os.stat(agent.socket)
    assert (st_.st_mode & 0o777, st_.st_gid) == (0o660, ATTACKER)
    code = "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.sendto(b'x', __import__('sys').argv[1])"
    assert as_attacker(code, str(agent.socket)).returncode == 0  # a member may send
    out = as_attacker(code, str(agent.socket), uid=OUTSIDER)
    assert out.returncode != 0 and "PermissionError" in out.stderr  # the kernel refuses


@as_root
def test_a_foreign_registration_with_a_nan_does_not_get_the_real_rank_killed(stack):
    agent, sup, procs = stack
    launcher, victim = victim_at_step(stack, 8)
    out = as_attacker(
        """
import sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for i in range(20):
    s.sendto(record("victim", 0, step=10**6, loss="NaN"), sys.argv[1])
    time.sleep(0.05)
""",
        str(agent.socket),
    )
    assert out.returncode == 0, out.stderr
    wait_until(lambda: metric(agent.url, "rankguard_telemetry_rejected_total",
                              "foreign_owner") >= 20, 10, "20 foreign records counted")  # fmt: skip
    passes = supervisor_passes(sup)
    time.sleep(3)  # a dozen supervisor passes
    assert supervisor_passes(sup) > passes
    assert alive(victim) and launcher.poll() is None
    r = ranks(agent)[("victim", 0)]
    assert r["pid"] == victim and r["process_changes"] == 0
    assert all(s["loss"] == 2.0 for s in r["recent"])  # no NaN entered the window
    assert not [i for i in incidents(sup, "victim") if i["kind"] == "bad_numerics"]


@as_root
def test_forged_deaths_of_another_users_rank_do_not_stop_the_job(stack):
    agent, sup, procs = stack
    launcher, victim = victim_at_step(stack, 5)
    # Three short-lived processes, each claiming rank 1 of the job with restart 1, 2, 3
    # and exiting at once: a crash loop, if they were believed.
    out = as_attacker(
        """
import sys
for restart in (1, 2, 3):
    child = os.fork()
    if child == 0:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(record("victim", 1, world=2, restart=restart), sys.argv[1])
        os._exit(0)
    os.waitpid(child, 0)
    time.sleep(0.5)
""",
        str(agent.socket),
    )
    assert out.returncode == 0, out.stderr
    wait_until(lambda: metric(agent.url, "rankguard_telemetry_rejected_total",
                              "foreign_owner") >= 3, 10, "3 foreign records counted")  # fmt: skip
    time.sleep(3)
    assert launcher.poll() is None and alive(victim)
    assert ("victim", 1) not in ranks(agent)
    assert not incidents(sup, "victim")


@as_root
def test_a_fake_torchrun_of_another_user_is_never_signalled(stack):
    """The attacker's rank holds a pidfd on the victim's worker (whose parent's command
    line says torchrun): it was taken for the attacker's stand-in, and stop-job of the
    attacker's own job SIGTERMed the victim's launcher, SIGKILL killed the victim."""
    agent, _, procs = stack
    launcher, victim = victim_at_step(stack, 3)
    # The attacker's rank is a child of the attacker's own (non-torchrun) process.
    attacker = as_attacker(
        """
import sys
child = os.fork()
if child == 0:
    fd = os.pidfd_open(int(sys.argv[2]))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.sendto(record("evil", 0), sys.argv[1])
    print("sent", flush=True)
    time.sleep(60)
    os._exit(0)
print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
""",
        str(agent.socket),
        str(victim),
        wait=False,
    )
    procs.append(attacker)
    assert attacker.stdout.readline().strip() == "sent"
    evil = wait_until(lambda: ranks(agent).get(("evil", 0)), 10, "the attacker's rank")
    assert evil["stand_in"] is None  # a foreign process is no stand-in
    wait_until(lambda: metric(agent.url, "rankguard_control_refused_total",
                              "foreign_stand_in") >= 1, 10, "the refused stand-in counted")  # fmt: skip
    # What the supervisor would do to a crash-looping or hung "evil" job:
    answer = http_json(agent.url + "/v1/control/stop-job", body={"job": "evil"}, token=TOKEN)
    stopped = answer["result"]
    assert victim not in stopped["ranks_signalled"]
    assert launcher.pid not in stopped["launchers"]
    time.sleep(1)
    assert launcher.poll() is None and alive(victim)
    # its own rank got the SIGTERM
    assert attacker.stdout.readline().strip() == str(-signal.SIGTERM)


@as_root
def test_a_flood_from_another_user_does_not_get_a_busy_rank_killed_as_hung(stack):
    agent, sup, procs = stack
    launcher, victim = victim_at_step(stack, 20)  # enough steps for the 1 s hang floor to apply
    flood = as_attacker(
        """
import sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.setblocking(False)
data, sent, end = record("flood", 0), 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        s.sendto(data, sys.argv[1]); sent += 1
    except BlockingIOError:
        pass
print(sent)
""",
        str(agent.socket),
        "10",
        wait=False,
    )
    procs.append(flood)
    ages = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ages.append(ranks(agent)[("victim", 0)]["heartbeat_age_seconds"])
        time.sleep(0.2)
    sent = int(flood.communicate(timeout=30)[0])
    print(f"flood: {sent} datagrams in 10 s; victim's longest silence {max(ages):.2f} s")
    assert metric(agent.url, "rankguard_telemetry_rejected_total", "quota") > 0
    assert http_json(agent.url + "/v1/ranks")["telemetry"]["pressure_at"] is not None
    assert alive(victim) and launcher.poll() is None
    assert not [i for i in incidents(sup, "victim") if i["kind"] == "rank_hung"]


@as_root
def test_filling_the_table_with_invented_ranks_pushes_nobody_out(stack):
    agent, _, procs = stack
    launcher, victim = victim_at_step(stack, 1, period=0.2)
    # The attacker lives on after sending: the ranks of a process that ended make room for
    # new ones (its longest-ended first), and a loaded agent may judge the queue late.
    filler = as_attacker(
        """
import sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for i in range(1100):
    s.sendto(record(f"fill-{i}", 0), sys.argv[1])
    if i % 500 == 499:
        time.sleep(0.3)  # within the rate quota: this attack is about the table
print("sent", flush=True)
time.sleep(300)
""",
        str(agent.socket),
        wait=False,
    )
    procs.append(filler)
    assert filler.stdout.readline() == "sent\n", filler.stderr.read()
    # Wait on the JSON view, not /metrics: with 258 ranks the exposition is ~1 MB, slow to
    # render on a loaded machine, and its counters lag the receiver by one collection.
    last = {}  # the receiver's counters at the last look: what went wrong, if it did

    def fill_counted() -> bool:
        last.update(http_json(agent.url + "/v1/ranks", timeout=30)["telemetry"])
        return last["rejected"]["rank_quota"] >= 1100 - 256

    try:
        wait_until(fill_counted, 60, "the fill counted")
    except AssertionError as e:
        raise AssertionError(f"{e}; the receiver's counters: {last}") from None
    wait_until(lambda: metric(agent.url, "rankguard_telemetry_rejected_total", "rank_quota")
               >= 1100 - 256, 30, "the fill counted on /metrics")  # fmt: skip
    late, late_pid = victim_at_step(stack, 1, job="late", period=0.2)  # a new job still fits
    table = ranks(agent)
    assert table[("victim", 0)]["pid"] == victim
    assert sum(job.startswith("fill-") for job, _ in table) == 256
    import urllib.request

    def up_series() -> int:
        text = urllib.request.urlopen(agent.url + "/metrics", timeout=5).read().decode()
        return sum(line.startswith("rankguard_rank_up{") for line in text.splitlines())

    wait_until(lambda: up_series() == 258, 10, "258 ranks on /metrics")  # victim, late, 256
    time.sleep(1)
    text = urllib.request.urlopen(agent.url + "/metrics", timeout=5).read().decode()
    assert sum(line.startswith("rankguard_rank_up{") for line in text.splitlines()) == 258
    print(f"/metrics after the fill: {len(text)} bytes")


# -- ownership, quotas and launchers without daemons --------------------------------------

SLEEPER = """
import subprocess, sys
kids = [subprocess.Popen(["sleep", "60"]) for _ in range(int(sys.argv[1]))]
print(" ".join(str(k.pid) for k in kids), flush=True)
for k in kids:
    k.wait()
__import__("time").sleep(60)  # a launcher (a shell, say) outlives its ranks
"""


@pytest.fixture
def launchers():
    started: list[subprocess.Popen] = []

    def start(n: int = 2) -> tuple[subprocess.Popen, list[int]]:
        p = subprocess.Popen([sys.executable, "-c", SLEEPER, str(n)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
        started.append(p)
        return p, [int(x) for x in p.stdout.readline().split()]

    yield start
    for p in started:
        stop(p)


def rec(pid: int, job: str = "j", rank: int = 0, **kw) -> TelemetryRecord:
    f = dict(v=1, job=job, rank=rank, local_rank=rank, world_size=2, pid=pid, restart=0,
             step=1, phase="train", time=time.time(), step_seconds=0.1,
             data_wait_seconds=0.0, compute_seconds=0.1, comm_seconds=0.0,
             comm_exposed_seconds=0.0, optimizer_seconds=0.0, checkpoint_block_seconds=0.0,
             tokens_per_second=1.0, mfu=0.0, peak_memory_bytes=0, loss=2.0,
             checkpoint_step=None)  # fmt: skip
    f.update(kw)
    return TelemetryRecord(**f)


def test_a_rank_belongs_to_its_first_registrants_uid_and_launcher(launchers):
    a, (a1, a2) = launchers()
    b, (b1, b2) = launchers()
    with RankTable() as table:
        table.update(rec(a1), a1, uid=1000)
        table.update(rec(a2, restart=1), a2, uid=1000)  # torchrun's restart: accepted
        assert table.verified_pid("j", 0) == a2
        with pytest.raises(ForeignOwnerError, match="uid 1000"):
            table.update(rec(b1, restart=2), b1, uid=1000)  # another launcher
        with pytest.raises(ForeignOwnerError):
            table.update(rec(b1, restart=2), b1, uid=2000)  # another user
        with pytest.raises(ForeignOwnerError):
            table.update(rec(b1, rank=1), b1, uid=2000)  # another user's rank in this job
        with pytest.raises(ForeignOwnerError):
            table.update(rec(a2, step=2), a2, uid=2000)  # the same pid under another uid
        assert table.verified_pid("j", 0) == a2 and table.stats()["foreign"] == 4
        stop(a)  # the owner's launcher exits: `rankguard up` starts a new torchrun
        table.update(rec(b1, restart=3), b1, uid=1000)
        table.update(rec(b2, rank=1), b2, uid=1000)
        assert table.verified_pid("j", 0) == b1 and table.verified_pid("j", 1) == b2
        assert set(table.launchers("j")) == {(b.pid, read_proc_stat(b.pid).start_ticks)}


def test_the_owner_may_rerun_from_another_launcher_once_its_rank_ended(launchers):
    a, (a1,) = launchers(1)
    b, (b1,) = launchers(1)
    with RankTable() as table:
        table.update(rec(a1), a1, uid=1000)
        with pytest.raises(ForeignOwnerError):
            table.update(rec(b1), b1, uid=1000)  # two launchers fighting over a live rank
        os.kill(a1, signal.SIGKILL)  # the rank ends; its launcher (a shell, say) lives on
        wait_until(lambda: table.processes() == [], 5, "the rank's death")
        with pytest.raises(ForeignOwnerError):
            table.update(rec(b1), b1, uid=2000)  # never another user while `a` lives
        table.update(rec(b1), b1, uid=1000)  # the owner's rerun
        assert table.verified_pid("j", 0) == b1


def test_each_uid_holds_at_most_its_share_of_the_table(launchers):
    _, (p,) = launchers(1)
    with RankTable(max_ranks=8, max_ranks_per_uid=3, privileged_uids=frozenset({0})) as table:
        for i in range(3):
            table.update(rec(p, job=f"x{i}"), p, uid=1000)
        with pytest.raises(RankQuotaError, match="uid 1000"):
            table.update(rec(p, job="x3"), p, uid=1000)
        for i in range(5):
            table.update(rec(p, job=f"root{i}"), p, uid=0)  # root may fill the table
        assert table.stats()["over_quota"] == 1 and table.stats()["ranks"] == 8


def test_quota_is_a_token_bucket_per_uid_with_more_for_the_privileged():
    q = Quota(rate=10, burst=20, privileged=frozenset({0}), factor=10)
    assert sum(q.allow(1000, 0.0) for _ in range(50)) == 20  # the burst, then refusals
    assert sum(q.allow(1001, 0.0) for _ in range(50)) == 20  # another uid has its own
    assert sum(q.allow(1000, 1.0) for _ in range(50)) == 10  # refilled at 10/s
    assert sum(q.allow(0, 0.0) for _ in range(500)) == 200
    with pytest.raises(ValueError):
        Quota(rate=0, burst=1, privileged=frozenset())


def test_receiver_counts_quota_refusals_before_decoding(tmp_path):
    with RankTable() as table:
        r = TelemetryReceiver(tmp_path / "t.sock", table, quota_rate=5, quota_burst=5,
                              clock=lambda: 0.0)  # fmt: skip
        try:
            reasons = [r.handle(b"junk", os.getpid(), uid=4242) for _ in range(8)]
            assert reasons == ["not_json"] * 5 + ["quota"] * 3
            assert r.stats()["pressure_at"] is not None
            assert r.handle(encode(rec(os.getpid())), os.getpid()) is None  # own uid: more
        finally:
            r.close()


def test_a_recycled_launcher_pid_is_never_signalled(launchers):
    p, _ = launchers(1)
    start = read_proc_stat(p.pid).start_ticks
    assert not signal_exact(p.pid, start + 1, signal.SIGTERM)  # another start time
    time.sleep(0.2)
    assert p.poll() is None
    assert signal_exact(p.pid, start, signal.SIGTERM)
    assert p.wait(timeout=5) == -signal.SIGTERM
    assert process_uid(os.getpid()) == os.getuid()


def test_telemetry_options_are_checked(tmp_path):
    cfg = load_config(None, {"telemetry_group": "0", "telemetry_quota": 50.0})
    assert (cfg.telemetry_gid(), cfg.socket_mode, cfg.telemetry_quota) == (0, 0o660, 50.0)
    assert load_config(None, {"telemetry_batch_wait": 0.05}).telemetry_batch_wait == 0.05
    for bad in ({"telemetry_group": "no-such-group-rg"}, {"telemetry_quota": 0},
                {"telemetry_ranks_per_uid": 0}, {"telemetry_group": True},
                {"telemetry_batch_wait": 2.0}, {"telemetry_batch_wait": "soon"}):  # fmt: skip
        with pytest.raises(AgentConfigError):
            load_config(None, bad)
    out = subprocess.run([sys.executable, "-m", "rankguard.cli.main", "agent",
                          "--telemetry-group", "no-such-group-rg"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no group named 'no-such-group-rg'" in out.stderr


_uids = st.integers(0, 2**32 - 1)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.binary(max_size=2000)
    | st.builds(lambda job, rank, pid: encode(rec(pid, job=job, rank=rank)),
                st.sampled_from(["j", "k"]), st.integers(0, 1), st.just(os.getpid())),
    pid=st.none() | st.just(os.getpid()) | st.integers(0, 2**31 - 1),
    uid=_uids,
    truncated=st.booleans(),
)  # fmt: skip
def test_handle_never_raises(tmp_path_factory, data, pid, uid, truncated):
    path = tmp_path_factory.mktemp("h") / "t.sock"
    with RankTable(max_ranks=4, max_ranks_per_uid=2) as table:
        r = TelemetryReceiver(path, table)
        try:
            for _ in range(2):
                reason = r.handle(data, pid, truncated, uid=uid)
                assert reason is None or reason in RECEIVER_REASONS
            assert r.stats()["rejected"]["internal_error"] == 0
        finally:
            r.close()


# -- the hang detector: no kill on missing evidence ----------------------------------------


def _obs(ranks, pressure_age):
    node = dataclasses.replace(nodeobs(*ranks), telemetry_pressure_age=pressure_age)
    return ClusterObs(time=T0, nodes=(node,))


def test_busy_ranks_whose_records_are_lost_are_not_hung():
    busy = [dataclasses.replace(r, cpu_active_at=T0 - 1.0) for r in hung(2, age=10.0)]
    assert hang.detect(_obs(busy, None), None, CFG)  # a quiet socket: the silence counts
    assert not hang.detect(_obs(busy, 0.5), None, CFG)  # records being dropped: no finding
    assert hang.detect(_obs(busy, 30.0), None, CFG)  # the pressure is long over
    idle = [dataclasses.replace(r, cpu_active_at=T0 - 20.0) for r in hung(2, age=10.0)]
    assert hang.detect(_obs(idle, 0.5), None, CFG)  # silent and idle: hung, flood or not
    # one rank spinning while the other sleeps in the collective: still a hang
    spin = [busy[0], idle[1]]
    assert hang.detect(_obs(spin, 0.5), None, CFG)
