"""A loss spike one batch long is still a finding at the next polls: the numerics detector
judges each rank's newest steps, not only its latest loss."""

from __future__ import annotations

import dataclasses

from builders import CFG, cluster, rank, sample

from rankguard.supervisor.detectors import numerics
from rankguard.supervisor.model import History


def losses(values):
    return tuple(sample(i + 1, loss=v) for i, v in enumerate(values))


def test_a_one_step_spike_is_found_while_it_is_among_the_newest_steps():
    calm = [3.0 + 0.01 * (i % 7) for i in range(40)]
    after = [*calm, 39.0, 3.02, 3.01, 3.03]  # step 41 spiked, then the loss is calm again
    spiked = rank(1, step=44, loss=3.03, recent=losses(after))
    [f] = numerics.detect(cluster(rank(0, step=44, recent=losses(calm + [3.0] * 4)), spiked),
                          History(), CFG)  # fmt: skip
    assert (f.rank, f.evidence["anomaly_step"], f.evidence["loss"]) == (1, 41, 39.0)
    # once it is older than the newest `spike_recent_steps` steps it is history
    later = rank(1, step=52, loss=3.0, recent=losses([*after, *[3.0] * 8]))
    assert numerics.detect(cluster(later), History(), CFG) == []
    wider = dataclasses.replace(
        CFG, numerics=dataclasses.replace(CFG.numerics, spike_recent_steps=12)
    )
    [f] = numerics.detect(cluster(later), History(), wider)
    assert f.evidence["anomaly_step"] == 41
