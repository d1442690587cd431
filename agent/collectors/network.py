"""Network collector: interface counters from /proc/net/dev and InfiniBand ports from
/sys/class/infiniband (the fabric NCCL uses between nodes).

/metrics carries counters only (Prometheus computes rates); the facts carry rates over
the interval since the previous collection. Each InfiniBand/RoCE port's error counters
(symbol errors, link downed, receive errors, transmit discards and waits) are read too,
and the health verdict is told of a port that was ACTIVE and is not, or that runs below
the best rate it ran at (the sysfs root is `ctx.sys_root`, so tests use a fake tree).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import procfs
from . import (
    Collector,
    CollectorContext,
    CollectorResult,
    CollectorSettings,
    Metric,
    counter,
    gauge,
    register,
)

# NetDevStats field -> metric stem (rankguard_network_<stem>_total, also the facts key), help.
NET_COUNTERS = (
    ("rx_bytes", "receive_bytes", "Bytes received."),
    ("tx_bytes", "transmit_bytes", "Bytes transmitted."),
    ("rx_packets", "receive_packets", "Packets received."),
    ("tx_packets", "transmit_packets", "Packets transmitted."),
    ("rx_errs", "receive_errors", "Receive errors reported by the driver."),
    ("tx_errs", "transmit_errors", "Transmit errors reported by the driver."),
    ("rx_drop", "receive_drops", "Received packets dropped (no buffer, unknown protocol, ...)."),
    ("tx_drop", "transmit_drops", "Packets dropped before transmission."),
)

IB_ACTIVE = 4  # "4: ACTIVE" in ports/<n>/state

# Error counters of ports/<n>/counters/: file -> type label of
# rankguard_infiniband_errors_total. A rising symbol_error or link_error_recovery is a
# failing cable or transceiver; link_downed counts the link going down.
IB_ERROR_COUNTERS = {
    "symbol_error": "symbol_error",
    "link_downed": "link_downed",
    "link_error_recovery": "link_error_recovery",
    "port_rcv_errors": "receive_errors",
    "port_xmit_discards": "transmit_discards",
}
IB_XMIT_WAIT = "port_xmit_wait"  # ticks the port had data to send but no credit (congestion)


def read_ib_counters(counters_dir: Path) -> tuple[dict[str, int], list[str]]:
    """The port's error counters (type label -> count, plus "transmit_wait") and the
    counters skipped with why (a missing file, garbage, "N/A"): one bad file never hides
    the others."""
    out: dict[str, int] = {}
    skipped: list[str] = []
    for name, key in (*IB_ERROR_COUNTERS.items(), (IB_XMIT_WAIT, "transmit_wait")):
        path = counters_dir / name
        try:
            value = procfs.parse_counter(path.read_text(), str(path))
        except FileNotFoundError:
            skipped.append(f"{name}: missing")
            continue
        except (OSError, procfs.ProcParseError) as exc:
            skipped.append(f"{name}: {exc}")
            continue
        if value is None:
            skipped.append(f"{name}: N/A")
            continue
        out[key] = value
    return out, skipped


def ib_port_judgement(port: dict, best_rate: float | None, seen_up: bool) -> dict[str, Any]:
    """Pure: what the health verdict needs of a port, from this reading and what the
    agent saw of it before: a port that was ACTIVE and is not (`down`), and an active
    port below the best rate it ran at (`below_rate`: it retrained to fewer lanes or a
    lower speed). A port never seen ACTIVE (an unused one) is not judged."""
    rate = port.get("rate_bytes_per_second")
    return {
        "down": seen_up and not port.get("up"),
        "best_rate_bytes_per_second": best_rate,
        "below_rate": bool(port.get("up") and rate and best_rate and rate < best_rate),
    }


def read_ib_port(port_dir: Path) -> dict[str, Any]:
    """One port's state, link rate and data counters (bytes). port_rcv_data and
    port_xmit_data count 4-byte words. Older drivers keep 32-bit counters (which stop
    at 16 GiB) in counters/ and 64-bit copies in counters_ext/*_64: prefer those."""
    state_num, state = procfs.parse_ib_state(
        (port_dir / "state").read_text(), str(port_dir / "state")
    )
    out: dict[str, Any] = {"state": state, "up": state_num == IB_ACTIVE}
    try:
        out["rate_bytes_per_second"] = procfs.parse_ib_rate((port_dir / "rate").read_text())
    except (OSError, procfs.ProcParseError):
        out["rate_bytes_per_second"] = None  # some drivers leave rate empty while down
    for key, name in (("receive_bytes", "port_rcv_data"), ("transmit_bytes", "port_xmit_data")):
        words = None
        for path in (port_dir / "counters_ext" / f"{name}_64", port_dir / "counters" / name):
            if path.is_file():
                words = procfs.parse_counter(path.read_text(), str(path))
                break
        out[key] = None if words is None else words * 4
    return out


@register
class NetworkCollector(Collector):
    name = "network"

    def __init__(self, ctx: CollectorContext, config: CollectorSettings | None = None):
        super().__init__(ctx, config)
        self._prev: tuple[float, dict[Any, Any]] | None = None
        # (device, port) -> the best rate it ran at while ACTIVE (it was seen up)
        self._ib_best: dict[tuple[str, str], float | None] = {}

    def collect(self) -> CollectorResult:
        now = self.ctx.clock()
        prev_t, prev = self._prev or (None, {})
        dt = now - prev_t if prev_t is not None else None
        current: dict[Any, Any] = {}
        result = CollectorResult(facts={"interval_seconds": dt})

        # interfaces
        families = {
            field: counter(f"rankguard_network_{stem}_total", help_, ("device",))
            for field, stem, help_ in NET_COUNTERS
        }
        interfaces: dict[str, Any] = {}
        for dev, stats in sorted(procfs.read_net_dev(self.ctx.proc_root).items()):
            if dev == "lo":  # local traffic says nothing about the node's links
                continue
            current[dev] = stats
            old = prev.get(dev)
            interfaces[dev] = {}
            for field, stem, _ in NET_COUNTERS:
                value = getattr(stats, field)
                families[field].add((dev,), value)
                if stem.endswith(("bytes", "packets")):  # rates; errors and drops: totals
                    old_value = getattr(old, field) if old else None
                    interfaces[dev][f"{stem}_per_second"] = procfs.per_second(old_value, value, dt)
                else:
                    interfaces[dev][stem] = value
        result.metrics += families.values()
        result.facts["interfaces"] = interfaces

        # InfiniBand
        ib_root = self.ctx.sys_root / "class" / "infiniband"
        if ib_root.is_dir():
            result.metrics += self._infiniband(ib_root, prev, current, dt, result.facts)
        self._prev = (now, current)
        return result

    def _infiniband(
        self, ib_root: Path, prev: dict, current: dict, dt: float | None, facts: dict
    ) -> list[Metric]:
        labels = ("device", "port")
        rx = counter(
            "rankguard_infiniband_receive_bytes_total", "Data received on the port.", labels
        )
        tx = counter(
            "rankguard_infiniband_transmit_bytes_total", "Data transmitted on the port.", labels
        )
        up = gauge("rankguard_infiniband_port_up", "1 if the port state is ACTIVE.", labels)
        rate = gauge(
            "rankguard_infiniband_rate_bytes_per_second",
            "Negotiated link rate of the port.",
            labels,
        )
        errors = counter("rankguard_infiniband_errors_total",
                         "Port error counters by type (symbol_error, link_downed, "
                         "link_error_recovery, receive_errors, transmit_discards).",
                         (*labels, "type"))  # fmt: skip
        xmit_wait = counter("rankguard_infiniband_transmit_wait_total",
                            "Ticks the port had data to send but no flow-control credit "
                            "(congestion).", labels)  # fmt: skip
        ports: list[dict[str, Any]] = []
        for port_dir in sorted(ib_root.glob("*/ports/*")):
            device, port = port_dir.parent.parent.name, port_dir.name
            try:
                p = read_ib_port(port_dir)
            except (OSError, procfs.ProcParseError) as exc:
                # one broken port never hides the others
                ports.append({"device": device, "port": port, "error": str(exc)})
                continue
            key = ("ib", device, port)
            current[key] = p
            old = prev.get(key) or {}
            up.add((device, port), 1.0 if p["up"] else 0.0)
            if p["rate_bytes_per_second"] is not None:
                rate.add((device, port), p["rate_bytes_per_second"])
            for family, k in ((rx, "receive_bytes"), (tx, "transmit_bytes")):
                if p[k] is not None:
                    family.add((device, port), p[k])
                    p[f"{k}_per_second"] = procfs.per_second(old.get(k), p[k], dt)
            counts, skipped = read_ib_counters(port_dir / "counters")
            for kind, n in sorted(counts.items()):
                if kind == "transmit_wait":
                    xmit_wait.add((device, port), n)
                else:
                    errors.add((device, port, kind), n)
            p["errors"] = {k: n for k, n in counts.items() if k != "transmit_wait"}
            if skipped:
                p["counters_skipped"] = skipped
            seen_up = (device, port) in self._ib_best
            if p["up"]:
                best = max(self._ib_best.get((device, port)) or 0.0,
                           p["rate_bytes_per_second"] or 0.0)  # fmt: skip
                self._ib_best[(device, port)] = best or None
                seen_up = True
            p.update(ib_port_judgement(p, self._ib_best.get((device, port)), seen_up))
            ports.append({"device": device, "port": port, **p})
        facts["infiniband"] = ports
        return [rx, tx, up, rate, errors, xmit_wait]
