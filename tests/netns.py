"""Several hosts on one machine: one network namespace per node, joined by a bridge.

    root namespace                          node namespaces (one per node)
    ┌──────────────────────────┐            ┌────────────────────────────────────┐
    │ supervisor (127.0.0.1)   │            │ <p>n0: <p>v0 10.R.S.1/24            │
    │ bridge <p>br 10.R.S.254  ├─<p>h0 ═════┤   rankguard agent 10.R.S.1:9400     │
    │                          ├─<p>h1 ═══  │   torchrun (c10d host, :29400)      │
    │                          ├─<p>h2 ═══  │     trainer rank(s), gloo on <p>v0  │
    └──────────────────────────┘            └────────────────────────────────────┘

Every name starts with a per-run prefix `rgmn<4 hex>` (interface names must fit in 15
characters). The owner's pid is written to `OWNERS/<prefix>.pid`; a run first removes
the namespaces, links and processes of every `rgmn*` prefix whose owner is dead (a
crashed earlier run), never those of a live one. `Cluster.close()` removes everything
it made, and is safe to call twice or after a half-done set-up.

Only what a real multi-host deployment has: each node's agent binds its own address, the
supervisor reaches the agents over the bridge, torchrun's c10d rendezvous runs on node 0's
address, and gloo uses each namespace's own interface (`GLOO_SOCKET_IFNAME`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import TOKEN, http_json, wait_until

from rankguard.contract.secrets import write_secret_file

PREFIX_BASE = "rgmn"
OWNERS = Path("/run/rankguard-netns-tests")
AGENT_PORT = 9400
RDZV_PORT = 29400
HOLDER_PORT = 7410
HEAD = 254  # the root namespace's host number on the bridge


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    out = sh("ip", "-o", "link", "show", check=False).stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[@:]", out, re.M)]


def netns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def kill_namespace_processes(ns: str, sig: int = signal.SIGKILL, wait: float = 10) -> list[int]:
    """Signal every process in `ns` (SIGKILL by default) and wait until none is left."""
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while True:
        pids = netns_pids(ns)
        if not pids:
            return killed
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                killed.append(pid)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes in {ns} survive {signal.Signals(sig).name}: {pids}")
        time.sleep(0.05)


def remove_prefix(prefix: str) -> None:
    """Kill the processes in, and delete, every namespace and link named `prefix*`."""
    for ns in namespaces():
        if ns.startswith(prefix):
            kill_namespace_processes(ns)
            sh("ip", "netns", "del", ns, check=False)
    for link in links():  # deleting one end of a veth deletes its peer too
        if link.startswith(prefix):
            sh("ip", "link", "del", link, check=False)
    with contextlib.suppress(FileNotFoundError):
        (OWNERS / f"{prefix}.pid").unlink()


def clean_leftovers() -> list[str]:
    """Remove what crashed earlier runs left behind (owner dead or unknown). Returns the
    prefixes removed."""
    found = {n[: len(PREFIX_BASE) + 4] for n in namespaces() + links() if n.startswith(PREFIX_BASE)}
    if OWNERS.is_dir():
        found |= {p.stem for p in OWNERS.glob(f"{PREFIX_BASE}*.pid")}
    removed = []
    for prefix in sorted(found):
        try:
            owner = int((OWNERS / f"{prefix}.pid").read_text())
        except (OSError, ValueError):
            owner = None
        if owner is not None and _pid_alive(owner):
            continue  # a run in progress (this one included: it may hold several clusters)
        remove_prefix(prefix)
        removed.append(prefix)
    return removed


class NodeProc:
    """A process started inside a node's namespace, its output kept in a log file."""

    def __init__(self, ns: str | None, argv: list[str], log: Path, env: dict | None = None):
        self.log, self.argv = log, argv
        with open(log, "w") as out:  # ns None: the root namespace (the control node)
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv] if ns else argv,
                stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 15) -> int | None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class Node:
    def __init__(self, cluster: Cluster, index: int):
        p = cluster.prefix
        self.index = index
        self.name = f"node{index}"
        self.ns = f"{p}n{index}"
        self.host_if = f"{p}h{index}"  # bridge side, root namespace
        self.if_name = f"{p}v{index}"  # inside the namespace
        self.addr = f"{cluster.subnet}.{index + 1}"
        self.agent_url = f"http://{self.addr}:{AGENT_PORT}"
        self.socket = cluster.tmp / f"{self.name}.sock"
        self.nvml_state = cluster.tmp / f"{self.name}-nvml.json"
        self.agent: NodeProc | None = None
        self.torchrun: NodeProc | None = None
        self.holder: NodeProc | None = None  # tier-0 snapshot holder (start_holders)
        self.holder_socket = cluster.tmp / f"{self.name}-holder.sock"
        self.holder_addr = f"{self.addr}:{HOLDER_PORT}"

    def exec(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns, *cmd, check=check)


