"""The agent process: collectors on an interval, telemetry receiver, HTTP, systemd hooks."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from ..contract.answers import CollectorStatus, HealthReason, NodeAnswer, TelemetryStats
from ..service import sdnotify
from ..service.httpd import REFUSALS, ServeError
from ..service.version import VERSION
from .api import agent_service, start_http
from .collectors import (
    REGISTRY,
    CollectorContext,
    CollectorRun,
    Metric,
    counter,
    gauge,
    load_all,
    run_collector,
    settings_for,
)
from .config import AgentConfig, AgentConfigError, load_tls, read_token
from .control import dump_stacks, send_signal, stop_job, write_save_request
from .discovery import WorkerScanner
from .exposition import MetricsPage, collector_meta, make_registry
from .health import SEVERITIES, node_verdict
from .nvml_double import load_nvml
from .ranks import RankTable
from .receiver import TelemetryReceiver

log = logging.getLogger("rankguard.agent")


class Agent:
    def __init__(self, cfg: AgentConfig, nvml=None, sys_root: Path | None = None):
        """`nvml` and `sys_root`: an NVML double and a fake /sys tree, for tests."""
        self.cfg = cfg
        self.token = read_token(cfg.token_file) if cfg.token_file else None
        self.tls = load_tls(cfg.tls_cert, cfg.tls_key)
        self.started_at = time.time()
        self.control_actions: list[dict] = []  # an audit trail, newest last (bounded)
        self.table = RankTable(max_ranks_per_uid=cfg.telemetry_ranks_per_uid)
        self.receiver = TelemetryReceiver(
            cfg.telemetry_socket, self.table, mode=cfg.socket_mode, group=cfg.telemetry_gid(),
            quota_rate=cfg.telemetry_quota, quota_burst=2 * cfg.telemetry_quota,
            max_wait=cfg.telemetry_batch_wait,
        )  # fmt: skip
        self.scanner = (
            WorkerScanner(agent_socket=cfg.telemetry_socket, mode=cfg.discover_workers)
            if cfg.discover_workers != "off"
            else None
        )
        ctx = CollectorContext(
            watch_dirs=cfg.watch_dirs,
            rank_processes=self.table.processes,
            nvml=nvml if nvml is not None else load_nvml(cfg.nvml_double and str(cfg.nvml_double)),
            expected_gpus=cfg.expected_gpus,
            node=cfg.node,
            rank_table=self.table,
            receiver=self.receiver,
            **({"sys_root": sys_root} if sys_root is not None else {}),
        )
        load_all()
        settings = cfg.collectors or settings_for(None)
        self.collectors = [  # [collectors.<name>] enabled = false: not run at all
            cls(ctx, settings[name])
            for name, cls in sorted(REGISTRY.items())
            if settings[name].enabled
        ]
        self._lock = threading.Lock()
        self._runs: list[CollectorRun] = []
        self.registry = make_registry(self.metrics_snapshot)  # everything, in one registry
        self.metrics_page = MetricsPage(self._collected_metrics, self._own_metrics)  # /metrics
        self.service = agent_service(self)
        self._stop = threading.Event()
        self._server = None

    # -- collection ---------------------------------------------------------------
    def discover(self) -> None:
        """Find torchrun workers that send no telemetry and watch them as ranks."""
        if self.scanner is None:
            return
        try:
            found = self.scanner.scan(
                skip=self.table.known_pids().__contains__,
                skip_launcher=self.table.telemetry_launchers().__contains__,
            )
            self.table.adopt(found)
        except Exception:  # discovery must never stop collection
            log.exception("worker discovery failed")

    def collect_once(self) -> list[CollectorRun]:
        self.discover()
        runs = [run_collector(c) for c in self.collectors]
        with self._lock:
            self._runs = runs
        self.metrics_page.bump()  # /metrics renders the new snapshot once, at its next scrape
        return runs

    def _latest(self) -> tuple[list[CollectorRun], dict]:
        with self._lock:
            runs = list(self._runs)
        facts = {r.name: r.result.facts for r in runs if r.result is not None}
        return runs, facts

    def verdict(self):
        runs, facts = self._latest()
        return node_verdict(facts, runs, self.cfg.expected_gpus)

    def metrics_snapshot(self) -> list[Metric]:
        """Everything /metrics shows, from the last collection (one consistent snapshot)."""
        return self._collected_metrics() + self._own_metrics()

    def _collected_metrics(self) -> list[Metric]:
        """The last collection's metrics: they change only when a collection swaps in."""
        runs, _ = self._latest()
        metrics: list[Metric] = []
        for run in runs:
            if run.result is not None:
                metrics.extend(run.result.metrics)
        metrics.extend(collector_meta(runs))
        return metrics

    def _own_metrics(self) -> list[Metric]:
        info = gauge(
            "rankguard_agent_info", "The agent's node name and version.", ("node", "version")
        )
        info.add((self.cfg.node, VERSION))
        start = gauge("rankguard_agent_start_time_seconds", "When the agent started (unix time).")
        start.add((), self.started_at)
        status = self.verdict().status
        health = gauge(
            "rankguard_node_health", "1 for the node's current health verdict.", ("status",)
        )
        for s in SEVERITIES:
            health.add((s,), 1.0 if s == status else 0.0)
        requests = counter(
            "rankguard_agent_http_requests_total", "HTTP requests by route and status.",
            ("route", "code"),
        )  # fmt: skip
        for (route, code), n in sorted(self.service.stats.items()):
            requests.add((route, str(code)), n)
        auth = counter(
            "rankguard_agent_auth_failures_total", "Control requests refused for their token."
        )
        auth.add((), self.service.auth_failures)
        refused = counter(
            "rankguard_agent_http_refused_connections_total",
            "HTTP connections refused or cut short, by reason (caps, TLS, unread bodies).",
            ("reason",),
        )
        for reason in REFUSALS:
            refused.add((reason,), self.service.refusals.get(reason, 0))
        return [info, start, health, requests, auth, refused]

    # -- views --------------------------------------------------------------------
    def node_view(self) -> dict:
        runs, facts = self._latest()
        verdict = node_verdict(facts, runs, self.cfg.expected_gpus)
        now = time.time()
        return NodeAnswer(
            node=self.cfg.node,
            version=VERSION,
            time=now,
            uptime_seconds=now - self.started_at,
            status=verdict.status,
            reasons=tuple(HealthReason(r.code, r.severity, r.message) for r in verdict.reasons),
            collectors={
                r.name: CollectorStatus(r.success, r.duration_seconds, r.error) for r in runs
            },
            facts=facts,
            warnings=tuple(verdict.warnings),
        ).to_json()

    def ranks_view(self, query: dict | None = None) -> dict:
        """``?after=<cursor>``: only the samples after it, and a new cursor
        (contract/cursor.py); without it, every rank's whole window as always."""
        self.receiver.flush()  # records waiting on the socket first (receiver.py: batching)
        self.table.refresh()
        stats = self.receiver.stats()
        telemetry = TelemetryStats(stats["path"], stats["accepted"], stats["rejected"],
                                   stats["last_error"], stats["pressure_at"])  # fmt: skip
        answer = self.table.read(
            (query or {}).get("after"), time.time(), node=self.cfg.node, telemetry=telemetry
        )
        return answer.to_json()

    # -- control --------------------------------------------------------------------
    def _audit(self, action: str, body: dict, caller: str, result: dict) -> None:
        entry = {"time": time.time(), "action": action, "caller": caller,
                 "job": body.get("job"), "rank": body.get("rank"), "pid": result.get("pid")}  # fmt: skip
        log.warning("control %s from %s: job=%s rank=%s pid=%s", action, caller,
                    entry["job"], entry["rank"], entry["pid"])  # fmt: skip
        self.control_actions = (self.control_actions + [entry])[-100:]

    def control_signal(self, body: dict, caller: str) -> dict:
        result = send_signal(self.table, body)
        self._audit(f"signal {result['signal']}", body, caller, result)
        return result

    def control_stacks(self, body: dict, caller: str) -> dict:
        result = dump_stacks(self.table, body)
        self._audit("stacks", body, caller, result)
        return result

    def control_stop_job(self, body: dict, caller: str) -> dict:
        result = stop_job(self.table, self.cfg.telemetry_socket, body)
        self._audit(
            "stop-job", body, caller, {"pid": result["launchers"] or result["ranks_signalled"]}
        )
        return result

    def control_save(self, body: dict, caller: str) -> dict:
        result = write_save_request(self.table, self.cfg.telemetry_socket, body)
        self._audit(f"save at step {result.get('step')}", body, caller, {})
        return result

    # -- lifecycle ------------------------------------------------------------------
    def start_http(self):
        host, port = self.cfg.host_port()
        try:
            self._server = start_http(self, host, port, self.tls)
        except ServeError as exc:  # a configuration fault: the CLI says it in one line
            raise AgentConfigError(str(exc)) from None
        return self._server.server_address

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT: collect every interval, keep systemd's watchdog fed."""
        self.collect_once()
        address = self.start_http()
        log.info("agent on %s: http %s:%s, telemetry %s", self.cfg.node, address[0], address[1],
                 self.cfg.telemetry_socket)  # fmt: skip
        sdnotify.notify("READY=1\nSTATUS=collecting")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(self.cfg.interval):
            self.collect_once()
            sdnotify.notify(f"WATCHDOG=1\nSTATUS={self.verdict().status}")
        sdnotify.notify("STOPPING=1")
        self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.receiver.close()
        for c in self.collectors:
            c.close()
        self.table.close()
