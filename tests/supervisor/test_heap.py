"""The supervisor's paced cycle collection (supervisor/heap.py)."""

from __future__ import annotations

import gc
import weakref

from rankguard.supervisor.heap import YOUNG_THRESHOLD, HeapPacer


class Cycle:
    def __init__(self):
        self.me = self


def test_a_pass_freezes_what_is_alive_and_close_restores_normal_collection():
    before = gc.get_threshold()
    pacer = HeapPacer(full_every=600, clock=lambda: 0.0)
    try:
        assert gc.get_threshold() == before  # a supervisor that never runs changes nothing
        kept = [object() for _ in range(10)]
        pacer.after_pass()
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        assert gc.get_freeze_count() > len(kept)
    finally:
        pacer.close()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_a_frozen_cycle_is_collected_by_the_paced_full_collection():
    now = [0.0]
    pacer = HeapPacer(full_every=600, clock=lambda: now[0])
    try:
        gc.collect()
        pacer.after_pass()
        cycle = Cycle()
        gone = weakref.ref(cycle)
        pacer.after_pass()  # the cycle is frozen now: a collection skips it
        del cycle
        gc.collect()
        assert gone() is not None
        now[0] = 601.0
        pacer.after_pass()  # past full_every: unfreeze, collect everything, freeze again
        assert pacer.full_collections == 1 and gone() is None
    finally:
        pacer.close()
