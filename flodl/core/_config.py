"""CoreConfig: the run's settings as the core sees them (validated, immutable).

The cadence knobs (``anchor`` .. ``meta_controller``) configure the ElChe engine of the
Cadence policy (``_cadence``/``_feedback``); Sync ignores them. Their defaults are the
reference's (spec §1.1, §6.1): anchor 4 batches of the slowest rank per window, growth
floor = the initial anchor, ceiling 1000, 5 % fixed-overhead target, no count-move cap,
the LevelGuard, the LR meta-controller on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._max_failure import max_failure_limit
from ._roles import parse_policy

__all__ = ["CoreConfig", "POLICIES", "PLANES", "GUARDS"]

POLICIES = ("sync", "cadence", "async")
PLANES = ("bus", "collective")
COLLECTIVE_BACKENDS = ("gloo", "nccl")
GUARDS = ("none", "level", "growth")


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    world_size: int
    batch_size: int = 32
    num_epochs: int = 10
    seed: int = 42
    # Cadence is flodl's point (unequal ranks stop waiting for the slowest); "sync"
    # averages after every step of every rank. The service shell picks its own default.
    policy: str = "cadence"
    plane: str = "bus"
    # Collective plane (``_collective``): the torch.distributed backend the ranks build
    # their process group with (gloo: CPU tensors; nccl: GPU tensors), and the timeout
    # of group formation and of one all-reduce (a hung peer is usually declared dead by
    # liveness first; this is the backstop).
    collective_backend: str = "gloo"
    collective_timeout_s: float = 60.0
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
    # The world must form (every slot admitted) within this long of the run's first event,
    # or the run fails naming who is missing and why (a rank refused at hello, one that
    # died before the start, one never heard from). 0: wait forever.
    form_timeout_s: float = 300.0
    # The model signature every rank must present (sha256 from
    # ``flodl_worker.params.model_signature``). Empty: the first admitted rank's, released
    # again if every rank holding it leaves before the world forms (no squatting).
    model_signature: bytes = b""
    # Whether to run the final canonical eval on the eval role before Shutdown.
    final_eval: bool = True
    # -- Cadence (ElChe) ---------------------------------------------------------------
    # Initial anchor: batches the slowest rank runs per window (faster ranks run
    # proportionally more). 4 amortises a reduce over a few batches from the first window.
    anchor: int = 4
    # Window-pressure growth never goes below this (None: the initial anchor).
    min_anchor: Optional[int] = None
    # Staleness safety net; the overhead tune normally settles far below it.
    max_anchor: int = 1000
    # Grow the anchor while reduce + fill exceed this fraction of the window's wall.
    overhead_target: float = 0.05
    # Cap on how far one recalibration may move a count, and the Throttle spread
    # (a rank more than this many steps ahead of the slowest pauses). None or 0: off.
    max_batch_diff: Optional[int] = None
    # Convergence guard over the replicas' divergence: "level" | "growth" | "none".
    guard: str = "level"
    # LR-aware meta-controller above ElChe (LR cliffs, sustained divergence).
    meta_controller: bool = True
    # Batches per rank in the first, uncalibrated window (None: the anchor). Before any
    # measurement every rank gets the same count, so the fastest idles while the slowest
    # finishes it: a short probe window bounds that cost. Ours, not the reference's.
    probe_batches: Optional[int] = None
    # -- checkpoints and failure policy (``_checkpointing``) ----------------------------
    # A consensus checkpoint after every N aggregated epochs (0: none).
    checkpoint_every: int = 0
    # Whether the run's end by failure or operator stop asks the role rank to save.
    checkpoint_on_failure: bool = False
    # Dead ranks that end the run: "N" (absolute) or "P%" (of world_size); "" = never.
    max_failure: str = ""
    # -- callback roles (``_roles``) ----------------------------------------------------
    # Who runs evals, saves and the epoch callback: "fastest" (the fastest alive rank by
    # ElChe pace; lowest alive without one) or "rank:N" (rank N, clamped to world_size-1).
    epoch_callback_policy: str = "fastest"

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
        if self.policy == "async" and self.plane != "bus":  # reference: NcclAsync was dropped
            raise ValueError("policy async needs plane = bus (the EASGD blend is a bus-plane round)")
        if self.collective_backend not in COLLECTIVE_BACKENDS:
            raise ValueError(
                f"collective_backend must be one of {COLLECTIVE_BACKENDS}, got {self.collective_backend!r}"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if not 0.0 < self.easgd_alpha <= 1.0:
            raise ValueError(f"easgd_alpha must be in (0, 1], got {self.easgd_alpha}")
        if self.total_samples < 0:
            raise ValueError(f"total_samples must be >= 0, got {self.total_samples}")
        if self.heartbeat_interval_s <= 0 or self.liveness_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and liveness_timeout_s must be > 0")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not self.form_timeout_s >= 0:
            raise ValueError(f"form_timeout_s must be >= 0 (0: no deadline), got {self.form_timeout_s}")
        if self.model_signature and len(self.model_signature) != 32:
            raise ValueError(f"model_signature must be 32 bytes (sha256), got {len(self.model_signature)}")
        max_failure_limit(self.max_failure, self.world_size)
        parse_policy(self.epoch_callback_policy)
        self._check_cadence()

    def _check_cadence(self) -> None:
        if self.anchor < 1:
            raise ValueError(f"anchor must be >= 1, got {self.anchor}")
        if self.min_anchor is not None and self.min_anchor < 1:
            raise ValueError(f"min_anchor must be >= 1, got {self.min_anchor}")
        if self.max_anchor < 1:
            raise ValueError(f"max_anchor must be >= 1, got {self.max_anchor}")
        if self.probe_batches is not None and self.probe_batches < 1:
            raise ValueError(f"probe_batches must be >= 1, got {self.probe_batches}")
        if not 0.0 < self.overhead_target < 1.0:
            raise ValueError(f"overhead_target must be in (0, 1), got {self.overhead_target}")
        if self.max_batch_diff is not None and self.max_batch_diff < 0:
            raise ValueError(f"max_batch_diff must be >= 0, got {self.max_batch_diff}")
        if self.guard not in GUARDS:
            raise ValueError(f"guard must be one of {GUARDS}, got {self.guard!r}")

    @property
    def batch_diff_cap(self) -> Optional[int]:
        """``max_batch_diff`` with 0 meaning off, as None."""
        return self.max_batch_diff or None
