"""Names that cross into Prometheus: the label names every exporter and dashboard share,
and the metric names that more than one part reads.

The training job's label is ``training_job``, not ``job``: Prometheus sets ``job`` on
every scraped series to the scrape job's name and would rename ours to ``exported_job``
(docs/architecture.md). The JSON API keeps the field name ``job``.
"""

from __future__ import annotations

__all__ = [
    "CLIENT_ERRORS",
    "JOB_LABEL",
    "METRIC_PREFIX",
    "NODE_LABEL",
    "RANK_INFO",
    "RANK_LABELS",
    "RANK_UP",
    "REASON_LABEL",
]

METRIC_PREFIX = "rankguard_"
JOB_LABEL = "training_job"
RANK_LABELS = (JOB_LABEL, "rank")
NODE_LABEL = "node"
REASON_LABEL = "reason"

#: 1 while a rank's process is live (``up`` in /v1/ranks); dashboards filter on it.
RANK_UP = "rankguard_rank_up"
#: A rank's identity; the dashboards' job variable reads its label values.
RANK_INFO = "rankguard_rank_info"
#: The client library's own failures, per rank and reason, as its records carry them.
CLIENT_ERRORS = "rankguard_client_errors_total"
