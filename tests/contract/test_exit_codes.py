"""The exit codes a job controller retries by, and the job status they come from."""

from __future__ import annotations

import json

import pytest

from rankguard.contract import causes, exit_codes
from rankguard.contract.errors import ContractError
from rankguard.contract.exit_codes import (
    FAILED,
    INFRASTRUCTURE,
    USER_ERROR,
    JobStatus,
    for_cause,
)


def test_the_codes_fit_what_the_controllers_match():
    """PyTorchJob's ExitCode policy retries 128-255 and fails on 1-127; a Job's
    podFailurePolicy matches single codes: each code and name once."""
    codes = [e.code for e in exit_codes.EXIT_CODES]
    assert len(set(codes)) == len(codes) and len(exit_codes.BY_NAME) == len(codes)
    assert 1 <= USER_ERROR.code <= 127 and USER_ERROR.retry == "no"
    assert 128 <= INFRASTRUCTURE.code <= 255 and INFRASTRUCTURE.retry == "yes"
    assert not 128 < INFRASTRUCTURE.code <= 128 + 64  # not a signal's code
    assert {e.retry for e in exit_codes.EXIT_CODES} <= {"no", "yes", "counted"}


def test_every_cause_has_one_class():
    infra, user = exit_codes.INFRASTRUCTURE_CAUSES, exit_codes.USER_CAUSES
    assert infra | user <= set(causes.CAUSES) and not infra & user
    assert for_cause(causes.GPU) == for_cause(causes.NETWORK) == INFRASTRUCTURE
    assert for_cause(causes.USER_CODE) == for_cause(causes.DATA) == USER_ERROR
    # rankguard's own blindness and no evidence say nothing either way
    assert for_cause(causes.RANKGUARD) == for_cause(causes.UNKNOWN) == FAILED


def test_a_crash_loop_is_the_users_unless_hardware_is_named_for_sure():
    assert for_cause(causes.HOST, causes.LOW, repeated=True) == USER_ERROR  # "maybe the OOM killer"
    assert for_cause(causes.UNKNOWN, causes.LOW, repeated=True) == USER_ERROR
    assert for_cause(causes.GPU, causes.HIGH, repeated=True) == INFRASTRUCTURE  # an XID each time
    assert for_cause(causes.HOST, causes.LOW) == INFRASTRUCTURE  # once: a retry may succeed


GOOD = {"job": "j", "cause": "gpu", "confidence": "high", "why": "XID 79", "action": "exclude_node",
        "incident": 3, "time": 5.0}  # fmt: skip


def test_a_status_round_trips_and_says_its_code():
    status = JobStatus.from_json(GOOD)
    assert exit_codes.decode(exit_codes.encode(status)) == status
    out = status.outcome()
    assert (out["exit_code"], out["name"], out["retry"], out["cause"]) == (
        200,
        "infrastructure",
        "yes",
        "gpu",
    )
    assert json.loads(json.dumps(out)) == out


@pytest.mark.parametrize(
    "change",
    [{"cause": "solar_flare"}, {"confidence": "sure"}, {"incident": 0}, {"incident": True},
     {"repeated": "yes"}, {"time": float("nan")}, {"why": "x" * 501}, {"job": ""}, {"job": 7},
     {"action": None}],
)  # fmt: skip
def test_a_bad_status_is_refused_by_field(change):
    with pytest.raises(ContractError) as refused:
        JobStatus.from_json({**GOOD, **change})
    assert refused.value.field == next(iter(change))


def test_a_status_file_that_is_not_one_is_refused():
    for data in (b"[]", b"{not json", b"\xff", json.dumps({**GOOD, "why": "x" * 5000}).encode()):
        with pytest.raises(ContractError):
            exit_codes.decode(data)


def test_read_status_takes_only_this_runs_status_of_this_job(tmp_path):
    sock = tmp_path / "telemetry.sock"
    assert exit_codes.read_status(sock, "j") is None  # none written
    path = exit_codes.status_path(sock, "j")
    path.parent.mkdir()
    path.write_bytes(exit_codes.encode(JobStatus.from_json(GOOD)))
    assert exit_codes.read_status(sock, "j", since=5.0) is not None
    assert exit_codes.read_status(sock, "j", since=5.1) is None  # an earlier run's
    other = exit_codes.status_path(sock, "k")
    other.write_bytes(path.read_bytes())  # a status naming another job
    assert exit_codes.read_status(sock, "k") is None
    path.write_bytes(b"garbage")
    assert exit_codes.read_status(sock, "j") is None


def test_the_docs_and_the_help_show_the_table_as_it_is():
    from pathlib import Path

    from typer.testing import CliRunner

    from rankguard.cli.main import build

    docs = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"
    assert exit_codes.table_markdown() in docs.read_text(), "paste exit_codes.table_markdown()"
    for command in ("up", "launch"):
        shown = CliRunner().invoke(build(), [command, "--help"], env={"COLUMNS": "400"}).output
        assert exit_codes.help_line() in shown, (command, shown)
