"""Core-only scale: the cost of ``flodl.core.step`` per event as the world grows.

For each policy and each world size N, ``flodl.sim`` runs one seeded job (N ranks at
the speeds 1, 2, 4 x ``--base-ms`` in turn, ``--batches`` batches per rank per epoch,
two epochs) and keeps its journal. The journal is then replayed through the real core,
event by event from ``initial_state`` (no simulator, no ranks: core time only), and
timed in CPU time (``time.thread_time``: on a shared machine, wall time would time the
neighbours) -- medians of ``--repeats`` replays:

* ``us_per_event``, ``events_per_s``: the whole journal;
* ``heartbeat_us``: a ``HeartbeatSeen`` (the cheapest frame: nothing but liveness);
* ``formation_ms``: the step that forms the world (it also dispatches epoch 0);
* ``epoch_dispatch_ms``: the step that aggregates epoch 0 (and, but under Async, which
  streamed into it already, dispatches epoch 1);
* ``formation_gc_ms`` / ``epoch_dispatch_gc_ms``: an automatic collection either step
  set off (not in its time). The replay treats the collector as the service does
  (``flodl_coordinator.gcsettle``): deferred while a step runs and its sends are built
  (the service's pass); after each of those two steps, one collection and a
  ``gc.freeze()`` (not timed: the service does it once the step's sends are out), so
  later collections do not walk the world's long-lived state, and it stands for the
  one the step made due. A checkout whose service does not defer: the collections that
  fell inside the step. (Deferred, a collection is counted in ``core_s`` but in no
  step's own time: ``heartbeat_us`` no longer carries the ones that fell in a
  heartbeat's step, so it reads a little lower beside such a checkout.)
* ``formation_build_ms`` / ``epoch_dispatch_build_ms``: the bytes of every ``Send``
  those two steps returned, as the shell takes them (``Send.wire``: a broadcast's body
  serialised once, a round's ``Update`` written directly; a checkout without it: the
  ``control`` built, then serialised) -- what the shell pays on top when it sends them;
* ``peak_mib``: tracemalloc's peak over one more replay (the core's state and commands);
* ``sim_s`` / ``sim_cpu_s``: the simulation's wall and CPU seconds (the ranks' side too).

``--reduce-ms`` gives the simulated reducer one time per round at every size (relays
fold a host's ranks into one frame); by default it takes the simulator's 0.5 ms per
contribution, which at 16,384 ranks makes each round 8 virtual seconds, so the journal
is mostly heartbeats. The 16,384 point is measured with ``--reduce-ms 20``.

``--peer PATH`` replays the same journal, in the same sitting, through another checkout
(``/work/wt/base``: the code before; a subprocess with that checkout on PYTHONPATH; ours
then replays in a subprocess of its own as well, in turn with it, so both start from the
same heap), and
reports its row and ``peer_over_ours`` (its µs per event / ours) beside ours. A size whose
simulation and replays (ours, or the peer's) take longer than ``--budget-s`` is cut off
and ends that curve: the larger sizes are listed as ``skipped`` (a quadratic core shows
as a short curve, not as a hung bench). Prints one JSON object.

    python bench/core_scale.py                           # N = 16 ... 16384 (x4), all policies
    python bench/core_scale.py --peer /work/wt/base      # ... and the code before, side by side
    python bench/core_scale.py --quick                   # a smoke run: N = 16, 64, one replay
    python bench/core_scale.py --policies sync --sizes 1024,4096,16384 --reduce-ms 20 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from typing import Any, Optional

from benchproc import peer_env
from flodl.core import HeartbeatSeen, Notice, Send, initial_state, step
from flodl.sim import SimConfig, simulate
from flodl_coordinator.gcsettle import CollectorSettle

SPEEDS = (1.0, 2.0, 4.0)


OWN_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout (--peer: ours, as a peer)


class OverBudget(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise OverBudget()


def workload(n: int, policy: str, *, batches: int, base_ms: float, batch_size: int,
             reduce_ms: Optional[float] = None) -> SimConfig:  # fmt: skip
    """One job of ``n`` unequal ranks, ``batches`` batches each per epoch, two epochs.

    ``reduce_ms``: the simulated reducer's time per round, whatever ``n`` (relays fold a
    host's ranks into one frame); None: the simulator's 0.5 ms per contribution, which
    at 16,384 ranks makes a round 8 virtual seconds, so heartbeats swamp the journal."""
    extra = {} if reduce_ms is None else {"reduce_s_per_rank": reduce_ms / 1e3 / n}
    return SimConfig(
        ms_per_batch=tuple(base_ms * SPEEDS[r % len(SPEEDS)] for r in range(n)),
        total_samples=batch_size * batches * n,
        batch_size=batch_size,
        epochs=2,
        policy=policy,
        seed=n,
        liveness_timeout_s=60.0,
        **extra,
    )


class _Allocation:
    """An object of its own type: its allocation checks the collector's thresholds (a
    list or a tuple may come off a free list, which does not)."""


class ServiceCollector:
    """The cyclic collector around each step, as the service's pass treats it
    (``gcsettle.CollectorSettle``): deferred while the step runs (``before``); after it
    (``after``, once its commands are dropped) the settle the step's notices call for
    (a collection and a ``gc.freeze()`` after the world forms and after each epoch),
    then the collection the step made due, if any. A checkout whose service does not
    defer: collections fall inside the step. ``collect_s``: every collection's CPU."""

    def __init__(self, clock: Any) -> None:
        self._settle = CollectorSettle(clock)
        self._defer = getattr(self._settle, "defer", None)
        self._deferred = False

    @property
    def collect_s(self) -> float:
        return self._settle.collect_s

    def install(self) -> None:
        gc.collect()
        self._settle.install()

    def uninstall(self) -> None:
        if self._deferred:  # (a budget's alarm inside a step: the collector back on for what follows)
            self._settle.resume(self._deferred)
            self._deferred = False
        self._settle.uninstall()
        gc.unfreeze()

    def before(self) -> None:
        self._deferred = self._defer() if self._defer is not None else False

    def after(self, kinds: Any) -> float:
        """The step's notice ``kinds`` seen; returns the CPU of the collection that ran
        once the collector was back (collecting the core's garbage is its cost)."""
        for kind in kinds:
            self._settle.notice(kind)
        self._settle.settle()  # (the service's order at a pass's end: sends, settle, resume)
        if not self._deferred:
            return 0.0
        c0 = self._settle.collect_s
        self._settle.resume(self._deferred)
        self._deferred = False
        _Allocation()  # (a collection the step made due runs here, as after a pass)
        return self._settle.collect_s - c0


