"""Keeping Python's cycle collector from stopping the supervisor for half a second.

At 1,024 nodes the supervisor holds a few million tracked objects (every rank's sample
window, the last observation). A full (generation 2) collection walks all of them while
holding the GIL: 0.3 to 0.5 s every ~2 s, freeing nothing (the data is acyclic and freed
by reference counting), and an announced death waited behind it
(bench/results/supervisor_scale.md). So after each full pass everything alive is frozen
(`gc.freeze`: left out of later collections), and the collections walk only what is newer.
The youngest generation's threshold is raised as well (700 allocations by default): the
polls allocate tens of thousands of objects a second that live until the next pass, and
each collection walked them again on the way to generation 2.

What freezing costs: a reference cycle that becomes garbage after it was frozen is not
collected until an unfreeze. So every `full_every` seconds everything is unfrozen and
collected once, at a known point (right after a pass), its time logged.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("rankguard.supervisor")

FULL_EVERY_SECONDS = 600.0
YOUNG_THRESHOLD = 20_000


class HeapPacer:
    def __init__(self, full_every: float = FULL_EVERY_SECONDS,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.full_every = full_every
        self.clock = clock
        self._last_full = clock()
        self.full_collections = 0
        self._thresholds: tuple[int, ...] | None = None  # the process's, until the first pass

    def after_pass(self) -> None:
        if self._thresholds is None:  # only a running loop changes the process's collector
            self._thresholds = gc.get_threshold()
            gc.set_threshold(YOUNG_THRESHOLD, *self._thresholds[1:])
        if self.clock() - self._last_full >= self.full_every:
            started = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            self._last_full = self.clock()
            self.full_collections += 1
            log.debug("full collection: %d unreachable objects in %.3f s", found,
                      time.perf_counter() - started)  # fmt: skip
        gc.freeze()

    def close(self) -> None:
        """Back to normal collection (a supervisor run inside a longer-lived process)."""
        if self._thresholds is not None:
            gc.unfreeze()
            gc.set_threshold(*self._thresholds)
            self._thresholds = None
