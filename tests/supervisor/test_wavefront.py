"""The culprit of a hang from the ranks' flight-recorder wavefronts (supervisor/wavefront.py),
and what the hang detector and the policy make of it."""

from __future__ import annotations

import dataclasses

from builders import CFG, T0, cluster, hung, trained

from rankguard.contract.answers import CollectiveAnswer
from rankguard.supervisor import model, policy
from rankguard.supervisor.detectors import dead, hang, process_hang
from rankguard.supervisor.model import History
from rankguard.supervisor.wavefront import BEHIND, BELOW, DESYNC, read_wavefront


def coll(pg="0", enqueued=10, completed=10, op="gloo:all_reduce", shape="[[4]]"):
    return CollectiveAnswer(pg=pg, desc="default_pg" if pg == "0" else "", enqueued=enqueued,
                            completed=completed, op=op, shape=shape, timeout_s=1800.0)  # fmt: skip


def with_waves(ranks, *waves, age=1.0):
    return [
        dataclasses.replace(r, collectives=tuple(w), collectives_age_seconds=age)
        for r, w in zip(ranks, waves, strict=True)
    ]


def test_the_rank_that_never_enqueued_the_collective_is_the_culprit():
    """Ranks 0 and 2 wait in collective 11 of the default group; rank 1 stopped at 10 with
    everything it enqueued completed: it is stuck outside, in its own code."""
    ranks = with_waves(hung(3), [coll(enqueued=11)], [coll()], [coll(enqueued=11)])
    w = read_wavefront(ranks)
    assert (w.verdict, w.ranks, w.pg, w.seq) == (BEHIND, (1,), "0", 11), w
    assert w.reached == {0: 11, 1: 10, 2: 11}
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 1 and "flight recorder" in f.evidence["culprit_reason"], f
    assert f.evidence["wavefront"]["verdict"] == BEHIND
    assert f.evidence["wavefront"]["reached"] == {"0": 11, "1": 10, "2": 11}
    assert f.evidence["stacks_needed"] is False


def test_a_chain_across_groups_ends_at_the_rank_waiting_nowhere():
    """Two groups: ranks 0 and 1 wait in dp's collective 5, which ranks 2 and 3 never
    enqueued. Rank 3 is itself waiting (in tp, for the others); rank 2 waits nowhere: the
    end of the chain is the culprit, not a victim that is behind while it waits."""
    ranks = with_waves(
        hung(4),
        [coll("dp", 5, 4), coll("tp", 7, 7)],  # rank 0: waits in dp 5
        [coll("dp", 5, 4), coll("tp", 7, 7)],  # rank 1: waits in dp 5
        [coll("dp", 4, 4), coll("tp", 7, 7)],  # rank 2: behind in dp, waits nowhere
        [coll("dp", 4, 4), coll("tp", 8, 7)],  # rank 3: behind in dp, but waits in tp
    )
    w = read_wavefront(ranks)
    assert (w.verdict, w.ranks, w.pg) == (BEHIND, (2,), "dp"), w


def test_every_member_enqueued_and_none_completed_is_below_the_ranks():
    ranks = with_waves(hung(2), [coll(enqueued=11)], [coll(enqueued=11)])
    w = read_wavefront(ranks)
    assert (w.verdict, w.ranks, w.seq) == (BELOW, (0, 1), 11), w
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank is None and f.evidence["wavefront"]["verdict"] == BELOW
    assert "none completed" in f.evidence["culprit_reason"]
    assert f.evidence["stacks_needed"] is True  # the stacks may still tell, then a restart


def test_a_desync_names_the_odd_rank_and_stops_the_job():
    ranks = with_waves(
        hung(3),
        [coll(enqueued=11, completed=10)],
        [coll(enqueued=11, completed=10, op="gloo:broadcast")],
        [coll(enqueued=11, completed=10)],
    )
    w = read_wavefront(ranks)
    assert (w.verdict, w.ranks, w.seq) == (DESYNC, (1,), 11), w
    assert "gloo:broadcast" in w.detail and "gloo:all_reduce" in w.detail
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 1 and f.evidence["desync"] is True, f
    [d] = policy.decide([f], policy.PolicyView(), policy.PolicyConfig(), T0)
    assert d.action == model.ACT_STOP_JOB and "desync" in d.reason, d
    # a different size at the same collective is a desync too
    ranks[1] = dataclasses.replace(
        ranks[1], collectives=(coll(enqueued=11, completed=10, shape="[[8]]"),)
    )
    assert read_wavefront(ranks).verdict == DESYNC


