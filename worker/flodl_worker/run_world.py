"""flodl_worker.run_world: the run's world size inside a rank, for LR rules that need it.

``world_size()`` is the run's capacity (the ranks it holds): from the start of
``run_rank`` the rank's ``FLODL_WORLD_SIZE`` (its ``optimizer_fn`` is first called on a
probe model, before the hello), and from admission the RunSpec's ``world_size`` (the
coordinator refuses a hello whose world size differs from its own, so the two agree).

Why a script wants it: the learning rate a script was tuned with on one process is not
what it needs on K ranks. Under DDP the global batch grows K-fold and users scale the LR
(linear for SGD, square root for Adam). flodl averages *parameters*: with SGD the
average of K ranks' steps at LR ``lr`` is the step DDP takes at ``lr`` on the K-fold
batch, so no scaling is needed to match DDP at the same LR. An adaptive optimizer
(Adam) normalises each rank's step by that rank's own gradient noise, so the average
of K noisy unit-size steps is about ``1/sqrt(K)`` of DDP's step while noise dominates:
``lr * sqrt(K)`` matches DDP at ``lr`` (``bench/real_models.py`` measures it). The
examples' ``--lr-scale`` applies that rule (``examples._common.scaled_lr``).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["world_size", "set_world_size"]

_world: Optional[int] = None


def world_size() -> int:
    """The run's world size (FLODL_WORLD_SIZE, then the RunSpec's), inside ``run_rank``."""
    if _world is None:
        raise RuntimeError("flodl_worker.world_size() is only known inside run_rank (a flodl rank)")
    return _world


def set_world_size(n: int) -> None:
    """The rank runtime publishes the world size (before any ``optimizer_fn`` call)."""
    global _world
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    _world = int(n)
