"""Multi-node, for real, on one machine: three hosts as network namespaces on a bridge
(tests/netns.py), each with its own agent and its own torchrun (c10d rendezvous on node
0, gloo over the namespace's interface), the supervisor in the root namespace polling the
agents over the bridge. One rank per node; every faulty run must finish all its steps.

Exactness: a run restarted at the same world size ends with the digest of the clean run;
a run that shrank from 3 to 2 nodes ends with the digest of a clean 2-node run resumed
from the same checkpoint (taken from the clean 3-node run: it is the same checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from contextlib import closing
from pathlib import Path

import pytest
from etcd_cluster import ETCD, SKIP_REASON, EtcdCluster
from harness import closing_fixture, http_json, read_json, start_supervisor, wait_until
from netns import Cluster, Node

pytestmark = [pytest.mark.netns, pytest.mark.slow]

STEPS = 80
# global batch 12 = 3 nodes x 2 micro x 2 accumulation = 2 nodes x 2 micro x 3 accumulation
TRAIN = ["--steps", str(STEPS), "--global-batch", "12", "--micro-batch", "2",
         "--ckpt-every", "10", "--keep", "0"]  # fmt: skip
# A lost node is declared dead after 3 missed 2 s heartbeats; a round with at least the
# minimum of nodes closes 3 s after that minimum joined.
RDZV = "last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"
RUN_TIMEOUT = 150
LONG = 300  # steps of a run that must outlast a drain


class Rig:
    """A netns cluster, optionally with agents and a supervisor, and one job on it."""

    def __init__(
        self,
        tmp: Path,
        n: int = 3,
        supervised: bool = True,
        control_rendezvous: bool = False,
        supervisor_args: tuple[str, ...] = (),
    ):
        self.tmp = tmp
        self.cluster = Cluster(tmp, n)
        self.supervisor = None
        self.procs: dict[str, object] = {}
        try:
            if control_rendezvous:  # the store beside the supervisor, on no training node
                self.cluster.start_rendezvous()
            if supervised:
                self.cluster.start_agents()
                self.supervisor = start_supervisor(
                    tmp, [n.agent_url for n in self.nodes], extra=list(supervisor_args)
                )
        except BaseException:
            self.close()
            raise

    @property
    def nodes(self) -> list[Node]:
        return self.cluster.nodes

    def train(self, *extra: str, job: str = "job", nnodes: str = "2:3", ckpt: Path | None = None):
        """Start torchrun on every node: the rendezvous host last, so the others are already
        waiting for its store and the first round has every node."""
        args = [*TRAIN, "--ckpt-dir", str(ckpt or self.tmp / "ckpt"),
                "--summary", str(self.tmp / "summary.json"), *extra]  # fmt: skip
        for node in [*self.nodes[1:], self.nodes[0]]:
            if node.index == 0 and len(self.nodes) > 1:
                time.sleep(2)  # the others import torch and poll for the store meanwhile
            self.procs[node.name] = self.cluster.torchrun(
                node, args, job=job, nnodes=nnodes, rdzv_conf=RDZV
            )
        return self.procs

    def wait(self, nodes: list[Node] | None = None, timeout: float = RUN_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        rcs = {}
        for node in nodes or self.nodes:
            try:
                rcs[node.name] = node.torchrun.wait(max(1, deadline - time.monotonic()))
            except Exception as exc:
                raise AssertionError(
                    f"{node.name}'s torchrun still running\n{self.logs()}"
                ) from exc
        return rcs

    def summary(self) -> dict:
        return read_json(self.tmp / "summary.json")

    def incidents(self, kind: str | None = None) -> list[dict]:
        found = http_json(self.supervisor.url + "/v1/incidents")["incidents"]
        return [i for i in found if kind is None or i["kind"] == kind]

    def ranks(self, node: Node) -> list[dict]:
        return http_json(node.agent_url + "/v1/ranks", timeout=2)["ranks"]

    def when(self, node: Node, pred, what: str, timeout: float = 90) -> dict:
        """The first live rank on `node` of the first incarnation that satisfies `pred`."""
        return wait_until(
            lambda: next((r for r in self.ranks(node) if r["state"] == "alive" and pred(r)), None),
            timeout, f"{what} on {node.name}",
        )  # fmt: skip

    def logs(self) -> str:
        sup = self.supervisor.log.read_text()[-3000:] if self.supervisor else ""
        return f"{self.cluster.logs()}\n--- supervisor\n{sup}"

    def close(self) -> None:
        try:
            if self.supervisor is not None:
                self.supervisor.stop()
        finally:
            self.cluster.close()


rig = closing_fixture(Rig)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The uninterrupted 3-node run (every checkpoint kept, for the shrink references)."""
    with closing(Rig(tmp_path_factory.mktemp("clean3"), supervised=False)) as rig:
        rig.train()
        assert set(rig.wait().values()) == {0}, rig.logs()
        s = rig.summary()
        assert (s["final_step"], s["world_size"], s["restart_count"]) == (STEPS, 3, 0), s
        return {"summary": s, "ckpt": rig.tmp / "ckpt"}