def test_an_incomplete_or_stale_reading_concludes_nothing():
    waves = ([coll(enqueued=11)], [coll()], [coll(enqueued=11)])
    ranks = with_waves(hung(3), *waves)
    ranks[2] = dataclasses.replace(ranks[2], collectives=())  # its recorder said nothing
    assert read_wavefront(ranks) is None
    assert read_wavefront(with_waves(hung(3), *waves, age=60.0)) is None  # where it was
    # in step, nothing pending: nothing to say either
    assert read_wavefront(with_waves(hung(2), [coll()], [coll()])) is None


def test_a_death_by_collective_timeout_names_the_rank_it_waited_for():
    """NCCL's watchdog (a gloo timeout here) ends the ranks that wait, never the one they
    wait for: rank 0 died first, waiting in collective 11 that rank 1 never enqueued."""
    ranks = with_waves(hung(2), [coll(enqueued=11)], [coll()], age=8.0)
    ranks[0] = dataclasses.replace(ranks[0], state="exited", exited_at=T0 - 5.0)
    [f] = dead.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 1 and f.evidence["cause"] == dead.NCCL_TIMEOUT, f
    assert f.evidence["first_to_die"]["rank"] == 0 and "nccl_timeout" in f.summary
    assert f.evidence["wavefront"]["reached"] == {"0": 11, "1": 10}
    # without a wavefront from before the death (sent longer ago than it is fresh), the
    # first to die is named, as before
    stale = [dataclasses.replace(r, collectives_age_seconds=60.0) for r in ranks]
    [f] = dead.detect(cluster(*stale), History(), CFG)
    assert f.rank == 0 and "cause" not in f.evidence
    # a rank that died outside any collective (a crash) is its own culprit
    ranks[0] = dataclasses.replace(ranks[0], collectives=(coll(),))
    ranks[1] = dataclasses.replace(ranks[1], collectives=(coll(enqueued=11),))
    [f] = dead.detect(cluster(*ranks), History(), CFG)
    assert f.rank == 0 and "cause" not in f.evidence


def test_the_budget_stays_below_the_jobs_collective_timeout():
    """A job still in its first step (a 60 s warm-up budget) whose process groups time out
    after 30 s: silent 20 s, it is a hang now (half the timeout), not after the watchdog
    has aborted the waiting ranks."""
    ranks = [dataclasses.replace(r, step=0, recent=()) for r in hung(2, age=20.0)]
    slow = dataclasses.replace(coll(enqueued=1, completed=0), timeout_s=30.0)
    assert hang.detect(cluster(*ranks), History(), CFG) == []  # within the warm-up budget
    waves = with_waves(ranks, [slow], [dataclasses.replace(slow, enqueued=0)])
    [f] = hang.detect(cluster(*waves), History(), CFG)
    assert f.evidence["budget"]["source"] == "watchdog" and f.evidence["budget"]["seconds"] == 15.0
    assert "30s collective timeout" in f.summary and f.rank == 1, f


def test_a_desync_behind_a_second_bucket_is_still_a_desync():
    """DDP with two buckets: rank 0 enqueued both bucket all-reduces (89, 90), rank 1 a
    broadcast at 89; both wait in 89. Rank 1 enqueued fewer, yet it is not behind: the
    group is stuck at 89, which both enqueued, differently."""
    ranks = with_waves(
        hung(2),
        [coll(enqueued=90, completed=88, shape="[[566784]]")],
        [coll(enqueued=89, completed=88, op="gloo:broadcast", shape="[[1]]")],
    )
    w = read_wavefront(ranks)
    assert (w.verdict, w.seq, w.ranks) == (DESYNC, 89, (0, 1)), w  # two ranks: a tie
    [f] = hang.detect(cluster(*ranks), History(), CFG)
    assert f.rank is None and f.evidence["desync"] is True and not f.evidence["stacks_needed"]
    assert "desync, a code bug" in f.summary, f.summary


