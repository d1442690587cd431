"""InfiniBand/RoCE port counters and port state (agent/collectors/network.py) and their
health reasons. This machine has no InfiniBand: every test builds a fake sysfs tree
(class/infiniband/<dev>/ports/<n>/...) under tmp_path and points the collector's
`sys_root` at it."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from rankguard.agent.collectors import CollectorContext, CollectorResult
from rankguard.agent.collectors.network import (
    NetworkCollector,
    ib_port_judgement,
    read_ib_counters,
)
from rankguard.agent.exposition import make_registry
from rankguard.agent.health import infiniband_reasons, node_verdict

COUNTERS = {"symbol_error": 3, "link_downed": 1, "link_error_recovery": 0, "port_rcv_errors": 7,
            "port_xmit_discards": 2, "port_xmit_wait": 123456, "port_rcv_data": 10,
            "port_xmit_data": 20}  # fmt: skip


def fake_port(sys_root: Path, dev: str = "mlx5_0", port: int = 1, state: str = "4: ACTIVE",
              rate: str = "400 Gb/sec (4X NDR)", **counters) -> Path:  # fmt: skip
    """A fake sysfs port directory as the kernel's ib_core lays it out."""
    d = sys_root / "class/infiniband" / dev / "ports" / str(port)
    (d / "counters").mkdir(parents=True, exist_ok=True)
    (d / "state").write_text(state + "\n")
    (d / "rate").write_text(rate + "\n")
    for name, value in {**COUNTERS, **counters}.items():
        path = d / "counters" / name
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(f"{value}\n")
    return d


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def collector(tmp_path: Path) -> NetworkCollector:
    proc = tmp_path / "proc/net"
    proc.mkdir(parents=True)
    (proc / "dev").write_text(
        "Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed "
        "multicast|bytes packets errs drop fifo colls carrier compressed\n"
    )
    return NetworkCollector(CollectorContext(proc_root=tmp_path / "proc",
                                             sys_root=tmp_path / "sys", clock=Clock()))  # fmt: skip


def samples(result: CollectorResult, name: str) -> dict[tuple, float]:
    return next(dict(m.samples) for m in result.metrics if m.name == name)


def test_error_counters_and_transmit_wait_are_read_from_sysfs(tmp_path):
    fake_port(tmp_path / "sys")
    r = collector(tmp_path).collect()
    errors = samples(r, "rankguard_infiniband_errors_total")
    assert errors == {("mlx5_0", "1", "symbol_error"): 3, ("mlx5_0", "1", "link_downed"): 1,
                      ("mlx5_0", "1", "link_error_recovery"): 0,
                      ("mlx5_0", "1", "receive_errors"): 7,
                      ("mlx5_0", "1", "transmit_discards"): 2}  # fmt: skip
    assert samples(r, "rankguard_infiniband_transmit_wait_total") == {("mlx5_0", "1"): 123456}
    port = r.facts["infiniband"][0]
    assert port["errors"]["symbol_error"] == 3 and "counters_skipped" not in port
    assert port["up"] and not port["down"] and not port["below_rate"]


def test_missing_and_garbage_counter_files_are_skipped_not_fatal(tmp_path):
    fake_port(tmp_path / "sys", symbol_error=None, port_rcv_errors="garbage",
              link_downed="N/A (no PMA)")  # fmt: skip
    r = collector(tmp_path).collect()
    port = r.facts["infiniband"][0]
    skipped = " | ".join(port["counters_skipped"])
    assert "symbol_error: missing" in skipped and "port_rcv_errors" in skipped
    assert "expected an integer" in skipped and "link_downed: N/A" in skipped
    errors = samples(r, "rankguard_infiniband_errors_total")
    assert set(errors) == {("mlx5_0", "1", "link_error_recovery"),
                           ("mlx5_0", "1", "transmit_discards")}  # fmt: skip
    # the port's state and data counters are still read
    assert samples(r, "rankguard_infiniband_port_up") == {("mlx5_0", "1"): 1}
    assert samples(r, "rankguard_infiniband_receive_bytes_total") == {("mlx5_0", "1"): 40}


def test_read_ib_counters_without_a_counters_dir(tmp_path):
    counts, skipped = read_ib_counters(tmp_path / "nothing")
    assert counts == {} and len(skipped) == 6


def test_a_port_that_goes_down_is_unhealthy_and_an_unused_one_is_not(tmp_path):
    sys_root = tmp_path / "sys"
    fake_port(sys_root, "mlx5_0")
    fake_port(sys_root, "mlx5_1", state="1: DOWN", rate="10 Gb/sec (4X SDR)")  # never cabled
    c = collector(tmp_path)
    r = c.collect()
    assert infiniband_reasons(r.facts) == []
    fake_port(sys_root, "mlx5_0", state="1: DOWN")
    r = c.collect()
    reasons = infiniband_reasons(r.facts)
    assert [(x.code, x.severity) for x in reasons] == [("ib_port_down", "unhealthy")]
    assert "mlx5_0/1 is DOWN (it was ACTIVE)" in reasons[0].message
    verdict = node_verdict({"network": r.facts}, [], None)
    assert verdict.status == "unhealthy"
    fake_port(sys_root, "mlx5_0")  # back up
    assert infiniband_reasons(c.collect().facts) == []


def test_a_port_below_the_rate_it_ran_at_is_degraded(tmp_path):
    sys_root = tmp_path / "sys"
    fake_port(sys_root)
    c = collector(tmp_path)
    c.collect()
    fake_port(sys_root, rate="200 Gb/sec (2X NDR)")  # retrained to half its lanes
    reasons = infiniband_reasons(c.collect().facts)
    assert [(x.code, x.severity) for x in reasons] == [("ib_port_below_rate", "degraded")]
    assert "200 Gb/s, below the 400 Gb/s" in reasons[0].message


def test_port_judgement_is_pure():
    up = {"up": True, "rate_bytes_per_second": 25e9}
    assert ib_port_judgement(up, 50e9, True)["below_rate"] is True
    assert ib_port_judgement(up, 25e9, True) == {"down": False, "below_rate": False,
                                                 "best_rate_bytes_per_second": 25e9}  # fmt: skip
    assert ib_port_judgement({"up": False}, None, False)["down"] is False  # never seen up
    assert ib_port_judgement({"up": False}, 50e9, True)["down"] is True


def test_exposition_of_the_port_counters(tmp_path):
    fake_port(tmp_path / "sys")
    r = collector(tmp_path).collect()
    text = generate_latest(make_registry(lambda: r.metrics)).decode()
    assert "# TYPE rankguard_infiniband_errors_total counter" in text
    assert ('rankguard_infiniband_errors_total{device="mlx5_0",port="1",type="symbol_error"} 3.0'
            in text)  # fmt: skip
    assert "# TYPE rankguard_infiniband_transmit_wait_total counter" in text