@pytest.fixture(scope="module")
def resumed_reference(clean, tmp_path_factory):
    """The digest of a clean run on `n` nodes resumed from the clean run's checkpoint at
    `step` (cached): what a run that shrank to `n` nodes after that checkpoint must end
    with (a different world size sums gradients in a different order)."""
    cache: dict[tuple[int, int], str] = {}

    def reference(n: int, step: int) -> str:
        if (n, step) not in cache:
            tmp = tmp_path_factory.mktemp(f"resumed{n}-{step}")
            name = f"step-{step:08d}"
            shutil.copytree(clean["ckpt"] / name, tmp / "ckpt" / name)
            with closing(Rig(tmp, n=n, supervised=False)) as rig:
                rig.train()
                assert set(rig.wait().values()) == {0}, rig.logs()
            s = rig.summary()
            assert (s["final_step"], s["world_size"], s["resumed_from"]) == (STEPS, n, step), s
            cache[(n, step)] = s["param_digest"]
        return cache[(n, step)]

    return reference


def assert_shrunk_exactly(rig: Rig, resumed_reference) -> dict:
    s = rig.summary()
    assert (s["final_step"], s["world_size"], s["global_batch"]) == (STEPS, 2, 12), s
    assert s["accum_steps"] == 3 and s["resumed_from"] is not None, s
    assert s["param_digest"] == resumed_reference(2, s["resumed_from"]), s
    return s


def lost(rig: Rig, node: Node) -> list[Node]:
    return [n for n in rig.nodes if n is not node]


# ---------------------------------------------------------------------------------- tests


def test_killed_rank_restarts_every_node_and_resumes_exactly(rig, clean):
    victim = rig.nodes[1]
    rig.train()
    rank = rig.when(victim, lambda r: (r["checkpoint_step"] or 0) >= 30, "checkpoint 30")
    before = {n.name: {r["pid"] for r in rig.ranks(n)} for n in rig.nodes}
    os.kill(rank["pid"], signal.SIGKILL)
    rcs = rig.wait()
    assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
    s = rig.summary()
    assert (s["final_step"], s["world_size"]) == (STEPS, 3), s
    assert s["resumed_from"] is not None and s["resumed_from"] >= 30, s
    if s["param_digest"] != clean["summary"]["param_digest"]:  # exact resume
        # seen once in a full suite on 2 busy cores, with the final loss identical: say
        # where each run's state came from, for the next one
        keys = (
            "resumed_from",
            "restart_count",
            "incarnation",
            "resume_sources",
            "final_loss",
            "steps_trained",
            "checkpoint_saves",
            "data_skips",
            "newest_validated_checkpoint",
        )
        seen = {"resumed": {k: s.get(k) for k in keys},
                "clean": {k: clean["summary"].get(k) for k in keys}}  # fmt: skip
        pytest.fail(f"not the uninterrupted run's parameters: {json.dumps(seen)}\n{rig.logs()}")
    (inc,) = rig.incidents("rank_dead")
    assert (inc["rank"], inc["node"]) == (rank["rank"], victim.name), inc
    assert inc["state"] == "resolved" and inc["resumed_step"] == s["resumed_from"], inc
    # the whole job restarted: every node's rank is a new process, and it finished
    incarnations = set()
    for node in rig.nodes:
        (r,) = rig.ranks(node)
        assert r["state"] == "finished" and r["pid"] not in before[node.name], (node.name, r)
        incarnations.add(r["restart"])
    # one incarnation number on every node, though torchrun's restart counts differ there
    assert incarnations == {1}, incarnations


