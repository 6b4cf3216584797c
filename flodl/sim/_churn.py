"""Churn cases: random joins, deaths, restarts and coordinator crashes, in virtual time.

``churn_case(seed, policy)`` draws one run from its seed -- a capacity of 3 to 6 ranks of
unequal speeds, a quorum below it, ranks that arrive late (after the world formed: they
join the running world), one that never comes, ranks killed mid-run and, in half the
cases, started again by their agent, sometimes a coordinator restart -- simulates it, and
says whether it kept its promises: the run finished ok, every epoch committed exactly
once, and no joiner trained before its seed consensus arrived.
A campaign: ``python bench/elastic.py --sim``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._world import Result, SimConfig, simulate

__all__ = ["ChurnCase", "churn_case"]


@dataclass
class ChurnCase:
    seed: int
    policy: str
    cfg: SimConfig
    result: Result

    @property
    def joins(self) -> int:
        return len(self.result.summary.get("elastic", {}).get("joins", []))

    @property
    def exact(self) -> bool:
        fin = self.result.finished
        if fin is None or not fin.ok or self.result.violations:
            return False
        cov = self.result.summary["coverage"]
        return len(cov) == self.cfg.epochs and all(
            c["trained"] == c["expected"] and c["duplicates"] == 0 and c["missing"] == 0 for c in cov
        )

    def describe(self) -> str:
        fin = self.result.finished
        return (f"seed {self.seed} {self.policy}: finished={fin and (fin.ok, fin.reason)} "
                f"violations={self.result.violations} coverage={self.result.summary.get('coverage')} "
                f"cfg={self.cfg}")  # fmt: skip


def churn_case(seed: int, policy: str, *, crash: bool = True) -> ChurnCase:
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    quorum = rng.randint(2, n - 1)
    ms = tuple(rng.choice((8.0, 12.0, 20.0, 35.0)) for _ in range(n))
    hello_at: dict[int, float] = {}
    late = rng.sample(range(quorum, n), k=n - quorum)  # the ranks beyond the quorum come late (or never)
    for i, r in enumerate(late):
        hello_at[r] = float("inf") if i == 0 and rng.random() < 0.3 else rng.uniform(0.05, 1.5)
    victims = rng.sample(range(quorum), k=rng.randint(0, min(2, quorum - 1)))
    fail_at = {r: rng.randint(3, 40) for r in victims}
    cfg = SimConfig(
        ms_per_batch=ms, total_samples=rng.choice((480, 960)), batch_size=8, epochs=3, policy=policy, seed=seed,
        latency_s=0.002, hello_at=hello_at, fail_at=fail_at,
        respawn_after_s=rng.choice((None, 0.2, 0.6)) if fail_at else None,
        crash_at=(rng.randint(30, 400),) if crash and rng.random() < 0.3 else (),
        core_overrides=dict(min_ranks=quorum, join_timeout_s=0.0),
    )  # fmt: skip
    return ChurnCase(seed, policy, cfg, simulate(cfg))
