"""flodl.core._checkpointing: regular checkpoints, failover, failure saves, resume."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from flodl.core import (
    CheckpointDone,
    CoreConfig,
    Notice,
    Send,
    StopRequested,
    SyncAcked,
    checkpoint_meta,
    initial_state,
    resume_plan,
)
from flodl.wire import pb

from .cluster import Cluster


def metas(c: Cluster) -> list[dict]:
    return [n.data for n in c.of_type(Notice) if n.kind == "checkpoint_meta"]


def kinds(c: Cluster) -> list[str]:
    return [x.kind if isinstance(x, Send) else type(x).__name__ for x in c.commands]


# -- regular checkpoints -------------------------------------------------------------------


def test_a_checkpoint_after_every_nth_aggregated_epoch_goes_to_the_role_rank():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=3, policy="sync", checkpoint_every=1)
    c.join_all()
    fin = c.run()
    assert fin.ok
    cks = c.sends("checkpoint")
    assert [s.rank for s in cks] == [0, 0, 0]
    ms = metas(c)
    assert [m["version"] for m in ms] == [s.control.checkpoint.version for s in cks]
    assert [m["meta"]["epoch"] for m in ms] == [1, 2, 3]
    assert all(s.control.checkpoint.target_rank == 0 for s in cks)
    assert ms[-1]["version"] == c.state.rounds.version  # the last one holds the final consensus
    for m, s in zip(ms, cks):
        assert m["meta"]["cycle"] == s.control.checkpoint.cycle > 0
        json.dumps(m["meta"])  # JSON-safe, as the shell writes it


def test_the_checkpoint_comes_after_the_aggregation_and_before_the_next_epoch():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=2, policy="sync", checkpoint_every=1)
    c.join_all()
    c.run()
    k = kinds(c)
    first = k.index("checkpoint")
    assert "epoch_aggregated" in k[:first]
    assert k[first + 1] == "StageCheckpoint"  # the meta travels right behind the command
    later_starts = [i for i, x in enumerate(k) if x == "start_epoch" and i > first]
    assert later_starts, "epoch 1 is dispatched after the checkpoint"


def test_every_n_skips_the_epochs_in_between():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=5, policy="sync", checkpoint_every=2)
    c.join_all()
    c.run()
    assert [m["meta"]["last_aggregated_epoch"] for m in metas(c)] == [1, 3]


def test_no_checkpoint_when_off():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=2, policy="sync")
    c.join_all()
    c.run()
    assert c.sends("checkpoint") == [] and metas(c) == []


@pytest.mark.parametrize("speeds", [[10.0, 10.0], [10.0, 35.0], [40.0, 10.0, 20.0]])
def test_cadence_checkpoints_when_every_rank_holds_the_last_consensus(speeds):
    """At the checkpoint no round is open, every batch of the epochs aggregated is folded
    (the ranks may already train the next epoch: Cadence streams the boundary, and those
    steps are in neither the consensus nor the meta), and the cycle named is the one of
    the last Update the role rank received."""
    ws = len(speeds)
    c = Cluster(world_size=ws, total=96 * ws, batch_size=8, epochs=3, policy="cadence",
                checkpoint_every=1, speeds=speeds)  # fmt: skip
    seen = []
    feed = c.feed

    def watching(ev):
        cmds = feed(ev)
        for x in cmds:
            if isinstance(x, Send) and x.kind == "checkpoint":
                st = c.state
                updates = [u for u in c.ranks[x.rank].received if u.WhichOneof("cmd") == "update"]
                pending = [e for items in st.coverage.pending.values() for e, *_ in items]
                seen.append((repr(st.rounds.phase), all(e > st.metrics.last_aggregated for e in pending),
                             x.control.checkpoint.cycle == updates[-1].update.cycle))  # fmt: skip
        return cmds

    c.feed = watching
    c.join_all()
    assert c.run().ok
    # One save per consensus that aggregated epochs: two epochs may aggregate at one
    # (run-ahead folds two windows), each still with its own meta of that save.
    assert seen and all(x == ("IDLE", True, True) for x in seen)
    assert len(metas(c)) == 3
    assert all("elche" in m["meta"]["policy_state"] for m in metas(c))


def _straggle_to_the_end(c: Cluster, rng: random.Random) -> None:
    """Join, then pump every rank in a random order each step, each acking a consensus
    at a random later pump, until the run ends (it must end ok)."""
    ws = len(c.ranks)
    c.join_all()
    for _ in range(20000):
        if c.finished is not None:
            break
        order = list(range(ws))
        rng.shuffle(order)
        for r in order:
            while c.deliver_one(r):
                pass
            if rng.random() < 0.4:
                c.send_ack(r)
            c.send_chunk(r)
            c.train_one(r)
        c.advance(c.dt)
    assert c.finished is not None and c.finished.ok


def _acks_out_of_step(seed: int, policy: str) -> Cluster:
    """A run whose acks straggle (each rank acks a consensus at a random later pump), so
    an epoch can complete -- and aggregate -- while a round is half acked."""
    rng = random.Random(seed)
    ws = rng.choice([2, 3])
    speeds = [rng.choice([5.0, 10.0, 40.0]) for _ in range(ws)]
    # probe_batches None (the anchor): the seeds were picked with an anchor-sized first window.
    c = Cluster(world_size=ws, total=rng.choice([64, 150]) * ws, batch_size=8, epochs=3, policy=policy,
                checkpoint_every=1, speeds=speeds, defer_acks=True, probe_batches=None, run_ahead=True)  # fmt: skip
    _straggle_to_the_end(c, rng)
    return c


# Seeds 5 and 24 aggregate two epochs while a round is open (both saved at its finish).
@pytest.mark.parametrize(
    "seed,policy", [(0, "async"), (26, "async"), (24, "async"), (3, "cadence"), (7, "cadence"), (5, "cadence")]
)
def test_a_checkpoint_covers_exactly_what_the_consensus_it_names_folded(seed, policy):
    """Issue 9: an epoch that completed on the first acks of a round was checkpointed at
    the *previous* cycle while the meta already counted the open round's acked batches
    as covered: a resume from it would never train them (lost quietly). The save is now
    deferred to that round's finish, at its cycle."""
    c = _acks_out_of_step(seed, policy)
    epochs, saves = _audit_metas(c)
    # One checkpoint per epoch, of that epoch; epochs shorter than a window (the ranks
    # stream across them) can aggregate at one consensus, and share its one save.
    assert epochs == list(range(c.config.num_epochs)) and 1 <= saves <= len(epochs)