# In soak, not the default suite (its time): the same shrink to two nodes from disk is run
# by the partition and hardware-fault tests, a lost node by the rank-0 and replica tests.
@pytest.mark.soak
def test_lost_node_job_continues_on_two_nodes(rig, resumed_reference):
    victim = rig.nodes[2]
    rig.train()
    rig.when(rig.nodes[0], lambda r: (r["checkpoint_step"] or 0) >= 30, "checkpoint 30")
    rig.cluster.kill_node(victim)
    rcs = rig.wait(lost(rig, victim))
    assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
    assert_shrunk_exactly(rig, resumed_reference)
    wait_until(lambda: rig.incidents("agent_unreachable"), 10, "the lost node's incident")
    (gone,) = rig.incidents("agent_unreachable")
    assert victim.agent_url in gone["summary"], gone
    (dead,) = rig.incidents("rank_dead")  # the survivors' ranks failed with their peer


def test_partitioned_node_job_continues_without_it(rig, resumed_reference):
    victim = rig.nodes[2]
    rig.train()
    rig.when(rig.nodes[0], lambda r: (r["checkpoint_step"] or 0) >= 30, "checkpoint 30")
    cut_at = time.time()
    rig.cluster.cut_link(victim)
    # the monitoring fault is reported, and is not by itself a reason to act (it once took
    # over 15 s: the loop waited on a stacks request to the cut-off agent)
    wait_until(lambda: rig.incidents("agent_unreachable"), 15, "the unreachable incident")
    (gone,) = rig.incidents("agent_unreachable")
    assert victim.agent_url in gone["summary"] and gone["actions"] == [], gone
    print(f"agent_unreachable recorded {gone['detected_at'] - cut_at:.1f} s after the cut")
    # hang detection (about 10 s here) + re-rendezvous (6 s keep-alive, 3 s last call)
    rig.when(rig.nodes[0], lambda r: r["world_size"] == 2, "the job to go on at 2 nodes", 40)
    rcs = rig.wait(lost(rig, victim))
    assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
    assert_shrunk_exactly(rig, resumed_reference)
    # the hang was explained by the partition and ended through a reachable rank
    hangs = rig.incidents("rank_hung")
    assert len(hangs) == 1, json.dumps(hangs, indent=1)
    (hang,) = hangs
    assert hang["evidence"]["missing_ranks"] == 1, hang
    (act,) = hang["actions"]
    assert act["kind"] == "kill_rank" and act["target"]["node"] != victim.name, act


def test_supervisor_cut_off_from_one_agent_does_not_touch_training(rig, clean):
    victim = rig.nodes[1]
    rig.train()
    rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 10, "step 10")
    rig.cluster.cut_head_route(victim)
    wait_until(lambda: rig.incidents("agent_unreachable"), 20, "the unreachable incident")
    rig.cluster.restore_head_route(victim)
    rcs = rig.wait()
    assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
    s = rig.summary()
    assert (s["final_step"], s["restart_count"]) == (STEPS, 0), s
    assert s["param_digest"] == clean["summary"]["param_digest"]
    (inc,) = rig.incidents("agent_unreachable")
    assert inc["node"] is not None and victim.agent_url in inc["summary"], inc
    assert [i for i in rig.incidents() if i["kind"] != "agent_unreachable"] == []


def test_node_with_hardware_fault_is_excluded(rig, resumed_reference):
    from rankguard.agent.nvml_double import make_double, write_state

    victim = rig.nodes[2]
    rig.train()
    rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 15, "step 15")
    write_state(victim.nvml_state, make_double(n_gpus=1, xid_events=[{"gpu": 0, "xid": 79}]))
    rcs = rig.wait(lost(rig, victim))
    assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
    assert victim.torchrun.wait(30) != 0
    assert_shrunk_exactly(rig, resumed_reference)
    (fault,) = rig.incidents("node_fault")
    assert fault["node"] == victim.name and "xid_79" in fault["key"], fault
    (act,) = fault["actions"]
    assert (act["kind"], act["ok"]) == ("exclude_node", True), act
    stopped = {k for k in act["result"] or {} if k != "scheduler"}  # scheduler: the drain
    assert len(stopped) == 1 and victim.name in stopped.pop(), act  # stop-job on that node only
    assert act["result"]["scheduler"]["argv"][:2] == ["scontrol", "update"], act


