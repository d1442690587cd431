"""The agent's HTTP interface: /metrics, the versioned JSON API, token-guarded control.

Reads are open (trusted network; loopback by default). Control endpoints need
`Authorization: Bearer <token>`; a wrong or missing token is answered 401 and nothing
happens. Plumbing (limits, errors, counting) lives in httpd.py, shared with the supervisor.
"""

from __future__ import annotations

from ..contract.answers import API_VERSION
from ..contract.cursor import CursorError
from ..service.httpd import Raw, Service, serve
from .control import ControlError
from .rank_events import RankEventLog, parse_states, parse_wait


def agent_service(agent) -> Service:
    service = Service(API_VERSION, "agent", token=agent.token)
    # rank state changes as they happen, for a supervisor's long poll (rank_events.py);
    # the table's clock is Unix time in the daemon
    events = agent.rank_events = RankEventLog()
    agent.table.subscribe(events.add)

    def rank_events(query: dict) -> dict:
        wait, states = parse_wait(query), parse_states(query)
        return events.read(query.get("after"), wait, node=agent.cfg.node, states=states).to_json()

    service.get_routes.update({
        "/metrics": lambda headers: Raw(*agent.metrics_page.render(
            headers.get("Accept", ""), headers.get("Accept-Encoding", ""))),
        "/v1/node": agent.node_view,
        "/v1/ranks": agent.ranks_view,
        "/v1/rank-events": rank_events,
        "/healthz": lambda: {"ok": True},
        "/v1": lambda: {"endpoints": sorted(service.get_routes) + sorted(service.post_routes)},
    })  # fmt: skip
    service.header_routes.add("/metrics")  # Accept (OpenMetrics), Accept-Encoding (gzip)
    service.query_routes.add("/v1/ranks")  # ?after=<cursor>: incremental reads
    service.query_routes.add("/v1/rank-events")  # ?after=<cursor>&wait=<s>&states=<a,b>
    service.post_routes.update({
        "/v1/control/signal": agent.control_signal,
        "/v1/control/stacks": agent.control_stacks,
        "/v1/control/stop-job": agent.control_stop_job,
        "/v1/control/save": agent.control_save,
    })  # fmt: skip
    return service


def start_http(agent, host: str, port: int, tls=None):
    return serve(agent.service, host, port, domain_errors=(ControlError, CursorError), tls=tls)
