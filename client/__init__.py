"""rankguard.client: the rank side of rankguard, for any training script.

Imports with the standard library alone; torch is imported only by the parts that need
it (CUDA event timing, the DDP comm hook, the FSDP2 collectives), when they are used.
Nothing here blocks on the node agent or raises into training: failures are counted.

- :class:`Reporter`: a few lines in a loop give the agent the step, its phases, loss,
  tokens, and heartbeats during long phases (see :mod:`rankguard.client.reporter`).
- :class:`TelemetrySender`: the non-blocking datagram sender underneath.
- :mod:`rankguard.client.flight_recorder`: the rank's wavefront (each process group's last
  enqueued and completed collective) from torch's flight recorder, which the Reporter
  sends while the rank stalls; ``enable()`` turns the recorder on before the group exists.
- :class:`CheckpointStore`: validated checkpoints (manifest, checksums, quarantine,
  keep-K) of a script's own state: ``save(step, state)``, ``resume()``, ``latest()``,
  ``load()``; never validates a state after a NaN/Inf loss. Its on-disk layout is
  :mod:`rankguard.client.checkpoint_store` (shared with the trainer and the CLI).
- :class:`StepTimer`, :func:`attach_ddp`, :func:`attach_fsdp` (and the hook
  :func:`timed_allreduce_hook`): the timing machinery (phase marks, communication
  intervals) for loops that drive it themselves and report with ``Reporter.report()``, as
  the bundled trainer does. They only observe: DDP's group, arithmetic and a user's comm
  hook, FSDP2's collectives, stay as they were.
"""

from .checkpoints import CheckpointError, CheckpointStatus, CheckpointStore
from .reporter import ERROR_REASONS, STEP_PHASES, Reporter, Step
from .sender import DROP_REASONS, TelemetrySender
from .timing import (
    Clock,
    StepTimer,
    StepTiming,
    attach_ddp,
    attach_fsdp,
    timed_allreduce_hook,
    timed_batches,
    union_length,
)

__all__ = [
    "CheckpointError",
    "CheckpointStatus",
    "CheckpointStore",
    "DROP_REASONS",
    "ERROR_REASONS",
    "STEP_PHASES",
    "Clock",
    "Reporter",
    "Step",
    "StepTimer",
    "StepTiming",
    "TelemetrySender",
    "attach_ddp",
    "attach_fsdp",
    "timed_allreduce_hook",
    "timed_batches",
    "union_length",
]
