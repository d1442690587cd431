"""The supervisor process: the reconcile loop plus its HTTP interface."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import threading
from pathlib import Path

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..service import sdnotify
from ..service.httpd import Raw, ServeError, Service, serve
from .reconcile import Supervisor
from .views import causes_view, cluster_view, incidents_view, make_registry, ranks_view

log = logging.getLogger("rankguard.supervisor")

API_VERSION = "rankguard.supervisor/v1"
DEFAULT_BIND = "127.0.0.1:9408"


class DatabaseInUse(ServeError):
    """Another supervisor runs on the same database: two would both act on every fault."""


def lock_database(db: str | Path) -> int:
    """Hold an exclusive flock on `<db>.lock` for this process's life (the kernel drops it
    when the process dies, however it dies, so a crashed supervisor never blocks its
    restart). Raises DatabaseInUse naming the holder's pid when another supervisor has it."""
    path = Path(f"{db}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DatabaseInUse(
            f"another supervisor (pid {holder}) is already running on {db}; stop it first "
            f"(two supervisors would both act on every fault)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def supervisor_service(sup: Supervisor) -> Service:
    registry = make_registry(sup)
    service = Service(API_VERSION, "supervisor")
    service.get_routes.update({
        "/metrics": lambda: Raw(generate_latest(registry), CONTENT_TYPE_LATEST),
        "/v1/cluster": lambda: cluster_view(sup),
        "/v1/ranks": lambda: ranks_view(sup),
        "/v1/incidents": lambda: incidents_view(sup),
        "/v1/causes": lambda: causes_view(sup),
        "/healthz": lambda: {"ok": True},
    })  # fmt: skip
    return service


def _watchdog(sup: Supervisor, every: float, done: threading.Event) -> None:
    """Feed systemd's watchdog only while reconcile passes complete: a loop stuck in a pass
    (a deadlock, an agent call without a timeout) stops the pings and systemd restarts us,
    which a ping from this thread alone would hide."""
    seen = -1
    while not done.wait(every):
        passes, loop = sup.passes, sup.loop_seconds
        if passes != seen:
            seen = passes
            sdnotify.notify(f"WATCHDOG=1\nSTATUS={passes} passes, last {loop:.3f}s")


def run_supervisor(
    sup: Supervisor, host: str, port: int, install_signals: bool = True, tls=None
) -> None:
    """Serve and reconcile until SIGTERM/SIGINT (or `sup.stop()`); under systemd, report
    READY=1 once serving and feed the watchdog (Type=notify, WatchdogSec). Refuses
    (DatabaseInUse, a ServeError) while another supervisor holds the database."""
    lock = lock_database(sup.store.path)
    sup.service = supervisor_service(sup)
    try:
        server = serve(sup.service, host, port, tls=tls)
    except BaseException:
        os.close(lock)
        raise
    scheme = "https" if tls is not None else "http"
    log.info("supervisor on %s://%s:%s", scheme, *server.server_address[:2])
    if install_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: sup.stop())
    done = threading.Event()
    every = sdnotify.watchdog_interval()
    if every is not None:
        threading.Thread(
            target=_watchdog, args=(sup, every, done), name="rankguard-watchdog", daemon=True
        ).start()
    sdnotify.notify("READY=1\nSTATUS=reconciling")
    try:
        sup.run()
    finally:
        done.set()
        sdnotify.notify("STOPPING=1")
        server.shutdown()
        server.server_close()
        sup.close()
        os.close(lock)
