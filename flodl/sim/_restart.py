"""Seeded coordinator-restart campaigns over the simulator (tests and ``bench/``).

``restart_case(seed, policy)`` draws a small world from the seed, runs it once clean to
learn how long its journal gets, then again with the coordinator killed at one (or
more) journal positions drawn from the same seed, and reports whether every epoch's
committed coverage was exactly once. Both halves are the real logic: the core rebuilt by
``replay`` and fed ``CoordinatorRestarted``, the rank machines resyncing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ._world import Result, SimConfig, simulate

__all__ = ["RestartCase", "restart_case", "exact_coverage"]


@dataclass(frozen=True)
class RestartCase:
    seed: int
    policy: str
    crash_at: tuple[int, ...]
    result: Result
    expected: int
    epochs: int

    @property
    def exact(self) -> bool:
        return exact_coverage(self.result, self.expected, self.epochs)

    def describe(self) -> str:
        f = self.result.finished
        return (
            f"seed={self.seed} policy={self.policy} crash_at={self.crash_at} restarts={self.result.restarts} "
            f"lost_frames={self.result.lost_frames} finished={f.ok if f else None} "
            f"reason={f.reason if f else '-'} coverage={self.result.summary.get('coverage')}"
        )


def exact_coverage(res: Result, expected: int, epochs: int) -> bool:
    if res.finished is None or not res.finished.ok:
        return False
    cov = res.summary.get("coverage", [])
    return len(cov) == epochs and all(
        (c["expected"], c["trained"], c["duplicates"], c["missing"]) == (expected, expected, 0, 0) for c in cov
    )


def restart_case(seed: int, policy: str, *, crashes: int = 1, ranks: int = 3, epochs: int = 2) -> RestartCase:
    rng = random.Random(seed)
    ms = tuple(rng.choice((8.0, 12.0, 20.0, 35.0)) for _ in range(ranks))
    total = rng.choice((96, 160, 240))
    base = SimConfig(
        ms_per_batch=ms, total_samples=total, batch_size=8, epochs=epochs, seed=seed, policy=policy,
        latency_s=rng.choice((0.0005, 0.004, 0.02)),  # 0.02: many frames in flight at the crash
        restart_after_s=rng.choice((0.05, 0.5, 2.0)),
        max_virtual_s=1_800.0,  # a few minutes of virtual time is ample; a hang ends there
    )  # fmt: skip
    clean = simulate(base)
    n = max(2, len(clean.events))
    crash_at = tuple(sorted(rng.randrange(1, n) for _ in range(crashes)))
    cfg = SimConfig(**{**base.__dict__, "crash_at": crash_at})
    return RestartCase(seed, policy, crash_at, simulate(cfg), total, epochs)