def _audit_metas(c: Cluster) -> tuple[list[int], int]:
    """Check that every meta -- a save's, or another epoch's of the same consensus --
    covers exactly what the weights of its cycle hold (positions of epochs past the one
    it is of); return the epochs the metas are of, in order, and how many saves."""
    acks: list[SyncAcked] = []
    saves, epochs = 0, []
    for ev, cmds in c.trace:
        if isinstance(ev, SyncAcked):
            acks.append(ev)
        for i, x in enumerate(cmds):
            if isinstance(x, Send) and x.kind == "checkpoint":
                saves += 1
                meta = next(n.data["meta"] for n in cmds[i:] if isinstance(n, Notice) and n.kind == "checkpoint_meta")
                assert meta["cycle"] == x.control.checkpoint.cycle
            if not (isinstance(x, Notice) and x.kind == "checkpoint_meta"):
                continue
            meta = x.data["meta"]
            cycle, last = meta["cycle"], meta["last_aggregated_epoch"]
            epochs.append(last)
            assert meta["epoch"] == last + 1
            folded: dict[int, int] = {}  # rank -> the last step consensus `cycle` holds
            for a in acks:
                if a.cycle <= cycle:
                    folded[a.rank] = max(folded.get(a.rank, 0), a.step_count)
            in_weights = {
                (e, p)
                for r in c.ranks
                for (e, off, n, stp) in r.trained
                if stp <= folded.get(r.rank, 0) and e > last
                for p in range(off, off + n)
            }
            covered = {
                (row["epoch"], p)
                for row in meta["coverage"]["epochs"]
                for off, size in row["covered"]
                for p in range(off, off + size)
            }
            assert covered == in_weights, f"v{meta['version']} (cycle {cycle})"
    return epochs, saves


