"""How a training job's launcher ends: an exit code that says whether a retry can help.

A job controller restarts a failed job blindly unless the exit code tells it why. These
codes let it tell an infrastructure fault (retry, on other nodes) from a deterministic
error of the training itself (fail the job: it would fail the same way) in the forms the
controllers match: a Kubernetes Job's ``podFailurePolicy`` (``onExitCodes``, with JobSet's
``failurePolicy`` above it), PyTorchJob's ``restartPolicy: ExitCode`` (1-127 permanent,
128-255 retried), systemd's ``RestartPreventExitStatus``, a Slurm requeue script.

The code of a stopped job comes from the cause of the incident that stopped it
(contract/causes.py): the supervisor hands the cause to each agent with the stop, the
agent writes the job's status file beside its telemetry socket (``status_path``) before it
signals the launcher, and the launcher (``rankguard up``, ``rankguard launch``) reads it
once torchrun has ended. The file holds the cause, never a code: the reader maps it with
this table, so a file cannot ask for an exit code of its own.

Standard library only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .causes import (
    CAUSES,
    COLLECTIVE,
    CONFIDENCES,
    DATA,
    GPU,
    GPU_MEMORY,
    HIGH,
    HOST,
    NETWORK,
    NVLINK,
    STORAGE,
    USER_CODE,
)
from .errors import ContractError
from .telemetry import MAX_INT, MAX_JOB_CHARS, job_file, read_job_file


@dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    retry: str  # "no", "yes" (not counted against a retry budget), "counted"
    meaning: str


EXIT_CODES = (
    ExitCode(0, "completed", "no", "training completed"),
    ExitCode(1, "failed", "counted", "training failed and no incident names a cause "
             "(torchrun's own code for a failed worker)"),
    ExitCode(2, "bad_argument", "no", "nothing started: a bad argument or setting"),
    ExitCode(3, "user_error", "no", "the training failed in a way a retry repeats: its "
             "script failed at start, the supervisor stopped a crash loop (unless an XID "
             "named the hardware), or it stopped the job for its code or data"),
    ExitCode(130, "interrupted", "no", "Ctrl-C (SIGINT)"),
    ExitCode(143, "terminated", "yes", "SIGTERM: the node is drained or the job preempted"),
    ExitCode(200, "infrastructure", "yes", "the hardware or platform failed (a GPU, its "
             "memory, NVLink, the network, storage, the host, a collective timeout): the "
             "supervisor stopped the job there; retry, on other nodes"),
)  # fmt: skip
BY_NAME = {e.name: e for e in EXIT_CODES}
COMPLETED, FAILED, BAD_ARGUMENT, USER_ERROR = (BY_NAME[n] for n in
                                               ("completed", "failed", "bad_argument", "user_error"))  # fmt: skip
INTERRUPTED, TERMINATED, INFRASTRUCTURE = (BY_NAME[n] for n in
                                           ("interrupted", "terminated", "infrastructure"))  # fmt: skip

#: Causes outside the training: a retry on other hardware can succeed.
INFRASTRUCTURE_CAUSES = frozenset({GPU, GPU_MEMORY, NVLINK, NETWORK, STORAGE, HOST, COLLECTIVE})
#: Causes in the training itself: a retry fails the same way.
USER_CAUSES = frozenset({USER_CODE, DATA})


def for_cause(cause: str, confidence: str = HIGH, repeated: bool = False) -> ExitCode:
    """The code for a job stopped for ``cause`` (rankguard's own blindness and unknown
    causes say nothing either way: a plain, counted failure). A job stopped because it
    failed the same way restart after restart (``repeated``: the crash-loop guard) is a
    user error unless hardware was named for sure (an XID): a guess such as "killed from
    outside, maybe the OOM killer" does not outweigh the loop itself."""
    if repeated and not (cause in INFRASTRUCTURE_CAUSES and confidence == HIGH):
        return USER_ERROR
    if cause in INFRASTRUCTURE_CAUSES:
        return INFRASTRUCTURE
    if cause in USER_CAUSES:
        return USER_ERROR
    return FAILED