def test_a_wavefront_taken_before_the_ranks_last_progress_is_not_read():
    """Soak, spin mode: a start-up wait had sent both ranks' wavefronts (rank 0 behind at
    collective 2); the ranks trained on, and when rank 1 hung a few seconds later the
    detector, within a second, read those and named rank 0. A wavefront older than the
    rank's last record is where it was, not where it is."""
    stale = with_waves(hung(2, age=1.2), [coll(enqueued=1, completed=1)], [coll(enqueued=2, completed=1)],
                       age=6.0)  # fmt: skip
    assert read_wavefront(stale) is None
    [f] = hang.detect(cluster(*stale), History(), CFG)
    assert "wavefront" not in f.evidence, f.evidence
    taken_since = with_waves(hung(2, age=1.2), [coll(enqueued=1, completed=1)],
                             [coll(enqueued=2, completed=1)], age=0.2)  # fmt: skip
    assert read_wavefront(taken_since).ranks == (0,)


# -- zero-code ranks (process_hang): the workers' collective watch sends the wavefronts ----


def zero_code(n=2):
    """Ranks found in /proc: no steps, no heartbeat, busy (a spinning NCCL waiter)."""
    return [
        dataclasses.replace(
            r,
            source="process",
            step=None,
            phase=None,
            recent=(),
            heartbeat_age_seconds=None,
            cpu_utilization=1.0,
            cpu_active_at=T0,
        )  # fmt: skip
        for r in trained(n)
    ]


def test_zero_code_ranks_behind_a_stuck_collective_are_named_once_it_held_its_budget():
    ranks = with_waves(zero_code(2), [coll(enqueued=11)], [coll()])
    budget = CFG.process_hang.wavefront_seconds
    history = History()
    for t in (T0, T0 + budget - 1):
        history = process_hang.track(history, cluster(*ranks, time=t), CFG)
        assert process_hang.detect(cluster(*ranks, time=t), history, CFG) == []
    obs = cluster(*ranks, time=T0 + budget)
    history = process_hang.track(history, obs, CFG)
    [f] = process_hang.detect(obs, history, CFG)
    assert f.rank == 1 and f.evidence["wavefront"]["verdict"] == BEHIND, f
    assert f.evidence["decided_by"] == "flight recorder" and not f.evidence["stacks_needed"]
    assert f.occurred_at == T0
    # the ranks moved on (another collective is stuck): its own budget starts again
    moved = with_waves(
        zero_code(2), [coll(enqueued=12, completed=11)], [coll(enqueued=11, completed=11)]
    )
    history = process_hang.track(history, cluster(*moved, time=T0 + budget + 1), CFG)
    assert process_hang.detect(cluster(*moved, time=T0 + budget + 1), history, CFG) == []


def test_zero_code_waves_that_name_nobody_or_are_incomplete():
    late = T0 + CFG.process_hang.wavefront_seconds + 1

    def judged(ranks):
        history = process_hang.track(History(), cluster(*ranks, time=T0), CFG)
        return process_hang.detect(cluster(*ranks, time=late), history, CFG)

    # every member waits alike: below the ranks, the stacks are read (and then a restart)
    [below] = judged(with_waves(zero_code(2), [coll(enqueued=11)], [coll(enqueued=11)]))
    assert below.rank is None and below.evidence["stacks_needed"]
    assert below.evidence["wavefront"]["verdict"] == BELOW
    # a desync stops the job with a verdict
    [desync] = judged(
        with_waves(zero_code(2), [coll(enqueued=11)], [coll(enqueued=11, op="gloo:broadcast")])
    )
    assert desync.evidence["desync"] is True
    [d] = policy.decide([desync], policy.PolicyView(), policy.PolicyConfig(), T0)
    assert d.action == model.ACT_STOP_JOB, d
    # one rank without a wavefront (its watch cannot run): nothing is concluded
    ranks = with_waves(zero_code(2), [coll(enqueued=11)], [coll()])
    assert judged([ranks[0], dataclasses.replace(ranks[1], collectives=())]) == []