def _streaming_short_epochs(policy: str = "cadence") -> Cluster:
    """Epochs shorter than two windows at 1,2,4 with run_ahead: several epochs
    aggregate at one consensus."""
    c = Cluster(world_size=3, total=144, batch_size=8, epochs=8, policy=policy, checkpoint_every=1,
                speeds=[10.0, 20.0, 40.0], run_ahead=True)  # fmt: skip
    c.join_all()
    assert c.run().ok
    return c


def test_epochs_aggregated_at_one_consensus_each_get_their_own_checkpoint_of_one_save():
    """Issue 11: two epochs aggregated at the same consensus used to share one
    checkpoint (13 of 15 committed). Each now has its own meta, of that epoch, and the
    consensus is saved once."""
    c = _streaming_short_epochs()
    epochs, saves = _audit_metas(c)
    assert epochs == list(range(8)) and saves < 8
    versions = [m["version"] for m in metas(c)]
    assert len(set(versions)) == saves  # one save per consensus, one meta per epoch


def _trained_and_uncovered(c: Cluster, point, epochs: int) -> tuple[dict[int, Counter], dict[int, Counter]]:
    """What the resumed run's ranks trained, per epoch and position, and what the resume
    point left uncovered from its epoch on (each position once)."""
    got: dict[int, Counter] = {}
    for r in c.ranks:
        for e, off, n, _ in r.trained:
            got.setdefault(e, Counter()).update(range(off, off + n))
    want = {e: Counter(p for off, n in point.uncovered(e) for p in range(off, off + n))
            for e in range(point.epoch, epochs)}  # fmt: skip
    return got, want


@pytest.mark.parametrize("policy", ["cadence", "async"])
def test_a_resume_from_the_first_of_two_epochs_at_one_consensus_skips_what_the_weights_hold(policy):
    """The earlier epoch's checkpoint holds all of the next epoch (recorded as covered):
    the resume trains none of it again, and the run still aggregates it and goes on."""
    first = _streaming_short_epochs(policy)
    ms = [m["meta"] for m in metas(first)]
    i = next(i for i in range(len(ms) - 1) if ms[i]["version"] == ms[i + 1]["version"])
    point = resume_plan(json.loads(json.dumps(ms[i])))
    assert point.remaining(point.epoch) == 0  # the weights hold all of the resume epoch
    c = Cluster(world_size=3, total=144, batch_size=8, epochs=8, policy=policy, speeds=[10.0, 20.0, 40.0],
                run_ahead=True)  # fmt: skip
    c.state = initial_state(c.config, point)
    c.join_all()
    fin = c.run()
    assert fin.ok, fin.reason
    got, want = _trained_and_uncovered(c, point, 8)
    assert got == {e: w for e, w in want.items() if w}  # each uncovered position once, nothing the weights hold
    assert [row["epoch"] for row in fin.summary["epochs"]] == list(range(8))
    held = [row["epoch"] for row in fin.summary["epochs"] if row["avg_loss"] is None]
    assert held == [point.epoch]  # trained before the save: no loss reported in this run (not 0)
    assert all((row["duplicates"], row["missing"]) == (0, 0) for row in fin.summary["coverage"])


# -- answers and failover -----------------------------------------------------------------


def _one_pending(world_size: int = 3) -> Cluster:
    c = Cluster(world_size=world_size, total=60, batch_size=4, epochs=3, policy="sync", checkpoint_every=1)
    c.join_all()
    c.run_until(lambda: c.sends("checkpoint"))
    return c


def test_success_clears_the_pending_save():
    c = _one_pending()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    assert v in c.state.checkpoints.pending
    c.feed(CheckpointDone(now=c.now, rank=0, version=v))
    assert c.state.checkpoints.pending == {}


def test_an_error_fails_over_to_the_next_rank_then_gives_up():
    c = _one_pending()
    first = c.sends("checkpoint")[0].control.checkpoint
    v, cycle = first.version, first.cycle
    cmds = c.feed(CheckpointDone(now=c.now, rank=0, version=v, error="consensus of that cycle no longer held"))
    again = [x for x in cmds if isinstance(x, Send) and x.kind == "checkpoint"]
    assert [(x.rank, x.control.checkpoint.version, x.control.checkpoint.cycle) for x in again] == [(1, v, cycle)]
    c.feed(CheckpointDone(now=c.now, rank=1, version=v, error="disk full"))
    cmds = c.feed(CheckpointDone(now=c.now, rank=2, version=v, error="disk full"))
    assert any(isinstance(x, Notice) and x.kind == "checkpoint_abandoned" for x in cmds)
    assert c.state.checkpoints.pending == {} and c.state.checkpoints.given_up == 1


