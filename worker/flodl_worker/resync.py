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

The bookkeeping and the report are the rank machine's (``flodl.rank``:
``IncarnationSeen`` -> ``AbandonRounds`` + ``SendTiming(resync)``, or
``Drop("stale_incarnation")``); the shell's only part is ``settle``: a collective
reduce that already completed is applied before the machine is told, so the report's
``folded_step`` counts it.

If the coordinator stays away, nothing changes: a rank waiting for it (for a plan, at a
throttle) still gives up after ``liveness_timeout_s`` of silence. The restarted
coordinator has to be back within that window.
"""

from __future__ import annotations

__all__: list[str] = []