def table_markdown() -> str:
    """The codes as the docs show them (docs/deploy.md, `rankguard up --help`)."""
    rows = ["| code | name | retry | when |", "|---|---|---|---|"]
    rows += [f"| {e.code} | `{e.name}` | {e.retry} | {e.meaning} |" for e in EXIT_CODES]
    return "\n".join(rows)


def help_line() -> str:
    return "; ".join(f"{e.code} {e.name}" for e in EXIT_CODES)


# -- the status file ---------------------------------------------------------------------

#: The folder, beside the agent's telemetry socket, that holds one status per job.
STATUS_DIR = "job-status"
MAX_STATUS_BYTES = 4096
MAX_TEXT_CHARS = 500


@dataclass(frozen=True)
class JobStatus:
    """Why the supervisor stopped a job on this node, as the agent recorded it."""

    job: str
    cause: str
    confidence: str
    why: str
    action: str  # the supervisor's action: stop_job, exclude_node
    incident: int | None
    time: float  # when the agent wrote it (seconds since the epoch)
    repeated: bool = False  # stopped as a crash loop: the same failure restart after restart

    @property
    def exit_code(self) -> ExitCode:
        return for_cause(self.cause, self.confidence, self.repeated)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def outcome(self) -> dict[str, Any]:
        """The status with its exit code, for a pod's termination message."""
        e = self.exit_code
        return {"exit_code": e.code, "name": e.name, "retry": e.retry, **self.to_json()}

    @classmethod
    def from_json(cls, value: Any) -> JobStatus:
        """A status as it crossed a boundary (an HTTP body, a file): checked field by field."""
        if not isinstance(value, dict):
            raise ContractError("not_object", "a job status is a JSON object")
        job = _text(value, "job", MAX_JOB_CHARS)
        if not job:
            raise ContractError("bad_type", "'job' must not be empty", "job")
        cause = _text(value, "cause", 40)
        if cause not in CAUSES:
            raise ContractError(
                "out_of_range", f"'cause' must be one of {', '.join(CAUSES)}", "cause"
            )
        confidence = _text(value, "confidence", 10)
        if confidence not in CONFIDENCES:
            raise ContractError("out_of_range", f"'confidence' must be one of "
                                f"{', '.join(CONFIDENCES)}", "confidence")  # fmt: skip
        incident = value.get("incident")
        if incident is not None and (
            not isinstance(incident, int)
            or isinstance(incident, bool)
            or not 0 < incident < MAX_INT
        ):
            raise ContractError("bad_type", "'incident' must be a positive integer", "incident")
        repeated = value.get("repeated", False)
        if not isinstance(repeated, bool):
            raise ContractError("bad_type", "'repeated' must be true or false", "repeated")
        when = value.get("time", 0.0)
        if not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when):
            raise ContractError("bad_type", "'time' must be a finite number", "time")
        return cls(job, cause, confidence, _text(value, "why", MAX_TEXT_CHARS),
                   _text(value, "action", 40), incident, float(when), repeated)  # fmt: skip


def _text(value: dict, name: str, limit: int) -> str:
    text = value.get(name)
    if not isinstance(text, str) or len(text) > limit:
        raise ContractError("bad_type" if name in value else "missing_field",
                            f"'{name}' must be text of at most {limit} chars", name)  # fmt: skip
    return text


def status_path(socket_path: str | Path, job: str) -> Path:
    """Where the agent of ``socket_path`` keeps ``job``'s status."""
    return job_file(socket_path, STATUS_DIR, job)


def encode(status: JobStatus) -> bytes:
    return json.dumps(status.to_json(), sort_keys=True).encode()


def decode(data: bytes) -> JobStatus:
    return JobStatus.from_json(read_job_file(data, MAX_STATUS_BYTES, "a job status"))


def read_status(socket_path: str | Path, job: str, since: float = 0.0) -> JobStatus | None:
    """The job's status, if the agent wrote one for it at or after ``since`` (a status
    from an earlier run of the same job name is not this run's); None when there is none
    or it cannot be read or trusted."""
    try:
        with open(status_path(socket_path, job), "rb") as f:
            status = decode(f.read(MAX_STATUS_BYTES + 1))
    except (OSError, ContractError):
        return None
    return status if status.job == job and status.time >= since else None
