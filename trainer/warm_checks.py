"""What makes a warm fork unlike a cold start, as pure functions (trainer/warm.py uses them).

A forked worker inherits everything the warm server set up when it imported torch. Some of
that cannot be redone in the child: a CUDA context (a forked one is unusable), settings read
from the environment at import, and the process's CPUs and cgroup (the server's, not those
torchrun, numactl or Slurm `--cpu-bind` gave the shim). These functions say which apply to a
request; warm.py either applies them in the worker or has the shim start cold.
"""

from __future__ import annotations

import os
import sys

# Environment read once, when the server imported torch (prefix or name, why). A job whose
# value differs from the server's (set, unset or changed) is not served by a fork.
IMPORT_TIME: tuple[tuple[str, str], ...] = (
    ("TORCHINDUCTOR_", "torch._inductor.config reads it at import, with torch._dynamo"),
    ("TORCHDYNAMO_", "torch._dynamo.config and torch.fx.experimental._config read it at import"),
    ("TORCH_DYNAMO_", "torch._dynamo.config reads it at import: automatic dynamic shapes, PGO"),
    ("TORCH_COMPILE_", "the compiler, dynamo and functorch configs read it at import"),
    ("TORCH_LOGS", "torch._logging sets up its log handlers at `import torch`"),
    ("TORCH_TRACE", "torch._logging picks the tlparse trace directory at `import torch`"),
    ("TORCH_DTRACE", "torch._logging picks the trace directory at `import torch`"),
    ("OMP_", "libgomp reads its settings when torch loads it"),
    ("GOMP_", "libgomp reads its settings when torch loads it"),
    ("MKL_NUM_THREADS", "torch's thread count was fixed from it in the server"),
    ("PYTHONPATH", "sys.path is built at interpreter start: the worker has the server's"),
    ("PYTHONHASHSEED", "str hashes are seeded at interpreter start"),
)
PREFIXES = tuple(prefix for prefix, _ in IMPORT_TIME)


def applied(name: str, value: str | None) -> bool:
    """Differences the worker applies itself: OMP_NUM_THREADS when it is a whole number or
    unset (torch.set_num_threads, worker_threads below)."""
    return name == "OMP_NUM_THREADS" and (value is None or _whole(value))


def unhonoured(server_env: dict[str, str], job_env: dict[str, str]) -> list[str]:
    """The variables whose job value differs from the server's and that a fork of the server
    would silently ignore (IMPORT_TIME, less what applied() covers), sorted."""
    return sorted(
        name
        for name in server_env.keys() | job_env.keys()
        if name.startswith(PREFIXES)
        and server_env.get(name) != job_env.get(name)
        and not applied(name, job_env.get(name))
    )


def env_reason(names: list[str]) -> str:
    """One line for the shim's stderr: which variables, and why the first cannot be applied."""
    why = next(why for prefix, why in IMPORT_TIME if names[0].startswith(prefix))
    verb = "differs" if len(names) == 1 else "differ"
    return f"the job's {', '.join(names)} {verb} from the warm server's; {names[0]}: {why}"


def cuda_initialised() -> bool:
    """Whether this process holds a CUDA context: a forked child's first CUDA call fails.
    torch's own flag (torch.cuda.is_initialized). On a CPU build the tests stand in for a
    CUDA init by setting torch.cuda._initialized, the flag CUDA init sets."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def worker_threads(job: str | None, server: str | None, current: int, cpus: int) -> int | None:
    """torch's thread count for a worker on `cpus` CPUs, None to keep the server's `current`.
    OMP_NUM_THREADS when the job sets a whole number (torch read the server's at import);
    else about what a cold start picks, one thread per CPU it may use at most (measured,
    torch 2.13: `taskset -c 0` gives 1): all of them when the server's count came from its
    own OMP_NUM_THREADS, the server's default capped at them otherwise."""
    if job is not None:
        want = int(job) if _whole(job) else current  # else the server's same value: unhonoured
    elif server is not None:
        want = cpus
    else:
        want = min(current, cpus)
    return None if want == current else want


def cgroup_procs(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> str | None:
    """The cgroup v2 `cgroup.procs` file of the process whose /proc/PID/cgroup text this is
    (writing a pid there moves that process in); None without a v2 (`0::`) entry."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return os.path.join(root, line[3:].lstrip("/"), "cgroup.procs")
    return None


def _whole(value: str) -> bool:
    return value.isdigit() and int(value) > 0
