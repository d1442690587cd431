"""The supervisor process: the reconcile loop plus its HTTP interface."""

from __future__ import annotations

import logging
import signal
import threading

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..agent.httpd import Raw, Service, serve
from .reconcile import Supervisor
from .views import cluster_view, incidents_view, make_registry, ranks_view

log = logging.getLogger("rankguard.supervisor")

API_VERSION = "rankguard.supervisor/v1"
DEFAULT_BIND = "127.0.0.1:9408"


def supervisor_service(sup: Supervisor) -> Service:
    registry = make_registry(sup)
    service = Service(API_VERSION, "supervisor")
    service.get_routes.update({
        "/metrics": lambda: Raw(generate_latest(registry), CONTENT_TYPE_LATEST),
        "/v1/cluster": lambda: cluster_view(sup),
        "/v1/ranks": lambda: ranks_view(sup),
        "/v1/incidents": lambda: incidents_view(sup),
        "/healthz": lambda: {"ok": True},
    })  # fmt: skip
    return service


def run_supervisor(sup: Supervisor, host: str, port: int, install_signals: bool = True) -> None:
    """Serve and reconcile until SIGTERM/SIGINT (or `sup.stop()`)."""
    server = serve(supervisor_service(sup), host, port)
    log.info("supervisor on http://%s:%s", *server.server_address[:2])
    if install_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: sup.stop())
    try:
        sup.run()
    finally:
        server.shutdown()
        server.server_close()
        sup.close()
