"""rankguard.contract: everything that crosses a process boundary, in one place.

Standard library only: the client library, the agent, the supervisor, the bundled
trainer, the scale simulator and the dashboards all import it.

- :mod:`.telemetry`: the record a rank sends the agent (one datagram per record).
- :mod:`.answers`: the agent's ``/v1/node`` and ``/v1/ranks`` answers as typed models.
- :mod:`.cursor`: incremental ``/v1/ranks?after=`` reads.
- :mod:`.states`: rank process states, and which are live, dead or ended.
- :mod:`.numbers`: the one encoding of non-finite numbers.
- :mod:`.metrics`: Prometheus label names and the metric names several parts read.
- :mod:`.errors`: :class:`ContractError`, the one error a malformed value raises.
- :mod:`.faults`: the one fault grammar (``up --inject``, ``rankguard inject``, ``--fault``).
"""

from .answers import (
    API_VERSION,
    NODE_STATUSES,
    CollectorStatus,
    HealthReason,
    NodeAnswer,
    NodeWarning,
    RankAnswer,
    RanksAnswer,
    Sample,
    TelemetryStats,
)
from .errors import REASONS, ContractError
from .numbers import decode_float, encode_float, json_safe
from .states import DEAD_STATES, ENDED_STATES, LIVE_STATES, RANK_SOURCES, RANK_STATES
from .telemetry import PHASES, SCHEMA_VERSION, TelemetryError, TelemetryRecord

__all__ = [
    "API_VERSION",
    "DEAD_STATES",
    "ENDED_STATES",
    "LIVE_STATES",
    "NODE_STATUSES",
    "PHASES",
    "RANK_SOURCES",
    "RANK_STATES",
    "REASONS",
    "SCHEMA_VERSION",
    "CollectorStatus",
    "ContractError",
    "HealthReason",
    "NodeAnswer",
    "NodeWarning",
    "RankAnswer",
    "RanksAnswer",
    "Sample",
    "TelemetryError",
    "TelemetryRecord",
    "TelemetryStats",
    "decode_float",
    "encode_float",
    "json_safe",
]
