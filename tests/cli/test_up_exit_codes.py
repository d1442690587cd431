"""`rankguard up` ends with the code of why the job failed (contract/exit_codes.py): an
infrastructure fault retries, a deterministic error of the training does not. The user
errors are also run in test_up.py (a crash loop) and test_up_fail_fast.py (failed at
start); both assert the same table's code."""

from __future__ import annotations

import json

from up_run import Up, log_has

from rankguard.agent.nvml_double import ENV_VAR, make_double, write_state
from rankguard.contract import exit_codes


def test_a_gpu_that_fails_ends_up_with_the_infrastructure_code(tmp_path):
    """The agent reads an NVML double (no GPU here; the training is on CPU); its GPU
    reports XID 79 (fallen off the bus) mid-run. The supervisor excludes the node, the
    agent records the cause beside its socket before it stops torchrun, and up exits 200:
    retry, on other nodes."""
    state = tmp_path / "nvml.json"
    write_state(state, make_double(n_gpus=1))
    up = Up(tmp_path, "--steps", "100000", "--ckpt-every", "50", env={ENV_VAR: str(state)})
    try:
        log_has(up, r"step \d+ loss", timeout=180)
        write_state(state, make_double(n_gpus=1, xid_events=[{"gpu": 0, "xid": 79}]))
        code = up.wait(timeout=120)
    finally:
        up.close()
    out = up.output()
    assert code == exit_codes.INFRASTRUCTURE.code, out[-3000:]
    assert "cause gpu" in out and "exit 200, infrastructure" in out, out[-3000:]
    (path,) = (up.run / exit_codes.STATUS_DIR).iterdir()
    status = json.loads(path.read_text())
    assert (status["cause"], status["confidence"], status["action"]) == (
        "gpu",
        "high",
        "exclude_node",
    )
