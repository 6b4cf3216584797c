"""Where a big step's core time goes: the formation and the first epoch boundary, by function.

``core_scale.py`` times the step that forms the world (it dispatches epoch 0 too) and the
one that aggregates epoch 0 (and dispatches epoch 1) as wholes. This bench simulates the
same job (``core_scale.workload``: N ranks at the speeds 1, 2, 4), keeps its journal and,
in a fresh process per replay, steps it up to just before each of those two steps. It
then wraps every function and method of ``flodl.core`` in a CPU timer and takes that one
step. Per function it reports calls and inclusive ms; a function called inside another
counts in both.

* ``step_ms`` is the step's own CPU time, from a replay without the wrappers (but for
  the few ``phases_ms`` times: a call each, once a step). The
  replay treats the collector as ``core_scale``'s does (``ServiceCollector``: as the
  service's pass), so it reads as that bench's ``--peer`` figures, which replay in fresh
  processes too.
* ``phases_ms``: what the step is made of, timed in that plain replay: forming the world,
  dispatching an epoch, closing a round, opening the next, aggregating an epoch
  (``PHASES``, those it ran: a timer on a call made once a step costs nothing that shows).
* ``wrapped_step_ms`` is the same step with the wrappers. Each wrapper costs about 0.5 us
  a call, so a function called once per rank reads high by that much a rank.
* ``same_commands``: both replays returned the same commands, so the wrappers changed
  nothing.

A function called only through a table built at import (the step's handlers) is not
wrapped; its callees are. Every figure is the median of ``--repeats`` fresh processes.
Speed is this bench's output, never a test's assertion. Prints one JSON object.

    python bench/core_step_breakdown.py                      # 4,096 cadence ranks
    python bench/core_step_breakdown.py --n 1024 --policy sync --top 20
    python bench/core_step_breakdown.py --quick              # a smoke run: 64 ranks, one replay
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from types import FunctionType
from typing import Any, Callable, Optional

from core_scale import ServiceCollector, big_step, workload
from flodl.core import Notice, initial_state, step

STEPS = ("formation", "boundary")
# What the two steps are made of, timed in the plain replay too (once a step each: their
# timers cost nothing that shows): forming the world, dispatching an epoch, closing a
# round, opening the next, aggregating an epoch. (module, function name): any class.
PHASES = {("_membership", "form_all"), ("_dispatcher", "dispatch_epoch"), ("_dispatch", "dispatch_epoch"),
          ("_averaging", "finish"), ("_averaging", "trigger"), ("_metrics", "aggregate_next")}  # fmt: skip


def find_steps(config: Any, events: list) -> dict[str, int]:
    """The journal index of each big step, as ``core_scale`` tells them (``big_step``)."""
    st = initial_state(config)
    found: dict[str, int] = {}
    for i, ev in enumerate(events):
        st, cmds = step(st, ev)
        big = big_step({c.kind for c in cmds if isinstance(c, Notice)}, "formation" in found)
        if big is not None:
            found[big] = i
            if big == "boundary":
                break
    return found


def _core_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("flodl.core") and m is not None]


def install_timers(acc: dict[str, list], only: Optional[set[tuple[str, str]]] = None) -> None:
    """Replace every plain function of ``flodl.core`` (in each module that names it) and
    every method of its classes by a wrapper adding its calls and CPU seconds to ``acc``;
    ``only``: just those, as (module, function name)."""
    clock = time.thread_time

    def module(fn: Callable) -> str:
        return fn.__module__.rsplit(".", 1)[-1]

    def wanted(fn: Callable) -> bool:
        return only is None or (module(fn), fn.__name__) in only

    def timer(label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                row = acc.get(label)
                if row is None:
                    row = acc[label] = [0, 0.0]
                row[0] += 1
                row[1] += clock() - t0

        return timed

    modules = _core_modules()
    wrapped: dict[int, Callable] = {}  # id(function) -> its wrapper, one per function
    for m in modules:
        for name, obj in list(vars(m).items()):
            if type(obj) is FunctionType and obj.__module__.startswith("flodl.core") and wanted(obj):
                if id(obj) not in wrapped:
                    wrapped[id(obj)] = timer(f"{module(obj)}.{obj.__qualname__}", obj)
                setattr(m, name, wrapped[id(obj)])
    classes = {id(c): c for m in modules for c in vars(m).values()
               if isinstance(c, type) and c.__module__ == m.__name__}  # fmt: skip
    for c in classes.values():
        for name, obj in list(vars(c).items()):
            if type(obj) is FunctionType and not name.startswith("__") and wanted(obj):
                setattr(c, name, timer(f"{module(obj)}.{obj.__qualname__}", obj))


def replay_to(journal: str, index: int, wrap: bool) -> dict[str, Any]:
    """One fresh replay: step to ``index``, then take that step, timed (and, with ``wrap``,
    broken down)."""
    with open(journal, "rb") as fh:
        config, events = pickle.load(fh)
    acc: dict[str, list] = {}
    install_timers(acc, None if wrap else PHASES)
    st = initial_state(config)
    collections = ServiceCollector(time.thread_time)  # as core_scale's replay: the same heap, the same step time
    collections.install()
    try:
        for ev in events[:index]:
            collections.before()
            st, cmds = step(st, ev)
            kinds = {c.kind for c in cmds if isinstance(c, Notice)}
            del cmds
            collections.after(kinds)
        acc.clear()
        collections.before()
        t0 = time.thread_time()
        st, cmds = step(st, events[index])
        dt = time.thread_time() - t0
    finally:
        collections.uninstall()
    return {
        "step_ms": dt * 1e3,
        "commands": [type(c).__name__ + ":" + str(getattr(c, "rank", getattr(c, "kind", ""))) for c in cmds],
        "functions": {k: [n, s * 1e3] for k, (n, s) in acc.items()},
    }


def _child(journal: str, index: int, wrap: bool) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", journal, str(index), "1" if wrap else "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"replay failed: {(done.stderr.strip().splitlines() or ['exit'])[-1]}")
    return json.loads(done.stdout)


def breakdown(journal: str, index: int, repeats: int, top: int) -> dict[str, Any]:
    plain = [_child(journal, index, False) for _ in range(repeats)]
    timed = [_child(journal, index, True) for _ in range(repeats)]
    names = set().union(*(t["functions"] for t in timed))
    rows = []
    for name in names:
        ms = statistics.median(t["functions"].get(name, [0, 0.0])[1] for t in timed)
        rows.append({"function": name, "calls": timed[0]["functions"].get(name, [0])[0], "ms": round(ms, 3)})
    rows.sort(key=lambda r: -r["ms"])
    phases = set().union(*(p["functions"] for p in plain))
    return {
        "index": index,
        "step_ms": round(statistics.median(p["step_ms"] for p in plain), 3),
        "phases_ms": {name: round(statistics.median(p["functions"].get(name, [0, 0.0])[1] for p in plain), 3)
                      for name in sorted(phases)},  # fmt: skip
        "wrapped_step_ms": round(statistics.median(t["step_ms"] for t in timed), 3),
        "same_commands": all(t["commands"] == plain[0]["commands"] for t in [*plain, *timed]),
        "commands": len(plain[0]["commands"]),
        "functions": rows[:top],
    }


def main() -> None:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        journal, index, wrap = sys.argv[i + 1], int(sys.argv[i + 2]), sys.argv[i + 3] == "1"
        print(json.dumps(replay_to(journal, index, wrap)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="ranks")
    ap.add_argument("--policy", default="cadence")
    ap.add_argument("--repeats", type=int, default=3, help="fresh replays per step and kind (medians)")
    ap.add_argument("--top", type=int, default=30, help="functions listed per step, the costliest first")
    ap.add_argument("--quick", action="store_true", help="smoke run: 64 ranks, one replay")
    args = ap.parse_args()
    if args.quick:
        args.n, args.repeats = 64, 1
    from flodl.sim import simulate

    res = simulate(workload(args.n, args.policy, batches=8, base_ms=50.0, batch_size=32))
    config, events = res.state.config, res.events
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as f:
        pickle.dump((config, events), f)
    try:
        at = find_steps(config, events)
        out: dict[str, Any] = {"bench": "core_step_breakdown", "n": args.n, "policy": args.policy,
                               "repeats": args.repeats, "events": len(events)}  # fmt: skip
        for name in STEPS:
            out[name] = breakdown(f.name, at[name], args.repeats, args.top) if name in at else None
    finally:
        os.unlink(f.name)
    out["ok"] = all(out[name] is not None and out[name]["same_commands"] for name in STEPS)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