def test_a_failing_gpu_is_drained_once_the_job_has_saved_when_asked(tmp_path):
    """Predictive drain: node 2's GPU trends toward failure (correctable ECC errors piling
    up and a row remap pending, replayed through the NVML double). The job takes no
    scheduled checkpoint in this run; the supervisor asks every rank to save at a step two
    seconds ahead, waits for that checkpoint, then excludes the node; the job goes on
    without it from the state saved at the drain."""
    from rankguard.agent.nvml_double import make_double, write_state

    config = tmp_path / "supervisor.toml"
    config.write_text("[policy]\npredictive_drain = true\n"
                      "predictive_drain_save_lead_seconds = 2\n")  # fmt: skip
    rig = Rig(tmp_path, supervisor_args=("--config", str(config)))
    try:
        victim = rig.nodes[2]
        # long enough that the save asked for (2 s of steps ahead) comes before the end
        rig.train("--ckpt-every", "1000", "--steps", str(LONG))
        rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 5, "step 5")
        rows = {"correctable": 3, "uncorrectable": 0, "pending": True, "failure": False}
        write_state(victim.nvml_state, make_double(
            n_gpus=1, ecc={"corrected": 400, "uncorrected": 0}, remapped_rows=rows))  # fmt: skip
        rcs = rig.wait(lost(rig, victim))
        assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
        # the pending remap is reported on its own too (row_remap_pending), not acted on
        (fault,) = [i for i in rig.incidents("node_fault") if i["key"].endswith(":gpu_failing")]
        assert fault["node"] == victim.name, fault
        assert fault["cause"] == "gpu" and "row remaps pending" in fault["summary"], fault
        (asked,) = [e["detail"] for e in fault["events"] if e["what"] == "save requested"]
        assert asked["job"]["agents"] == 3 and "error" not in asked["job"], asked
        (act,) = fault["actions"]
        assert act["kind"] == "exclude_node" and act["ok"], act
        assert fault["action_reason"] == (
            "predictive drain: a failing GPU, its jobs' next checkpoint was taken"
        ), fault
        s = rig.summary()
        assert (s["final_step"], s["world_size"], s["global_batch"]) == (LONG, 2, 12), s
        # resumed from the save it was asked for: the only checkpoint this run took
        assert s["resumed_from"] == asked["job"]["step"], (s, asked)
    finally:
        rig.close()


def test_lost_rank0_node_job_continues_with_rendezvous_on_the_control_node(
    tmp_path, resumed_reference
):
    """The rendezvous store runs in the root namespace (`rankguard rendezvous`, the control
    node): losing the node that hosts rank 0 leaves the job running on the other two, from
    the newest validated checkpoint, with the global batch kept."""
    rig = Rig(tmp_path, control_rendezvous=True)
    try:
        rig.train()
        rig.when(rig.nodes[0], lambda r: (r["checkpoint_step"] or 0) >= 30, "checkpoint 30")
        # the rendezvous orders nodes by its own rule: find the node that holds rank 0
        (victim,) = [n for n in rig.nodes if any(r["rank"] == 0 for r in rig.ranks(n))]
        rig.cluster.kill_node(victim)
        rcs = rig.wait(lost(rig, victim))
        assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
        s = assert_shrunk_exactly(rig, resumed_reference)
        assert s["resumed_from"] >= 30, s
        # the store never left the control node: it outlived the job
        assert rig.cluster.rendezvous.poll() is None, rig.cluster.rendezvous.tail()
        wait_until(lambda: rig.incidents("agent_unreachable"), 10, "the lost node's incident")
        (gone,) = rig.incidents("agent_unreachable")
        assert victim.agent_url in gone["summary"], gone
    finally:
        rig.close()


