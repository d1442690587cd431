"""A failing GPU before it crashes the job (agent/gpu_trends.py): signals over their
limits within the window, two at once, never one noisy counter alone."""

from __future__ import annotations

from rankguard.agent.gpu_trends import FAILING_SIGNALS, SIGNALS, Trends, describe


def degrading(trends: Trends, gpu: str = "GPU-1", start: float = 0.0, minutes: int = 10) -> None:
    """Correctable ECC rising 20 a minute, then remaps pending from minute 6."""
    for m in range(minutes + 1):
        trends.observe(gpu, start + 60 * m, {"ecc_corrected": 20 * m,
                                             "remap_pending": 1 if m >= 6 else 0})  # fmt: skip


def test_rising_ecc_then_pending_remaps_is_failing_one_signal_is_not():
    t = Trends()
    for m in range(6):
        t.observe("GPU-1", 60 * m, {"ecc_corrected": 20 * m, "remap_pending": 0})
    assert t.failing() == {}  # 100 new correctable errors alone: watched, not failing
    assert [s.name for s, _ in t.over("GPU-1")] == ["ecc_corrected"]
    t.observe("GPU-1", 360, {"ecc_corrected": 120, "remap_pending": 1})
    [(gpu, over)] = t.failing().items()
    assert gpu == "GPU-1" and [s.name for s, _ in over] == ["ecc_corrected", "remap_pending"]
    assert (
        describe(over) == "120 new correctable ECC errors, 1 row remaps pending (limits per 10 min)"
    )


def test_the_window_forgets_old_errors_and_a_reset_counts_nothing():
    t = Trends(window=600)
    degrading(t)
    assert "GPU-1" in t.failing()
    # ten quiet minutes later: the errors left the window, the remaps were done
    for m in range(11, 22):
        t.observe("GPU-1", 60 * m, {"ecc_corrected": 200, "remap_pending": 0})
    assert t.failing() == {}
    # a GPU reset zeroes the counter: no rise, nothing counted
    t.observe("GPU-1", 60 * 22, {"ecc_corrected": 0})
    assert t.over("GPU-1") == []


def test_unread_values_and_gone_gpus():
    t = Trends()
    t.observe("GPU-2", 0, {"ecc_corrected": None, "pcie_replay": "x"})
    assert t.over("GPU-2") == [] and t.over("GPU-9") == []
    degrading(t, "GPU-1")
    t.forget({"GPU-2"})
    assert t.failing() == {} and t.over("GPU-1") == []


def test_the_table():
    assert FAILING_SIGNALS >= 2  # one noisy counter never drains a node
    assert len({s.name for s in SIGNALS}) == len(SIGNALS) and all(s.limit > 0 for s in SIGNALS)


def test_the_agent_calls_a_gpu_failing_from_its_counters_and_not_from_one_of_them(tmp_path):
    """Through the GPU collector and the node verdict, on the NVML double: NVLink replays
    alone leave the node healthy; with PCIe replays piling up too, that GPU is failing (a
    degraded node), the other is not."""
    from rankguard.agent.config import AgentConfig
    from rankguard.agent.daemon import Agent
    from rankguard.agent.nvml_double import NvmlDouble, make_double

    nvml = NvmlDouble(make_double(n_gpus=2))
    cfg = AgentConfig(bind="127.0.0.1:0", interval=0.2, expected_gpus=2, node="n0",
                      telemetry_socket=str(tmp_path / "t.sock"))  # fmt: skip
    agent = Agent(cfg, nvml=nvml)
    try:
        agent.collect_once()
        errors = {"crc_flit": 0, "crc_data": 0, "replay": 5000, "recovery": 0}
        nvml.update_gpu(1, nvlink_errors=errors)
        agent.collect_once()
        assert agent.verdict().status == "healthy"  # one signal: watched, not failing
        nvml.update_gpu(1, pcie_replays=400)
        agent.collect_once()
        verdict = agent.verdict()
        assert verdict.status == "degraded", verdict
        [failing] = [r for r in verdict.reasons if r.code == "gpu_failing"]
        assert "GPU 1" in failing.message
        assert "5000 new NVLink replays, 400 new PCIe replays" in failing.message
    finally:
        agent.close()