def test_an_answer_nobody_awaits_is_ignored():
    c = _one_pending()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    before = dict(c.state.checkpoints.pending)
    assert c.feed(CheckpointDone(now=c.now, rank=1, version=v, error="x")) == []
    c.feed(CheckpointDone(now=c.now, rank=0, version=v + 1000))
    assert c.state.checkpoints.pending == before
    assert c.state.ignored["CheckpointDone not awaited"] == 2


def test_the_asked_rank_dying_moves_the_save_to_a_survivor():
    c = _one_pending()
    v = c.sends("checkpoint")[0].control.checkpoint.version
    cmds = c.kill(0)
    again = [x for x in cmds if isinstance(x, Send) and x.kind == "checkpoint"]
    assert [(x.rank, x.control.checkpoint.version) for x in again] == [(1, v)]


@pytest.mark.parametrize("policy", ["sync", "cadence", "async"])
@pytest.mark.parametrize("seed", range(4))
def test_the_rank_saves_exactly_the_consensus_the_checkpoint_names(policy, seed):
    """Both halves real: the core picks the cycle and the rank, the rank machine decides
    what to save (``answer_checkpoints``: the shell has a checkpoint directory and answers).
    With acks straggling at random, every save holds the consensus of the cycle its
    Checkpoint names -- the held one when the rank stepped on since (async), never its
    local weights -- and none is refused."""
    rng = random.Random(seed)
    ws = rng.choice([2, 3])
    c = Cluster(world_size=ws, total=rng.choice([64, 150]) * ws, batch_size=8, epochs=3, policy=policy,
                checkpoint_every=1, speeds=[rng.choice([5.0, 10.0, 40.0]) for _ in range(ws)], defer_acks=True,
                answer_checkpoints=True)  # fmt: skip
    _straggle_to_the_end(c, rng)
    asked = {(s.rank, s.control.checkpoint.version, s.control.checkpoint.cycle) for s in c.sends("checkpoint")}
    saved = {(r.rank, v, cycle) for r in c.ranks for v, cycle, _ in r.saved}
    assert asked and saved == asked
    assert all(params == [cycle] for r in c.ranks for _v, cycle, params in r.saved)
    assert not any(ev.error for ev in c.journal if isinstance(ev, CheckpointDone))
    assert c.state.checkpoints.pending == {} and c.state.checkpoints.given_up == 0


# -- failure saves --------------------------------------------------------------------------


def test_a_stop_saves_the_weights_held_before_the_shutdown():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=3, policy="sync", checkpoint_on_failure=True)
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 3)
    cmds = c.feed(StopRequested(now=c.now, reason="SIGTERM"))
    k = [x.kind if isinstance(x, Send) else type(x).__name__ for x in cmds]
    assert k.index("checkpoint") < k.index("shutdown")
    ck = next(x for x in cmds if isinstance(x, Send) and x.kind == "checkpoint")
    assert (ck.rank, ck.control.checkpoint.cycle, ck.control.checkpoint.version) == (0, 0, c.state.rounds.version)
    meta = next(x for x in cmds if isinstance(x, Notice) and x.kind == "checkpoint_meta").data["meta"]
    assert (meta["reason"], meta["cycle"]) == ("graceful_shutdown", 0)


def test_a_failure_saves_before_shutdown_with_save():
    c = Cluster(world_size=3, total=60, batch_size=4, epochs=3, policy="sync",
                checkpoint_on_failure=True, max_failure="1")  # fmt: skip
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 2)
    cmds = c.kill(2)
    k = [x.kind if isinstance(x, Send) else type(x).__name__ for x in cmds]
    assert k.index("checkpoint") < k.index("shutdown_with_save")
    meta = next(x for x in cmds if isinstance(x, Notice) and x.kind == "checkpoint_meta").data["meta"]
    assert meta["reason"] == "max_failure_exceeded"


