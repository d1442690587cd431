"""A zero-code worker's optimizer step (client/optimizer_steps.py): Adam's own step, read
once and counted, resumed steps included; unknown where the optimizer keeps none; the
hook registered by the bootstrap when the script imports torch; and training with it is
bit-identical to training without."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from rankguard.client import bootstrap, optimizer_steps  # noqa: E402
from rankguard.client.collective_watch import BEACON_SECONDS, StepBeacon  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    optimizer_steps.reset()
    yield
    optimizer_steps.reset()


def _train(opt_cls, steps: int, hooked: bool, state=None, **kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    opt = opt_cls(net.parameters(), lr=0.01, **kw)
    if state is not None:
        net.load_state_dict(state["net"])
        opt.load_state_dict(state["opt"])
    handle = register_optimizer_step_post_hook(optimizer_steps.hook)
    if not hooked:
        handle.remove()
    try:
        for _ in range(steps):
            net(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        handle.remove()
    return net, opt


def test_adams_own_step_is_read_once_and_counted_across_a_resume():
    net, opt = _train(torch.optim.AdamW, 5, hooked=True)
    assert optimizer_steps.step() == 5
    state = {"net": net.state_dict(), "opt": opt.state_dict()}
    optimizer_steps.reset()  # a new process after a restart
    _train(torch.optim.AdamW, 3, hooked=True, state=state)
    assert optimizer_steps.step() == 8  # 5 resumed + 3


def test_an_optimizer_that_keeps_no_step_leaves_it_unknown():
    _train(torch.optim.SGD, 3, hooked=True)
    assert optimizer_steps.step() is None


def test_the_hook_changes_nothing_in_the_training():
    plain_net, plain_opt = _train(torch.optim.AdamW, 6, hooked=False)
    net, opt = _train(torch.optim.AdamW, 6, hooked=True)
    for a, b in zip(plain_net.parameters(), net.parameters(), strict=True):
        assert torch.equal(a, b)
    assert repr(plain_opt.state_dict()) == repr(opt.state_dict())


def test_the_beacon_sends_a_changed_step_at_most_once_a_look():
    b = StepBeacon()
    assert b.due(None, 0.0) is None and b.due(0, 0.0) is None  # unknown: nothing
    assert b.due(5, 0.0) == 5
    assert b.due(6, BEACON_SECONDS / 2) is None  # too soon
    assert b.due(6, BEACON_SECONDS) == 6
    assert b.due(6, 10 * BEACON_SECONDS) is None  # unchanged


def test_the_bootstrap_registers_the_hook_when_the_script_imports_torch(tmp_path):
    """A torchrun worker's interpreter with the bootstrap on its path: the script's own
    `import torch` registers the hook; its AdamW's steps are counted."""
    script = (
        "import torch\n"
        "from rankguard.client import optimizer_steps\n"
        "net = torch.nn.Linear(2, 2)\n"
        "opt = torch.optim.AdamW(net.parameters())\n"
        "for _ in range(4):\n"
        "    net(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "print(optimizer_steps.step())\n"
    )
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "j",
           "RANKGUARD_TELEMETRY_SOCKET": str(tmp_path / "none.sock")}  # fmt: skip
    bootstrap.put_on_path(env)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "4", out.stdout + out.stderr
    env["RANKGUARD_COLLECTIVE_WATCH"] = "0"  # the watch off: no hook
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.stdout.strip() == "None", out.stdout + out.stderr
