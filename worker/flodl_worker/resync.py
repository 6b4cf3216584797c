"""flodl_worker.resync: the rank's half of a coordinator restart.

Theory of operation
-------------------
A coordinator is restarted on its journal (systemd ``Restart=on-failure``) and rebuilds
its state by replay, but the frames that were in flight when it died are gone both ways
(``flodl.core._resync``). Each coordinator process has its own random incarnation in
its envelopes' sender. The rank learns it from ``hello_ack``; a frame of *another*
incarnation means the coordinator restarted. The DEALER reconnected by itself (same
identity, same route), and frames the rank queued meanwhile were delivered first.

Before handling that frame, the rank sends one ``Timing.Resync`` with what the new
coordinator may have lost:

* ``batches``: every ``Batch`` it reported since its last *folded* step (the snapshot
  step of the last consensus it applied with its own work in it): their reports may
  have died with the old process. Kept in a list trimmed as consensuses fold them;
* ``held``: the positions it was handed and has not trained (the current chunk's
  remainder, then the queued plans), so the coordinator can tell a lost plan from a
  held one; ``last_command_id``: the newest command it handled, so the coordinator
  can tell a plan still on its way from a lost one;
* ``chunks``: the metrics of finished chunks of epochs it has not seen aggregated;
* ``local_step``, ``folded_step``, ``throttled``, ``idle``.

It then drops its pending snapshots: their rounds died with the old reducer (a
consensus for them can never come; the credit stays, since ``steps_since_avg`` is only
reduced when a consensus is applied), and keeps training. On the collective plane the
averager's ``on_coordinator_restart`` does it, abandoning the pending all-reduces with
their snapshots (``flodl_worker.collective``). A frame of an incarnation it
has already left behind is dropped (``stale_incarnation``).

If the coordinator stays away, nothing changes: a rank waiting for it (for a plan, at a
throttle) still gives up after ``liveness_timeout_s`` of silence. The restarted
coordinator has to be back within that window.
"""

from __future__ import annotations

import logging

from flodl.wire import pb

__all__ = ["RankResync"]

log = logging.getLogger("flodl.rank")


class RankResync:
    """Restart detection and the resync report for one rank runtime (``rank``)."""

    def __init__(self, rank) -> None:
        self.rank = rank
        self.incarnation: int | None = None  # the coordinator's, from hello_ack
        self.left_behind: set[int] = set()
        self.last_command_id = 0
        self.unfolded: list[pb.Timing.Batch] = []  # reported, not yet folded (step order)
        self.finished: list[pb.Metrics] = []  # chunks of epochs not seen aggregated
        self.restarts = 0

    # -- bookkeeping ----------------------------------------------------------------------

    def _folded_step(self) -> int:
        return int(getattr(self.rank.averager, "folded_step", 0))

    def note_batch(self, batch: pb.Timing.Batch) -> None:
        folded = self._folded_step()
        self.unfolded = [b for b in self.unfolded if b.step_count > folded]
        self.unfolded.append(batch)

    def note_metrics(self, m: pb.Metrics) -> None:
        self.finished.append(m)

    def on_control(self, c: pb.Control) -> None:
        if c.command_id > self.last_command_id:
            self.last_command_id = c.command_id
        if c.WhichOneof("cmd") == "epoch_aggregated":
            done = c.epoch_aggregated.metrics.epoch
            self.finished = [m for m in self.finished if m.epoch > done]

    # -- detection --------------------------------------------------------------------------

    def on_frame(self, env: pb.Envelope) -> bool:
        """Check the coordinator's incarnation; False: drop the frame (a stale one)."""
        inc = env.sender.incarnation
        if self.incarnation is None:
            if env.WhichOneof("body") == "hello_ack":
                self.incarnation = inc
            return True
        if inc == self.incarnation:
            return True
        if inc in self.left_behind:
            self.rank._drop("stale_incarnation", f"a frame of coordinator incarnation {inc}, which restarted")
            return False
        self.left_behind.add(self.incarnation)
        self.incarnation = inc
        self.restarts += 1
        if self.rank.spec is not None:
            self._report(inc)
        return True

    def _held(self) -> list[pb.EpochPlan]:
        r = self.rank
        chunks = ([r.current] if r.current is not None else []) + list(r.plans)
        return [
            pb.EpochPlan(epoch=ch.epoch, partition_offset=int(off), partition_size=int(size))
            for ch in chunks
            for off, size in ch.segments
            if size > 0
        ]

    def _report(self, inc: int) -> None:
        r = self.rank
        abandon = getattr(r.averager, "on_coordinator_restart", None)
        if abandon is not None:  # collective plane: pending reduces go with their snapshots
            dropped = abandon()
        else:
            snapshots = getattr(r.averager, "snapshots", None)
            dropped = len(snapshots) if snapshots else 0
            if snapshots:
                snapshots.clear()  # their rounds died with the old coordinator's reducer
        folded = self._folded_step()  # after the abandon: a reduce it applied counts
        batches = [b for b in self.unfolded if b.step_count > folded]
        held = self._held()
        r._timing(
            resync=pb.Timing.Resync(
                coordinator_incarnation=inc,
                last_command_id=self.last_command_id,
                local_step=r.local_step,
                folded_step=folded,
                throttled=bool(r.throttled),
                idle=not held,
                batches=batches,
                held=held,
                chunks=self.finished,
            )
        )
        log.warning(
            "the coordinator restarted (incarnation %x): resync sent (%d unfolded batches, %d samples held, "
            "%d snapshot(s) dropped, throttled=%s)",
            inc, len(batches), sum(p.partition_size for p in held), dropped, r.throttled,
        )  # fmt: skip
