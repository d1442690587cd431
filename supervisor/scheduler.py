"""Persistent node exclusion: ask the scheduler to keep a faulty node out, and let it back
only after its health check passes (Slurm through a command, Kubernetes through its API:
supervisor/kube_nodes.py).

Excluding a node (`exclude_node`) stops the job's processes there, but the scheduler would
place the next job (or torchrun's next restart) on it again. So on a hardware fault the
supervisor also runs `drain_command` (Slurm: `scontrol update ... state=drain`), and
remembers the node in the incident database (table `scheduler_exclusions`, so a restarted
supervisor still lets it back). Every pass, `readmit` (pure) counts each drained node's
healthy agent verdicts in a row; after `resume_after_healthy_passes` of them it runs
`resume_command`. Commands are run without a shell: the template is split like a shell
would, then `{node}` and `{reason}` are filled into each argument, so a reason with spaces
or quotes stays one argument and cannot inject anything.
"""

from __future__ import annotations

import logging
import shlex
import sqlite3
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .kube_nodes import EFFECTS, KubeError, KubeNodes
from .state import ClusterObs

log = logging.getLogger("rankguard.supervisor.scheduler")

SLURM_DRAIN = "scontrol update nodename={node} state=drain reason={reason}"
SLURM_RESUME = "scontrol update nodename={node} state=resume"
PLACEHOLDERS = ("node", "reason")
REASON_MAX_CHARS = 200  # a reason is for people reading `sinfo -R`, not the whole evidence
BACKENDS = ("command", "kubernetes")


class SchedulerError(ValueError):
    """The drained-node table cannot be used (one line)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """[scheduler]: keep nodes excluded for a hardware fault out of the scheduler."""

    drain: bool = True  # false: exclusion stops the job's processes only
    # "command": drain_command and resume_command (Slurm's scontrol by default);
    # "kubernetes": a taint and a node condition through the API (supervisor/kube_nodes.py)
    backend: str = "command"
    drain_command: str = SLURM_DRAIN
    resume_command: str = SLURM_RESUME
    kubernetes_taint_effect: str = "NoSchedule"  # of rankguard.io/unhealthy
    kubernetes_cordon: bool = False  # also mark the node unschedulable (lifted on resume)
    resume_after_healthy_passes: int = 240  # one minute at the default 0.25 s interval
    command_timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.kubernetes_taint_effect not in EFFECTS:
            raise ValueError(f"kubernetes_taint_effect must be one of {', '.join(EFFECTS)}, "
                             f"got {self.kubernetes_taint_effect!r}")  # fmt: skip
        for name in ("drain_command", "resume_command"):
            template = getattr(self, name)
            try:
                argv = shlex.split(template)
                for arg in argv:
                    arg.format(**dict.fromkeys(PLACEHOLDERS, ""))
            except (ValueError, KeyError, IndexError) as exc:
                raise ValueError(
                    f"{name}: {template!r} is not a command template with only {{node}} and "
                    f"{{reason}} ({exc})"
                ) from None
            if not argv:
                raise ValueError(f"{name} must not be empty")
            if "{node}" not in template:
                raise ValueError(f"{name} must name the node: {{node}}")
        if (
            isinstance(self.resume_after_healthy_passes, bool)
            or self.resume_after_healthy_passes < 1
        ):
            raise ValueError("resume_after_healthy_passes must be an integer >= 1")
        if not self.command_timeout_seconds > 0:
            raise ValueError("command_timeout_seconds must be > 0")


def command(template: str, node: str, reason: str = "") -> list[str]:
    """The argv of a command template, placeholders filled per argument."""
    return [arg.format(node=node, reason=reason) for arg in shlex.split(template)]


@dataclass(frozen=True)
class Drained:
    node: str
    reason: str
    drained_at: float
    healthy_passes: int = 0  # the agent's verdict was healthy this many passes in a row


def readmit(
    drained: Mapping[str, Drained], verdicts: Mapping[str, str | None], passes_needed: int
) -> tuple[dict[str, Drained], list[str]]:
    """Pure: the drained nodes after one pass, and those to resume now.

    `verdicts`: each node's agent verdict this pass (None: unreachable, or not polled).
    Only "healthy" counts; anything else starts the count again, so a node that flaps
    between healthy and unhealthy never comes back."""
    after: dict[str, Drained] = {}
    resume: list[str] = []
    for node, d in sorted(drained.items()):
        count = d.healthy_passes + 1 if verdicts.get(node) == "healthy" else 0
        if count >= passes_needed:
            resume.append(node)
        after[node] = Drained(d.node, d.reason, d.drained_at, count)
    return after, resume


class CommandNodes:
    """The command backend: `drain_command` and `resume_command` (Slurm's by default)."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg

    def drain(self, node: str, reason: str) -> dict:
        return self._run(command(self.cfg.drain_command, node, reason))

    def resume(self, node: str) -> dict:
        return self._run(command(self.cfg.resume_command, node))

    def _run(self, argv: list[str]) -> dict:
        """The command's outcome as JSON-able facts for the action's result."""
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=self.cfg.command_timeout_seconds,
                check=False,
            )  # fmt: skip
        except FileNotFoundError:
            return {"argv": argv, "ok": False, "error": f"{argv[0]}: command not found"}
        except subprocess.TimeoutExpired:
            why = f"timed out after {self.cfg.command_timeout_seconds:g}s"
            return {"argv": argv, "ok": False, "error": why}
        except OSError as exc:
            return {"argv": argv, "ok": False, "error": f"{argv[0]}: {exc.strerror or exc}"}
        out = {"argv": argv, "ok": done.returncode == 0, "returncode": done.returncode}
        if done.returncode != 0:
            out["error"] = (done.stderr or done.stdout).strip()[-500:] or f"exit {done.returncode}"
        return out