def big_step(kinds: Any, formed: bool) -> Optional[str]:
    """Which of the two big steps a step with these notice ``kinds`` is, ``formed``: the
    world's formation was seen already -- the step that forms the world, then the first
    later one with an ``epoch`` notice (it aggregates epoch 0); None otherwise."""
    if not formed:
        return "formation" if "world_formed" in kinds else None
    return "boundary" if "epoch" in kinds else None


def replay_timed(config: Any, events: list) -> dict[str, Any]:
    """Step every event of the journal once, timing each step.

    The collector is treated as the service treats it, by the service's own
    ``gcsettle.CollectorSettle``: after the step that forms the world and after each
    epoch's, one collection and a ``gc.freeze()`` (not timed: the service does it after
    that pass's sends). Collections wait while a step runs and its sends are built, as
    in a pass, and run after them (after the settle, when there is one). An automatic
    collection of the formation or the epoch step (with a checkout that does not defer:
    one that fell inside it) is reported beside that step's own time (``*_gc_ms``), not
    in it."""
    st = initial_state(config)
    total = heartbeat = 0.0
    beats = 0
    formation: Optional[float] = None
    boundary: Optional[float] = None
    builds: dict[str, float] = {}
    in_gc: dict[str, float] = {}
    clock = time.thread_time  # CPU time: the machine may be shared, the core's work is what counts
    collections = ServiceCollector(clock)  # times every collection, settles as the service does
    collections.install()
    try:
        for ev in events:
            gc0 = collections.collect_s
            collections.before()
            t0 = clock()
            st, cmds = step(st, ev)
            dt = clock() - t0
            total += dt
            if type(ev) is HeartbeatSeen:
                heartbeat += dt
                beats += 1
            kinds = {c.kind for c in cmds if isinstance(c, Notice)} if cmds else ()
            big = big_step(kinds, formation is not None) if boundary is None else None
            if big is not None:
                builds[big] = _build_s(cmds, clock)
                in_step = collections.collect_s - gc0
                if big == "formation":
                    formation = dt - in_step
                else:
                    boundary = dt - in_step
            del cmds
            total += collections.after(kinds)  # (collecting the core's garbage is its cost, wherever it runs)
            if big is not None:
                in_gc[big] = collections.collect_s - gc0
    finally:
        collections.uninstall()

    def ms(x: Optional[float]) -> Optional[float]:
        return x * 1e3 if x is not None else None

    return {
        "core_s": total,
        "heartbeat_us": heartbeat / beats * 1e6 if beats else None,
        "formation_ms": ms(formation),
        "formation_gc_ms": ms(in_gc.get("formation")),
        "epoch_dispatch_ms": ms(boundary),
        "epoch_dispatch_gc_ms": ms(in_gc.get("boundary")),
        "formation_build_ms": ms(builds.get("formation")),
        "epoch_dispatch_build_ms": ms(builds.get("boundary")),
        "ok": bool(st.run.ok),
    }