class Cluster:
    """`n` nodes on a private /24, created on construction; `close()` removes them."""

    def __init__(self, tmp: Path, n: int = 3):
        self.tmp = tmp
        self.procs: list[NodeProc] = []
        clean_leftovers()
        self.prefix = f"{PREFIX_BASE}{secrets.token_hex(2)}"
        # a /24 per run from the prefix, inside 10.224.0.0/12 (unlikely to be routed here)
        h = int(self.prefix[-4:], 16)
        self.subnet = f"10.{224 + (h >> 12)}.{(h >> 4) & 0xFF}"
        self.head_addr = f"{self.subnet}.{HEAD}"
        self.bridge = f"{self.prefix}br"
        self.nodes = [Node(self, i) for i in range(n)]
        self.rendezvous: NodeProc | None = None  # `rankguard rendezvous` on the control node
        self.etcd_endpoint: str | None = None  # `etcd://...`: the rankguard backend on etcd
        OWNERS.mkdir(parents=True, exist_ok=True)
        (OWNERS / f"{self.prefix}.pid").write_text(str(os.getpid()))
        self.token_file = tmp / "token"
        write_secret_file(self.token_file, TOKEN)
        self.rdzv_secret = tmp / "rendezvous.key"
        write_secret_file(self.rdzv_secret, "a-rendezvous-secret-for-the-netns-tests")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.head_addr}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            sh("ip", "netns", "add", node.ns)
            sh("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", node.if_name)
            sh("ip", "link", "set", node.if_name, "netns", node.ns)
            sh("ip", "link", "set", node.host_if, "master", self.bridge)
            sh("ip", "link", "set", node.host_if, "up")
            node.exec("ip", "addr", "add", f"{node.addr}/24", "dev", node.if_name)
            node.exec("ip", "link", "set", node.if_name, "up")
            node.exec("ip", "link", "set", "lo", "up")

    # -- processes ------------------------------------------------------------------------
    def spawn(
        self, node: Node | None, argv: list[str], log: str, env: dict | None = None
    ) -> NodeProc:
        proc = NodeProc(node.ns if node else None, argv, self.tmp / log, env)
        self.procs.append(proc)
        return proc

    def start_agents(self, interval: float = 1.0, nodes: list[Node] | None = None) -> None:
        from rankguard.agent.nvml_double import make_double, write_state

        nodes = self.nodes if nodes is None else nodes
        for node in nodes:
            write_state(node.nvml_state, make_double(n_gpus=1))
            node.agent = self.spawn(node, [
                sys.executable, "-m", "rankguard.cli.main", "agent",
                "--bind", f"{node.addr}:{AGENT_PORT}", "--node", node.name,
                "--interval", str(interval), "--token-file", str(self.token_file),
                "--telemetry-socket", str(node.socket), "--nvml-double", str(node.nvml_state),
                "--expected-gpus", "1",
            ], f"agent-{node.name}.log")  # fmt: skip
        for node in nodes:  # from the root namespace, over the bridge
            wait_until(
                lambda nd=node: nd.agent.poll() is None and http_json(nd.agent_url + "/healthz")["ok"],
                60, f"agent of {node.name} ({node.agent.tail()})",
            )  # fmt: skip

    def start_holders(self) -> None:
        """A snapshot holder per node (unix socket for its ranks, TCP on its address with
        the cluster token), replicating to the next node of the ring, then the one after
        (which takes over while the next is lost)."""
        n = len(self.nodes)
        for node in self.nodes:
            ring = [self.nodes[(node.index + k) % n].holder_addr for k in range(1, n)]
            node.holder = self.spawn(node, [
                sys.executable, "-m", "rankguard.cli.main", "snapshot-holder", "run",
                "--socket", str(node.holder_socket), "--bind", node.holder_addr,
                "--peer", ",".join(ring), "--token-file", str(self.token_file),
            ], f"holder-{node.name}.log")  # fmt: skip
        for node in self.nodes:
            wait_until(lambda nd=node: "snapshot holder on" in nd.holder.tail(), 60,
                       f"snapshot holder of {node.name} ({node.holder.tail()})")  # fmt: skip

    def holder_env(self, node: Node) -> dict:
        """The trainer's tier-0 settings on `node`: its own holder, every other as a peer."""
        others = [n.holder_addr for n in self.nodes if n is not node]
        return {"RANKGUARD_SNAPSHOT_HOLDER": str(node.holder_socket),
                "RANKGUARD_SNAPSHOT_PEERS": ",".join(others),
                "RANKGUARD_SNAPSHOT_TOKEN_FILE": str(self.token_file)}  # fmt: skip

    def start_rendezvous(self) -> NodeProc:
        """`rankguard rendezvous` in the root namespace, reached by every node at the head
        address: torchrun then uses `--rdzv-backend rankguard` and no node hosts the store.
        Call again after `rendezvous.stop()` to restart it on the same port."""
        self.rendezvous = self.spawn(None, [
            sys.executable, "-m", "rankguard.cli.main", "rendezvous", "--port", str(RDZV_PORT),
        ], f"rendezvous-{len(self.procs)}.log")  # fmt: skip
        wait_until(
            lambda: "listening" in self.rendezvous.tail(), 60,
            f"the rendezvous service ({self.rendezvous.tail()})",
        )  # fmt: skip
        return self.rendezvous

    def torchrun(
        self,
        node: Node,
        trainer_args: list[str],
        *,
        job: str,
        nnodes: str,
        nproc: int = 1,
        max_restarts: int = 3,
        rdzv_conf: str = "",
        log: str | None = None,
    ) -> NodeProc:
        """torchrun of the trainer on `node`: rendezvous on the etcd cluster at
        `etcd_endpoint` when set, through `rankguard rendezvous` on the control node once
        `start_rendezvous` ran, else c10d hosted on node 0."""
        host = self.nodes[0]
        if self.etcd_endpoint is not None:
            backend, endpoint, conf = "rankguard", self.etcd_endpoint, rdzv_conf
        elif self.rendezvous is not None:
            backend, endpoint, conf = "rankguard", f"{self.head_addr}:{RDZV_PORT}", rdzv_conf
        else:
            backend, endpoint = "c10d", f"{host.addr}:{RDZV_PORT}"
            conf = f"is_host={int(node is host)}" + (f",{rdzv_conf}" if rdzv_conf else "")
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", nnodes, f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
            "--rdzv-id", job, "--rdzv-conf", conf, "--local-addr", node.addr,
            "--monitor-interval", "0.1",
            "-m", "rankguard.trainer", "--preset", "tiny", "--log-every", "0", "--job", job,
            *trainer_args,
        ]  # fmt: skip
        env = {
            **(self.holder_env(node) if node.holder else {}),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": node.if_name,
            "RANKGUARD_TELEMETRY_SOCKET": str(node.socket) if node.agent else "off",
            "PYTHONUNBUFFERED": "1",
            # A fresh worker store every rendezvous round, hosted by the round's rank 0 (see
            # docs/architecture.md, "Multi-node tests"): torchrun's shared store outlives
            # rounds and nodes, and a membership change does not bump the restart count.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "LOGLEVEL": "INFO",
            # the rankguard backend signs the rendezvous state with the job's secret
            "RANKGUARD_RDZV_SECRET_FILE": str(self.rdzv_secret),
        }
        node.torchrun = self.spawn(node, argv, log or f"torchrun-{job}-{node.name}.log", env)
        return node.torchrun

    # -- faults ---------------------------------------------------------------------------
    def kill_node(self, node: Node) -> list[int]:
        """Power loss: SIGKILL every process in the node's namespace."""
        return kill_namespace_processes(node.ns)

    def cut_link(self, node: Node) -> None:
        """Partition: the node's cable is pulled (its bridge port goes down)."""
        sh("ip", "link", "set", node.host_if, "down")

    def restore_link(self, node: Node) -> None:
        sh("ip", "link", "set", node.host_if, "up")

    def cut_head_route(self, node: Node) -> None:
        """Only the head (supervisor) <-> this node path: the node drops its packets to the
        head's address; its traffic with the other nodes is untouched."""
        node.exec("ip", "route", "add", "blackhole", f"{self.head_addr}/32")

    def restore_head_route(self, node: Node) -> None:
        node.exec("ip", "route", "del", "blackhole", f"{self.head_addr}/32", check=False)

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs:
            proc.stop(timeout=5)
        remove_prefix(self.prefix)

    def logs(self, n: int = 3000) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.tail(n)}" for p in self.procs)