class Scheduler:
    """The I/O around `readmit`: drain and resume through the backend (`nodes`), keep the
    drained nodes in SQLite."""

    def __init__(
        self, cfg: SchedulerConfig, db: str | Path | None, clock=None, kube_api=None
    ) -> None:
        """`kube_api`: a CoreV1Api for the kubernetes backend (else the pod's or the
        kubeconfig's)."""
        import time

        self.cfg = cfg
        self.clock = clock or time.time
        # what takes a node out and lets it back: drain(node, reason), resume(node)
        self.nodes: CommandNodes | KubeNodes = CommandNodes(cfg)
        if cfg.drain and cfg.backend == "kubernetes":
            try:
                self.nodes = KubeNodes(kube_api, cfg.kubernetes_taint_effect,
                                       cfg.kubernetes_cordon)  # fmt: skip
            except KubeError as exc:
                raise SchedulerError(f"[scheduler] backend = kubernetes: {exc}") from None
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(
                str(db) if db is not None else ":memory:", isolation_level=None,
                check_same_thread=False,
            )  # fmt: skip
            self._conn.execute("PRAGMA busy_timeout = 5000")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS scheduler_exclusions ("
                " node TEXT PRIMARY KEY, reason TEXT NOT NULL, drained_at REAL NOT NULL)"
            )
            rows = self._conn.execute("SELECT node, reason, drained_at FROM scheduler_exclusions")
            self.drained: dict[str, Drained] = {n: Drained(n, r, t) for n, r, t in rows}
        except sqlite3.Error as exc:
            raise SchedulerError(f"{db}: cannot keep the drained nodes there: {exc}") from None

    def exclude(self, node: str, reason: str) -> dict | None:
        """Drain the node; remembered only when the scheduler accepted it (a node that was
        never drained must not be resumed by us either). None when draining is off."""
        if not self.cfg.drain:
            return None
        reason = " ".join(f"rankguard: {reason}".split())[:REASON_MAX_CHARS]
        outcome = self.nodes.drain(node, reason)
        if outcome["ok"]:
            now = self.clock()
            with self._lock:
                self._conn.execute(
                    "INSERT OR REPLACE INTO scheduler_exclusions VALUES (?, ?, ?)",
                    (node, reason, now),
                )
                self.drained[node] = Drained(node, reason, now)
            log.warning("node %s drained in the scheduler: %s", node, reason)
        else:
            log.error("node %s: drain failed: %s", node, outcome["error"])
        return outcome

    def remember(self, node: str, reason: str, drained_at: float) -> None:
        """A drain another supervisor of the pair made: this one resumes the node once its
        health check passes, should it lead by then."""
        with self._lock:
            if node in self.drained:
                return
            self._conn.execute("INSERT OR REPLACE INTO scheduler_exclusions VALUES (?, ?, ?)",
                               (node, reason, drained_at))  # fmt: skip
            self.drained[node] = Drained(node, reason, drained_at)

    def observe(self, obs: ClusterObs, act: bool = True) -> list[dict]:
        """One pass: count healthy verdicts, resume the nodes whose health check passed
        (with `act` False, a standby's pass: counted, nothing resumed)."""
        with self._lock:
            if not self.drained:
                return []
            verdicts = {n.node: n.status if n.reachable else None for n in obs.nodes}
            self.drained, ready = readmit(
                self.drained, verdicts, self.cfg.resume_after_healthy_passes
            )
            if not act:  # the streaks go on (a node past its streak stays); the leader resumes
                return []
        outcomes = []
        for node in ready:
            outcome = self.nodes.resume(node)
            outcomes.append(outcome)
            with self._lock:
                if outcome["ok"]:
                    self._conn.execute("DELETE FROM scheduler_exclusions WHERE node = ?", (node,))
                    self.drained.pop(node, None)
                    log.warning("node %s resumed in the scheduler: its health check passed", node)
                else:  # try again after another full run of healthy passes
                    d = self.drained[node]
                    self.drained[node] = Drained(d.node, d.reason, d.drained_at, 0)
                    log.error("node %s: resume failed: %s", node, outcome["error"])
        return outcomes

    def close(self) -> None:
        with self._lock:
            self._conn.close()