def _build_s(cmds: list, clock: Any) -> float:
    """CPU seconds to write every ``Send``'s bytes as the shell does (``wire``; before
    it existed, the control built when first read, then serialised)."""
    wire = getattr(Send, "wire", None) is not None
    t0 = clock()
    for c in cmds:
        if isinstance(c, Send):
            c.wire if wire else c.control.SerializeToString()
    return clock() - t0


def peak_mib(config: Any, events: list) -> float:
    gc.collect()
    tracemalloc.start()
    st = initial_state(config)
    for ev in events:
        st, _ = step(st, ev)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return round(peak / 2**20, 2)


def _median(rows: list[dict], key: str) -> Any:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def summarise(rows: list[dict], events: int, peak: Optional[float]) -> dict[str, Any]:
    core_s = statistics.median(r["core_s"] for r in rows)
    return {
        "events": events,
        "replays_ok": all(r["ok"] for r in rows),
        "core_s": round(core_s, 4),
        "us_per_event": round(core_s / events * 1e6, 2),
        "events_per_s": round(events / core_s),
        "heartbeat_us": _median(rows, "heartbeat_us"),
        "formation_ms": _median(rows, "formation_ms"),
        "epoch_dispatch_ms": _median(rows, "epoch_dispatch_ms"),
        "formation_gc_ms": _median(rows, "formation_gc_ms"),
        "epoch_dispatch_gc_ms": _median(rows, "epoch_dispatch_gc_ms"),
        "formation_build_ms": _median(rows, "formation_build_ms"),
        "epoch_dispatch_build_ms": _median(rows, "epoch_dispatch_build_ms"),
        "peak_mib": peak,
    }


def _peer_replays(peer: str, journal: str, repeats: int, memory: bool, budget_s: float) -> dict[str, Any]:
    """Replay the pickled journal through the checkout at ``peer`` (a subprocess):
    ``{"rows": [...], "peak_mib": ...}``, or ``{"over_budget": True}`` / ``{"error": ...}``."""
    env = peer_env(peer)
    cmd = [sys.executable, os.path.abspath(__file__), "--replay", journal, "--repeats", str(repeats)]
    if not memory:
        cmd.append("--no-memory")
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s, check=False)
    except subprocess.TimeoutExpired:
        return {"over_budget": True}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout)


class Budget:
    """Seconds left for one size's own work (simulation, our replays): ``with budget:``
    raises ``OverBudget`` inside the block once they run out (SIGALRM)."""

    def __init__(self, seconds: float) -> None:
        self.left = seconds

    def __enter__(self) -> "Budget":
        if self.left <= 0:
            raise OverBudget()
        self._t0 = time.perf_counter()
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.left)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        self.left -= time.perf_counter() - self._t0


