"""CoreConfig: the run's settings as the core sees them (validated, immutable)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CoreConfig", "POLICIES", "PLANES"]

POLICIES = ("sync", "cadence", "async")
PLANES = ("bus", "collective")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    world_size: int
    batch_size: int = 32
    num_epochs: int = 10
    seed: int = 42
    policy: str = "sync"
    plane: str = "bus"
    gamma: float = 1.0  # contribution mass n**gamma; 1 = plain work weighting
    easgd_alpha: float = 0.5
    bf16_wire: bool = False
    # 0: the cohort's dataset length (from the first admitted hello) is the epoch size.
    total_samples: int = 0
    # Liveness (zguide's named trio): beacon interval, and how long silence may last.
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 10.0
    # A Pending averaging round older than this ends the run (ShutdownWithSave ReduceStall).
    reduce_stall_s: float = 300.0
    # Whether to run the final canonical eval on the eval role before Shutdown.
    final_eval: bool = True

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {self.num_epochs}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.plane not in PLANES:
            raise ValueError(f"plane must be one of {PLANES}, got {self.plane!r}")
        if not 0.0 < self.easgd_alpha <= 1.0:
            raise ValueError(f"easgd_alpha must be in (0, 1], got {self.easgd_alpha}")
        if self.total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {self.total_samples}")
        if self.heartbeat_interval_s <= 0 or self.liveness_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and liveness_timeout_s must be > 0")
