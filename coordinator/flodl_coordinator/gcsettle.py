"""The coordinator's long-lived state, out of the cyclic collector's way.

A world of N ranks is tens of thousands of long-lived objects (records, views, pools,
ledgers), and each of CPython's full collections walks every one of them: at 1,024
paced ranks each took ~50 ms of the loop, at a moment nobody chose, with every frame
that arrived meanwhile waiting behind it (4 in a 12 s run; 2.9 % of the coordinator's
CPU went to collections). So the service settles the collector at moments it picks --
once the world has formed, and once an epoch has aggregated, each time right after that
pass's commands went out: one collection (of what the last settle did not freeze), then
``gc.freeze()`` of what survived, so that later collections look only at what was made
since.

What freezing costs: a frozen object that later becomes garbage *in a reference cycle*
is never collected (refcounting still frees the rest). The core's state is dataclasses,
lists, dicts and sets that do not refer back to their owners, so what an epoch leaves
behind (an aggregated epoch's pool, its ledgers) is freed by refcounting; a settle
collects first, so no garbage is frozen.

Inside a pass the collector waits (``defer`` / ``resume``): a pass's commands go out at
its end, so a collection that fell inside it -- a full one took ~20 ms at 1,024 paced
ranks, and a 4,096-rank epoch step's own allocations set one off inside the step --
held back every command of the pass, a round's RequestParams included. Deferred, it
runs once the pass's frames are sent (the first allocation after ``resume``), or not at
all when a settle follows. Garbage in a cycle waits one pass longer at most (a pass is
up to ``DRAIN_BATCH`` frames, and the events a failed send makes). What a pass allocates
still counts toward the youngest generation's threshold, but the young collections a
pass made due run as one, so the older generations, counted in young collections, run
less often too (at 1,024 paced ranks about half as often: a run's full collections 2 -> 1).

``stats()``: the collector's own collections by generation, their CPU seconds and the
longest (``gc.callbacks``), and the settles with theirs -- in the summary's
``coordinator_loop``.
"""

from __future__ import annotations

import gc
import time

__all__ = ["CollectorSettle", "SETTLE_ON"]

# The notices after which the long-lived state has grown by a world or an epoch.
SETTLE_ON = frozenset({"world_formed", "epoch"})


class CollectorSettle:
    def __init__(self, clock=time.thread_time) -> None:
        self._clock = clock
        self.due = False
        self.settles = 0
        self.settle_s = 0.0
        self.settle_max_s = 0.0
        self._settling = False  # (a settle's own collection is counted as the settle)
        self.collections = [0, 0, 0]
        self.collect_s = 0.0
        self.collect_max_s = 0.0
        self._t0 = 0.0
        self._installed = False

    def install(self) -> None:
        """Time every collection of this process (``gc.callbacks``) until ``uninstall``."""
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    def _on_gc(self, phase: str, info: dict) -> None:
        if self._settling:
            return
        if phase == "start":
            self._t0 = self._clock()
            return
        dt = self._clock() - self._t0
        self.collections[info["generation"]] += 1
        self.collect_s += dt
        if dt > self.collect_max_s:
            self.collect_max_s = dt

    def defer(self) -> bool:
        """Hold automatic collections (the module doc); True if they were on, so the
        caller's ``resume`` turns them back on (nested or already off: it leaves them)."""
        if not gc.isenabled():
            return False
        gc.disable()
        return True

    def resume(self, deferred: bool) -> None:
        if deferred:
            gc.enable()  # (a collection the pass made due runs at the next allocation)

    def notice(self, kind: str) -> None:
        if kind in SETTLE_ON:
            self.due = True

    def settle(self) -> None:
        """If due: collect once, then freeze what survived (the module doc)."""
        if not self.due:
            return
        self.due = False
        t0 = self._clock()
        self._settling = True
        try:
            gc.collect()
            gc.freeze()
        finally:
            self._settling = False
        dt = self._clock() - t0
        self.settles += 1
        self.settle_s += dt
        self.settle_max_s = max(self.settle_max_s, dt)

    def stats(self) -> dict:
        return {
            "gc_collections": list(self.collections),
            "gc_s": round(self.collect_s, 4),
            "gc_max_ms": round(self.collect_max_s * 1e3, 3),
            "gc_settles": self.settles,
            "gc_settle_s": round(self.settle_s, 4),
            "gc_settle_max_ms": round(self.settle_max_s * 1e3, 3),
            "gc_frozen": gc.get_freeze_count(),
        }