def test_no_failure_save_unless_asked():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=3, policy="sync")
    c.join_all()
    c.run_until(lambda: c.state.rounds.version >= 3)
    cmds = c.feed(StopRequested(now=c.now, reason="SIGTERM"))
    assert not any(isinstance(x, Send) and x.kind == "checkpoint" for x in cmds)


# -- resume ---------------------------------------------------------------------------------


def _mid_epoch_point(policy: str, total: int = 96, epochs: int = 4):
    c = Cluster(world_size=2, total=total, batch_size=8, epochs=epochs, policy=policy)
    c.join_all()
    c.run_until(
        lambda: c.state.metrics.last_aggregated == 0
        and 1 in c.state.coverage.epochs
        and 0 < c.state.coverage.epochs[1].unique < total
    )
    meta = json.loads(json.dumps(checkpoint_meta(c.state, c.state.rounds.version)))
    return c, resume_plan(meta)


def _resumed(policy: str, point, total: int = 96, epochs: int = 4) -> Cluster:
    c = Cluster(world_size=2, total=total, batch_size=8, epochs=epochs, policy=policy)
    c.state = initial_state(c.config, point)
    c.join_all()
    return c


@pytest.mark.parametrize("policy", ["sync", "cadence"])
def test_a_resumed_run_trains_exactly_the_uncovered_positions(policy):
    total, epochs = 96, 4
    first, point = _mid_epoch_point(policy, total, epochs)
    assert point.epoch == 1 and 0 < point.remaining(1) < total
    c = _resumed(policy, point, total, epochs)
    fin = c.run()
    assert fin.ok, fin.reason
    got, want = _trained_and_uncovered(c, point, epochs)
    assert got == want  # each uncovered position once, none of the covered ones
    s = fin.summary
    assert [row["epoch"] for row in s["coverage"]] == [0, 1, 2, 3]
    assert all((row["duplicates"], row["missing"]) == (0, 0) for row in s["coverage"])
    assert [row["epoch"] for row in s["epochs"]] == [0, 1, 2, 3]
    assert s["global_step"] > point.global_step and s["averages"] > point.version


def test_resume_restores_counters_and_history():
    first, point = _mid_epoch_point("cadence")
    st = initial_state(first.config, point)
    assert st.metrics.last_aggregated == 0 and st.rounds.version == point.version
    assert st.rounds.global_step == point.global_step
    assert st.metrics.history == first.state.metrics.history
    assert st.cadence.averages == first.state.cadence.averages
    assert st.cadence.elche.anchor == first.state.cadence.elche.anchor
    ec = st.coverage.epochs[1]
    assert ec.unique == point.total_samples - point.remaining(1) and not ec.frozen
    assert st.checkpoints.resume_holes[1] == point.uncovered(1)


def test_resume_at_an_epoch_boundary_trains_the_next_epochs_whole():
    c = Cluster(world_size=2, total=64, batch_size=8, epochs=3, policy="sync", checkpoint_every=1)
    c.join_all()
    c.run_until(lambda: metas(c))
    point = resume_plan(json.loads(json.dumps(metas(c)[0]["meta"])))
    assert (point.epoch, point.last_aggregated_epoch) == (1, 0)
    r = _resumed("sync", point, 64, 3)
    assert r.run().ok
    trained = Counter(e for rk in r.ranks for e, _, n, _ in rk.trained for _ in range(n))
    assert trained == {1: 64, 2: 64}


def test_config_accepts_the_checkpoint_knobs():
    cfg = CoreConfig(world_size=2, checkpoint_every=3, checkpoint_on_failure=True)
    assert (cfg.checkpoint_every, cfg.checkpoint_on_failure) == (3, True)
    with pytest.raises(ValueError, match="checkpoint_every"):
        CoreConfig(world_size=2, checkpoint_every=-1)
    assert pb.SaveReason.Name(pb.SAVE_REASON_GRACEFUL_SHUTDOWN).endswith("GRACEFUL_SHUTDOWN")


def test_a_resumed_journal_replays_to_the_same_state():
    from flodl.core import replay

    _, point = _mid_epoch_point("cadence")
    c = _resumed("cadence", point)
    c.run()
    assert replay(c.config, c.journal, resume=point) == c.state
