"""Host collector: CPU, memory and load of the node, and the agent's own footprint."""

from __future__ import annotations

from .. import procfs
from . import (
    Collector,
    CollectorContext,
    CollectorResult,
    CollectorSettings,
    counter,
    gauge,
    register,
)

# The modes of rankguard_host_cpu_seconds_total. guest/guest_nice are left out: the
# kernel already counts them inside user/nice, so sum(by mode) stays the real total.
EXPORTED_CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@register
class HostCollector(Collector):
    name = "host"

    def __init__(self, ctx: CollectorContext, config: CollectorSettings | None = None):
        super().__init__(ctx, config)
        self._prev_cpu: procfs.CpuStat | None = None

    def collect(self) -> CollectorResult:
        root = self.ctx.proc_root
        cpu = procfs.read_stat(root)
        mem = procfs.read_meminfo(root)
        load = procfs.read_loadavg(root)
        own = procfs.read_pid_stat(root, "self")

        utilization = self._utilization(cpu)
        mem_total = mem["MemTotal"]
        # MemAvailable exists since Linux 3.14; before it, free + reclaimable page cache
        mem_available = mem.get(
            "MemAvailable", mem.get("MemFree", 0) + mem.get("Buffers", 0) + mem.get("Cached", 0)
        )
        agent_cpu = own.utime_seconds + own.stime_seconds

        cpu_seconds = counter(
            "rankguard_host_cpu_seconds_total",
            "CPU time spent in each mode, summed over all CPUs.",
            ("mode",),
        )
        for mode in EXPORTED_CPU_MODES:
            if mode in cpu.seconds:  # old kernels lack the later columns
                cpu_seconds.add((mode,), cpu.seconds[mode])
        metrics = [
            cpu_seconds,
            gauge(
                "rankguard_host_cpu_utilization_ratio",
                "Busy fraction of all CPUs since the previous collection (0 on the first).",
            ).add((), utilization),
            gauge("rankguard_host_cpus", "Online CPUs.").add((), cpu.cpus),
            gauge("rankguard_host_memory_total_bytes", "Usable physical memory.").add(
                (), mem_total
            ),
            gauge(
                "rankguard_host_memory_available_bytes",
                "Memory available for new work without swapping (MemAvailable).",
            ).add((), mem_available),
            gauge("rankguard_host_load1", "1-minute load average.").add((), load.load1),
            gauge("rankguard_host_load5", "5-minute load average.").add((), load.load5),
            gauge("rankguard_host_load15", "15-minute load average.").add((), load.load15),
            counter(
                "rankguard_agent_cpu_seconds_total", "CPU time (user + system) used by the agent."
            ).add((), agent_cpu),
            gauge(
                "rankguard_agent_resident_memory_bytes", "Resident memory of the agent process."
            ).add((), own.rss_bytes),
        ]
        facts = {
            "cpu_count": cpu.cpus,
            "cpu_utilization_ratio": utilization,
            "memory_total_bytes": mem_total,
            "memory_available_bytes": mem_available,
            "memory_available_ratio": mem_available / mem_total if mem_total else 0.0,
            "load1": load.load1,
            "load5": load.load5,
            "load15": load.load15,
            "agent_cpu_seconds": agent_cpu,
            "agent_resident_memory_bytes": own.rss_bytes,
        }
        return CollectorResult(metrics, facts)

    def _utilization(self, cpu: procfs.CpuStat) -> float:
        # From tick deltas rather than wall time: exact, and immune to a late collection.
        prev, self._prev_cpu = self._prev_cpu, cpu
        if prev is None:
            return 0.0
        total = cpu.total_seconds - prev.total_seconds
        busy = cpu.busy_seconds - prev.busy_seconds
        if total <= 0:
            return 0.0
        return min(1.0, max(0.0, busy / total))
