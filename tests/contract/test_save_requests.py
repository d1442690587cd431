"""Save requests (contract/save_requests.py): what crosses from supervisor to agent to rank."""

from __future__ import annotations

import pytest

from rankguard.contract.errors import ContractError
from rankguard.contract.save_requests import (
    MAX_LEAD_STEPS,
    MIN_LEAD_STEPS,
    REQUEST_DIR,
    SaveRequest,
    decode,
    encode,
    request_path,
    save_step,
)


def test_a_request_round_trips_and_a_withdrawal_has_no_step():
    for request in (SaveRequest("job/a b", 3, 120, "node n2: GPU 1 failing"),
                    SaveRequest("j", 0, None)):  # fmt: skip
        assert decode(encode(request)) == request


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[1]", "not_object"),
        (b"\xff", "not_json"),
        (b"{", "not_json"),
        (b'{"restart": 0, "step": 1}', "bad_type"),
        (b'{"job": "", "restart": 0, "step": 1}', "bad_type"),
        (b'{"job": "j", "step": 1}', "missing_field"),
        (b'{"job": "j", "restart": true, "step": 1}', "bad_type"),
        (b'{"job": "j", "restart": 0, "step": -1}', "out_of_range"),
        (b'{"job": "j", "restart": 0, "step": 1.5}', "bad_type"),
        (b'{"job": "j", "restart": 0, "step": 1, "reason": 7}', "bad_type"),
        (b'{"job": "j", "restart": 0, "step": 99999999999999999999}', "out_of_range"),
        (b" " * 5000, "too_large"),
    ],
)
def test_a_bad_request_is_refused_with_its_reason(body, reason):
    with pytest.raises(ContractError) as err:
        decode(body)
    assert err.value.reason == reason


def test_each_job_has_its_own_file_beside_the_socket_whatever_its_name(tmp_path):
    sock = tmp_path / "telemetry.sock"
    a, b = request_path(sock, "../../etc/passwd"), request_path(sock, "job")
    assert a.parent == b.parent == tmp_path / REQUEST_DIR and a != b
    assert request_path(str(sock), "job") == b


def test_the_save_step_is_about_ten_seconds_ahead_within_bounds():
    assert save_step(100, 0.5) == 120
    assert save_step(100, 60.0) == 100 + MIN_LEAD_STEPS
    assert save_step(100, 1e-6) == 100 + MAX_LEAD_STEPS
    for unknown in (None, 0.0, float("nan"), float("inf"), -1.0):
        assert 100 + MIN_LEAD_STEPS <= save_step(100, unknown) <= 100 + MAX_LEAD_STEPS
