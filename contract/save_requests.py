"""A save request: the supervisor asks one incarnation of a job to checkpoint at one step.

Predictive drain takes a node whose GPU trends toward failure out at its jobs' next
checkpoint. Rather than wait for the next scheduled one (up to a checkpoint interval), the
supervisor asks every agent with ranks of the job to write a request; each rank reads the
one next to its telemetry socket (``Reporter.save_requested(step)``) and saves at that step.

Every rank must save at the same step (a sharded save is a collective), so the step is
the job's newest plus a lead of about :data:`LEAD_SECONDS` of steps (the supervisor's
``predictive_drain_save_lead_seconds``), far more than the
request takes to arrive; a rank that reads a request only after its step has passed does
not save for it. A request names the incarnation (``restart``) it is for: a restarted
group ignores it. ``step`` None withdraws a request.

Standard library only: the rank side reads it inside training processes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .errors import ContractError
from .telemetry import MAX_INT, MAX_JOB_CHARS, job_file, read_job_file

#: The folder, beside the agent's telemetry socket, that holds one request per job.
REQUEST_DIR = "save-requests"
#: How far ahead of the job's newest step the save is asked for, in seconds of steps.
LEAD_SECONDS = 10.0
MIN_LEAD_STEPS = 3
MAX_LEAD_STEPS = 1000
MAX_REASON_CHARS = 200
MAX_REQUEST_BYTES = 4096


@dataclass(frozen=True)
class SaveRequest:
    job: str
    restart: int
    step: int | None  # None: the request is withdrawn
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> SaveRequest:
        """A request as it crossed a boundary (an HTTP body, a file): checked field by field."""
        if not isinstance(value, dict):
            raise ContractError("not_object", "a save request is a JSON object")
        job = value.get("job")
        if not isinstance(job, str) or not 0 < len(job) <= MAX_JOB_CHARS:
            raise ContractError("bad_type", f"'job' must be text of 1-{MAX_JOB_CHARS} chars", "job")
        restart = _count(value, "restart")
        step = None if value.get("step") is None else _count(value, "step")
        reason = value.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
            raise ContractError(
                "bad_type", f"'reason' must be text of at most {MAX_REASON_CHARS} chars", "reason"
            )
        return cls(job, restart, step, reason)


def _count(value: dict, name: str) -> int:
    n = value.get(name)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ContractError("bad_type" if name in value else "missing_field",
                            f"'{name}' must be an integer", name)  # fmt: skip
    if not 0 <= n < MAX_INT:
        raise ContractError("out_of_range", f"'{name}' must be >= 0, got {n}", name)
    return n


def request_path(socket_path: str | Path, job: str) -> Path:
    """Where the agent of ``socket_path`` keeps ``job``'s request."""
    return job_file(socket_path, REQUEST_DIR, job)


def encode(request: SaveRequest) -> bytes:
    return json.dumps(request.to_json(), sort_keys=True).encode()


def decode(data: bytes) -> SaveRequest:
    return SaveRequest.from_json(read_job_file(data, MAX_REQUEST_BYTES, "a save request"))


def save_step(step: int, step_seconds: float | None, lead_seconds: float = LEAD_SECONDS) -> int:
    """The step to ask a job at ``step`` to save at: about ``lead_seconds`` of steps ahead."""
    if step_seconds is None or not step_seconds > 0 or not math.isfinite(step_seconds):
        lead = MAX_LEAD_STEPS // 10  # unknown pace: a lead that covers a fast one
    else:
        lead = math.ceil(lead_seconds / step_seconds)
    return step + min(max(lead, MIN_LEAD_STEPS), MAX_LEAD_STEPS)