@pytest.mark.skipif(ETCD is None, reason=SKIP_REASON)
def test_a_job_rendezvouses_on_etcd_through_the_loss_of_any_one_member(tmp_path, clean):
    """The production rendezvous: a three-member etcd cluster in the root namespace
    (`--rdzv-endpoint etcd://M0,M1,M2`). Member 0, the one every client asks first, is
    SIGKILLed mid-training and started again; a rank is killed at step 45, and member 1 is
    SIGKILLed as soon as torchrun tears the group down, so the restart's rendezvous runs
    on the two left (one of them maybe electing a new leader). The job restarts once from
    its newest validated checkpoint and ends with the clean run's digest."""
    rig = Rig(tmp_path)
    etcd = EtcdCluster(tmp_path, host=rig.cluster.head_addr)
    killed_in_rendezvous: list[float] = []
    try:
        rig.cluster.etcd_endpoint = etcd.endpoint
        rig.train("--fault", "kill:step=45:rank=1")
        rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 15, "step 15")
        etcd.kill(0)
        rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 25, "step 25 without member 0")
        etcd.start(0)
        etcd.wait_healthy([0])

        def torn_down() -> bool:
            return any("Worker group FAILED" in n.torchrun.tail() or
                       "Restarting worker group" in n.torchrun.tail() for n in rig.nodes)  # fmt: skip

        wait_until(torn_down, 90, "the group torn down after the rank's death", interval=0.02)
        etcd.kill(1)
        killed_in_rendezvous.append(time.monotonic())
        rcs = rig.wait()
        assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
        s = rig.summary()
        assert (s["final_step"], s["world_size"]) == (STEPS, 3), s
        # the newest validated checkpoint: 40, or 30 when 40's async save was still being
        # written at the kill (seen under CI load)
        assert s["resumed_from"] in (30, 40), s
        assert s["param_digest"] == clean["summary"]["param_digest"], s
    finally:
        etcd.close()
        rig.close()


def test_lost_node_resumes_from_its_snapshot_replica_not_from_disk(tmp_path, resumed_reference):
    """Tier 0 across nodes: a snapshot holder per node (TCP between nodes, token-checked),
    each replicating to the next. The node holding rank 1 is lost with its holder; the other
    two go on at world size 2 from the newest snapshot, which they can only complete with
    rank 1's replica on the lost node's successor; it is newer than the newest disk
    checkpoint, and the run ends exactly as a clean 2-node run resumed from that step."""
    rig = Rig(tmp_path, control_rendezvous=True)
    try:
        rig.cluster.start_holders()
        # from step 31 every step is 0.5 s slower (incarnation 0 only: the fault file names
        # the job-wide incarnation), so the kill lands after snapshot 30 and well before
        # disk checkpoint 50; resuming from 30 shares the other tests' 2-node reference
        faults = tmp_path / "faults"
        faults.write_text("comm-delay:step=31:seconds=0.5:rank=0\n")
        rig.train("--ckpt-every", "25", "--snapshot-every", "10", "--fault-file", str(faults))
        seen = rig.when(rig.nodes[0], lambda r: (r["step"] or 0) >= 32
                        and (r["checkpoint_step"] or 0) >= 25, "step 32")  # fmt: skip
        (victim,) = [n for n in rig.nodes if any(r["rank"] == 1 for r in rig.ranks(n))]
        disk_at_kill = seen["checkpoint_step"]
        rig.cluster.kill_node(victim)
        rcs = rig.wait(lost(rig, victim))
        assert set(rcs.values()) == {0}, f"{rcs}\n{rig.logs()}"
        s = assert_shrunk_exactly(rig, resumed_reference)
        assert disk_at_kill == 25 and s["resumed_from"] in (30, 40), (disk_at_kill, s)
        # new rank 1 loaded saved rank 1's state: only the lost node's replica had it
        assert s["resume_sources"][1].startswith("replica@"), s["resume_sources"]
        successor = rig.nodes[(victim.index + 1) % 3]
        assert successor.holder_addr in s["resume_sources"][1] or (
            s["resume_sources"][1] == f"replica@{successor.holder_socket}"
        ), s["resume_sources"]
    finally:
        rig.close()