def measure(n: int, policy: str, args: argparse.Namespace, peer: str) -> dict[str, Any]:
    """Simulate, then replay ours and the peer's in turn (so both see the same load)."""
    t0 = time.perf_counter()
    budget = Budget(args.budget_s)
    cfg = workload(n, policy, batches=args.batches, base_ms=args.base_ms, batch_size=args.batch_size,
                   reduce_ms=args.reduce_ms)  # fmt: skip
    ours: list[dict] = []
    theirs: list[dict] = []
    peer_peak: Optional[float] = None
    peer_failed: dict[str, Any] = {}
    journal = ""
    try:
        cpu0 = time.process_time()
        with budget:
            res = simulate(cfg)
        sim_s, sim_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        config, events = res.state.config, res.events
        if peer:
            with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
                pickle.dump((config, events), f)
            journal = f.name
        for i in range(args.repeats):
            with budget:
                if journal:
                    # Beside a peer, ours replays the same way: in a fresh process, from the
                    # pickle. In this one, the simulation's heap scatters the state the
                    # replay builds, and that layout alone made ours 2x slower in the big
                    # steps (22 vs 9 ms to form 4,096 ranks, the same code).
                    got = _peer_replays(OWN_TREE, journal, 1, False, args.budget_s)
                    if "rows" not in got:
                        raise SystemExit(f"our own replay failed: {got}")
                    ours.extend(got["rows"])
                else:
                    ours.append(replay_timed(config, events))
            if journal and not peer_failed:
                got = _peer_replays(peer, journal, 1, args.memory and i == 0, args.budget_s)
                if "rows" in got:
                    theirs.extend(got["rows"])
                    peer_peak = got["peak_mib"] if got.get("peak_mib") is not None else peer_peak
                else:
                    peer_failed = got
        with budget:
            peak = peak_mib(config, events) if args.memory else None
    except OverBudget:
        return {"n": n, "over_budget": True, "budget_s": args.budget_s}
    finally:
        if journal:
            os.unlink(journal)
    row: dict[str, Any] = {"n": n, "finished_ok": bool(res.finished and res.finished.ok)}
    row.update(summarise(ours, len(events), peak))
    row["sim_s"] = round(sim_s, 2)
    row["sim_cpu_s"] = round(sim_cpu_s, 2)  # what the simulation costs on a core of its own
    if peer:
        row["peer"] = summarise(theirs, len(events), peer_peak) if theirs and not peer_failed else peer_failed
        if "us_per_event" in row["peer"]:
            row["peer_over_ours"] = round(row["peer"]["us_per_event"] / row["us_per_event"], 2)
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256,1024,4096,16384", help="world sizes, comma-separated")
    ap.add_argument("--policies", default="sync,cadence,async")
    ap.add_argument("--repeats", type=int, default=3, help="replays per size (medians)")
    ap.add_argument("--batches", type=int, default=8, help="batches per rank per epoch")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--base-ms", type=float, default=50.0, help="the fastest rank's ms per batch")
    ap.add_argument("--reduce-ms", type=float, default=None,
                    help="the simulated reducer's ms per round at every size (default: 0.5 ms per rank)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="cut a size off (and end its curve) after this many seconds")  # fmt: skip
    ap.add_argument("--peer", default="", help="another checkout to replay the same journals through")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the tracemalloc replay")
    ap.add_argument("--quick", action="store_true", help="smoke run: N = 16, 64, one replay")
    ap.add_argument("--replay", default="", help=argparse.SUPPRESS)  # the peer's side: one pickled journal
    args = ap.parse_args()
    if args.replay:
        with open(args.replay, "rb") as f:
            config, events = pickle.load(f)
        rows = [replay_timed(config, events) for _ in range(args.repeats)]
        print(json.dumps({"rows": rows, "peak_mib": peak_mib(config, events) if args.memory else None}))
        return
    if args.quick:
        args.sizes, args.repeats, args.batches = "16,64", 1, 4
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {"bench": "core_scale", "sizes": sizes, "repeats": args.repeats,
                           "batches_per_rank": args.batches, "base_ms": args.base_ms, "peer": args.peer or None,
                           "reduce_ms": args.reduce_ms,
                           "policies": {}}  # fmt: skip
    for policy in args.policies.split(","):
        curve: list[dict] = []
        skipped: list[int] = []
        peer_skipped: list[int] = []
        peer = args.peer
        for n in sizes:
            if skipped:
                skipped.append(n)
                continue
            if not peer and args.peer:
                peer_skipped.append(n)
            row = measure(n, policy, args, peer)
            curve.append(row)
            print(json.dumps({"policy": policy, **row}), file=sys.stderr, flush=True)  # progress
            if row.get("over_budget"):
                skipped.append(-1)  # every larger size is skipped
            elif peer and not row["peer"].get("us_per_event"):
                peer = ""  # the peer's curve ends here (over budget or failed); ours goes on
        out["policies"][policy] = {"curve": curve, "skipped": [n for n in skipped if n > 0],
                                   "peer_skipped": peer_skipped}  # fmt: skip
    rows = [r for p in out["policies"].values() for r in p["curve"] if not r.get("over_budget")]
    out["ok"] = all(r["finished_ok"] and r["replays_ok"] for r in rows)
    print(json.dumps(out, indent=2))
    if not out["ok"]:
        raise SystemExit("a simulated job or a replay did not finish cleanly (see finished_ok, replays_ok)")


if __name__ == "__main__":
    main()
