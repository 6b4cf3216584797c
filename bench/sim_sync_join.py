"""Sync with a rank joining mid-epoch, in the simulator: what re-partitioning the epoch buys.

Each scenario forms a Sync world from its members, then one or two ranks join early in
epoch 0 (``hello_at``). Two runs per seed, side by side in one process:

* ``repartition``: this checkout -- at the first finished round after a joiner is
  seeded, the members above the level are trimmed and the joiner trains what they give
  back (``flodl.core._repartition``);
* ``next_epoch`` (the peer, what Sync did before): the same core with the debt switched
  off (``_repartition.owe`` does nothing), so the joiner idles until epoch 1's partition.

Read from the journal of events, per run: ``before_sps`` = samples trained per virtual
second before the (first) joiner is seeded; ``after_sps`` = samples of the join's epoch
trained per second from then to that epoch's last batch; ``epoch_s`` = that epoch's span
(first to last batch); ``run_s`` = the run's virtual time; ``moved`` = samples the trims
handed to joiners. Medians over ``--seeds`` seeds (batch-time jitter); ratios are
repartition / next_epoch of the same seed. Virtual time: the machine's load does not
enter the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from typing import Iterator

from flodl.core import JoinerSeeded
from flodl.core import _repartition
from flodl.sim import SimConfig, batch_ends, simulate

SCENARIOS = {
    # name: (ms per batch of every rank, {joiner: hello_at})
    "equal_2+1": ((20.0, 20.0, 20.0), {2: 1.0}),
    "hetero_2+1": ((10.0, 30.0, 15.0), {2: 1.0}),
    "equal_2+2": ((20.0, 20.0, 20.0, 20.0), {2: 1.0, 3: 1.5}),
}


@contextlib.contextmanager
def next_epoch_only() -> Iterator[None]:
    """The peer: a joiner is owed nothing of the live epoch (Sync before issue 12's fix)."""
    owe = _repartition.owe
    _repartition.owe = lambda st, rank: None
    try:
        yield
    finally:
        _repartition.owe = owe


def measure(cfg: SimConfig) -> dict:
    r = simulate(cfg)
    assert r.finished is not None and r.finished.ok, r.finished
    for c in r.summary["coverage"]:
        assert (c["trained"], c["duplicates"], c["missing"]) == (c["expected"], 0, 0), c
    joined = min(e.now for e in r.events if isinstance(e, JoinerSeeded))
    batches = list(batch_ends(r.events))  # (batch, when it ended)
    first = min(t for _e, t in batches)
    epoch = next(e.epoch for e, t in batches if t >= joined)  # the epoch live at the join
    mine = [(e, t) for e, t in batches if e.epoch == epoch]
    end = max(t for _e, t in mine)
    before = sum(e.samples for e, t in batches if t < joined)
    after = sum(e.samples for e, t in mine if t >= joined)
    return {
        "joined_at_s": round(joined, 3),
        "before_sps": before / (joined - first),
        "after_sps": after / (end - joined),
        "epoch_s": end - min(t for _e, t in mine),
        "run_s": r.virtual_s,
        "moved": r.summary["elastic"].get("repartition", {}).get("samples", 0),
    }


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(row[key] for row in rows), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--total", type=int, default=4800, help="samples per epoch")
    args = ap.parse_args()
    out: dict = {"bench": "sim_sync_join", "seeds": args.seeds, "total_samples": args.total, "scenarios": {}}
    for name, (ms, hello_at) in SCENARIOS.items():
        rows: dict[str, list[dict]] = {"repartition": [], "next_epoch": []}
        for seed in range(args.seeds):
            cfg = SimConfig(ms_per_batch=ms, total_samples=args.total, batch_size=8, epochs=2, policy="sync",
                            seed=seed, hello_at=hello_at,
                            core_overrides=dict(min_ranks=len(ms) - len(hello_at), join_timeout_s=0.0))  # fmt: skip
            rows["repartition"].append(measure(cfg))
            with next_epoch_only():
                rows["next_epoch"].append(measure(cfg))
        keys = ("before_sps", "after_sps", "epoch_s", "run_s", "moved")
        res = {mode: {k: _median(v, k) for k in keys} for mode, v in rows.items()}
        ratio = lambda k: _median(  # noqa: E731 -- per seed, then the median
            [{k: a[k] / b[k]} for a, b in zip(rows["repartition"], rows["next_epoch"])], k
        )
        res["repartition_over_next_epoch"] = {k: ratio(k) for k in ("after_sps", "epoch_s", "run_s")}
        out["scenarios"][name] = {"ms_per_batch": list(ms), "hello_at": hello_at, **res}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
