"""CoreConfig: the run's settings as the core sees them (validated, immutable).

This is also where every *run* setting is declared, once: each field carries its help
text (``setting(...)``), and the service (``flodl_coordinator.settings``) derives from
these fields its TOML keys, ``FLODL_<KEY>`` variables, ``--key-name`` flags, ``--help``
and the README's configuration table. A field without ``setting`` metadata is not a
setting: the service derives it (``checkpoint_on_failure``). Where the service's
spelling differs from the core's, the metadata says how: ``key`` renames
(``num_epochs`` is the setting ``epochs``), an ``Optional[int]`` is an ``int`` setting
whose 0 means None, and ``bytes`` is a hex string.

The cadence knobs (``anchor`` .. ``meta_controller``) configure the ElChe engine of the
Cadence policy (``cadence._dispatcher``/``_feedback``); Sync ignores them. Their defaults are the
reference's (spec §1.1, §6.1): anchor 4 batches of the slowest rank per window, growth
floor = the initial anchor, ceiling 1000, 5 % fixed-overhead target, no count-move cap,
the LevelGuard, the LR meta-controller on. ``probe_batches`` is ours: 1 (the deployed
service's value, so the simulator and the unit tests run the service's first window).
"""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field
from typing import Any, Optional

from ._max_failure import max_failure_limit

__all__ = ["CoreConfig", "POLICIES", "PLANES", "GUARDS", "Setting", "setting", "parse_policy"]

POLICIES = ("sync", "cadence", "async")
PLANES = ("bus", "collective")
COLLECTIVE_BACKENDS = ("gloo", "nccl")
GUARDS = ("none", "level", "growth")


def parse_policy(policy: str) -> Optional[int]:
    """None for ``"fastest"``, N for ``"rank:N"``; ValueError otherwise."""
    if policy == "fastest":
        return None
    head, sep, tail = policy.partition(":")
    if head == "rank" and sep and tail.isdigit():
        return int(tail)
    raise ValueError(f"epoch_callback_policy must be 'fastest' or 'rank:N', got {policy!r}")


# ``Setting.before`` unset: the setting is as old as the journal, or its default is what
# came before it.
class _NoBefore(enum.Enum):  # (an enum member: the same object after a copy or a pickle)
    NO_BEFORE = "NO_BEFORE"


NO_BEFORE: Any = _NoBefore.NO_BEFORE


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """What a config field is as a setting: its one-line ``help`` (flags' ``--help``), its
    README text ``doc`` (default: ``help``), its ``key`` where the setting's name differs
    from the field's, ``choices`` where it is one of a few words, and ``per_process``: a
    service setting that may differ between a run's first process and a restarted one
    (``flodl_coordinator.recovery`` compares all the others with the journal's), and
    ``before``: for a setting added after runs were journaled, the value that gives the
    behaviour from before it existed -- a journal that lacks the key ran as that, so
    recovery compares with it, not with today's default (which would replay the old run
    under a new rule and decide differently from what it sent)."""

    help: str
    doc: str = ""
    key: str = ""
    choices: tuple[str, ...] = ()
    per_process: bool = False
    aliases: tuple[str, ...] = ()  # other spellings of the key, accepted everywhere (torchrun / issue 12 names)
    before: Any = NO_BEFORE


def setting(default: Any = MISSING, *, help: str, doc: str = "", key: str = "", choices: tuple[str, ...] = (),
            per_process: bool = False, aliases: tuple[str, ...] = (), before: Any = NO_BEFORE) -> Any:  # fmt: skip
    """A dataclass field declared as a setting (``Setting``); no default: required."""
    meta = {"setting": Setting(help=help, doc=doc or help, key=key, choices=choices, per_process=per_process,
                               aliases=aliases, before=before)}  # fmt: skip
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    # Elastic membership (``_membership``, ``_run``): ``world_size`` is the capacity (slots),
    # ``min_ranks`` the quorum. Unset, the quorum is the capacity: today's fixed world.
    world_size: int = setting(
        help="capacity: the most ranks the run holds (required; alias max_ranks)", aliases=("max_ranks",),
        doc="capacity: the most ranks the run holds, rank ids `0 .. world_size-1` (alias `max_ranks`). With "
        "`min_ranks` unset the world is fixed: it forms once all `world_size` ranks are in",
    )  # fmt: skip
    min_ranks: Optional[int] = setting(
        None, help="quorum: the world may form once this many ranks are in; 0 = world_size (a fixed world)",
        doc="quorum: the world forms with at least this many ranks (0 = `world_size`, a fixed world). Once "
        "the quorum is in, formation waits up to `join_timeout_s` for more (at `world_size` it forms at once); "
        "the slots still empty stay open capacity",
    )  # fmt: skip
    join_timeout_s: float = setting(
        30.0, help="with a quorum in, wait this long (from the first event) for more ranks before forming",
        doc="the join window: with the quorum in, formation waits this long (from the service's first event) "
        "for more ranks; a full world forms at once. Only matters when `min_ranks` < `world_size`",
    )  # fmt: skip
    batch_size: int = setting(32, help="samples per step on every rank")
    num_epochs: int = setting(10, key="epochs", help="epochs to train")
    seed: int = setting(
        42, help="shuffle and init seed",
        doc="shuffle and init seed; the epoch permutation is a function of (seed, epoch)",
    )  # fmt: skip
    # Cadence is flodl's point (unequal ranks stop waiting for the slowest); "sync"
    # averages after every step of every rank.
    policy: str = setting(
        "cadence", choices=POLICIES,
        help="averaging policy: cadence (per-rank windows proportional to speed, running on across epoch "
        "ends) | sync (average once every rank stepped) | async (cadence windows with a bounded overshoot, "
        "streaming across epochs, EASGD blend of the consensus)",
        doc="`cadence`: ElChe — each rank runs a window of batches proportional to its measured speed, "
        "windows grow until averaging costs ≤ `overhead_target`; a window that reaches the end of an epoch "
        "runs on into the next one (nobody waits for the epoch to close; each epoch is still trained exactly "
        "once); `sync`: average once every rank made ≥ 1 "
        "step (held to the slowest rank, like DDP); `async`: cadence windows, but a rank may run "
        "`max_overshoot` batches past its window (3, widening to 15 while the guard is content), streams "
        "into the next epoch without waiting for the current one to close, and blends the consensus "
        "elastically (EASGD)",
    )  # fmt: skip
    plane: str = setting(
        "bus", choices=PLANES,
        help="averaging data plane: bus (weighted params over ZeroMQ, reduced by the coordinator) | "
        "collective (the ranks all-reduce with torch.distributed)",
        doc="averaging data plane: `bus` (parameters over ZeroMQ, reduced by the coordinator) or "
        "`collective` (the ranks all-reduce with torch.distributed; the coordinator forms and re-forms "
        "the process group, see docs/collective.md)",
    )  # fmt: skip
    # Collective plane (``_collective``): the backstop timeout of group formation and of one
    # all-reduce (a hung peer is usually declared dead by liveness first).
    collective_backend: str = setting(
        "gloo", choices=COLLECTIVE_BACKENDS,
        help="plane collective: torch.distributed backend gloo (CPU tensors) | nccl (GPU tensors)",
        doc="collective plane: `gloo` (CPU tensors) or `nccl` (GPU tensors)",
    )  # fmt: skip
    collective_timeout_s: float = setting(
        60.0, help="plane collective: seconds for a group to form / one all-reduce",
        doc="collective plane: group formation / one all-reduce / store-host answer timeout",
    )  # fmt: skip
    gamma: float = setting(
        1.0, help="contribution mass exponent: weight = steps**gamma (1 = plain work weighting)",
        doc="a rank's contribution weight is `steps ** gamma`",
    )  # fmt: skip
    easgd_alpha: float = setting(
        0.5, help="async: elastic blend theta += alpha * (consensus - theta), 0 < alpha <= 1",
        doc="async: each rank applies θ ← θ + α·(consensus − θ) (1 = overwrite)",
    )  # fmt: skip
    bf16_wire: bool = setting(
        False, help="bf16 tensors on the bus (f32 accumulation)",
        doc="bf16 tensors on the bus, both directions (half the bytes; sums stay f32, checkpoints stay exact f32)",
    )  # fmt: skip
    total_samples: int = setting(
        0, help="samples per epoch; 0 = the dataset length the ranks report",
    )  # fmt: skip
    # Liveness (zguide's named trio): beacon interval, and how long silence may last.
    heartbeat_interval_s: float = setting(
        1.0, help="coordinator beacon / rank heartbeat interval (a rank's batch reports stand in for its heartbeats, a coordinator's commands for its beacon)"
    )
    liveness_timeout_s: float = setting(10.0, help="silence after which a rank is declared dead")
    batch_report_ms: float = setting(
        25.0, before=0.0,  # (a frame per batch until d27a0b1)
        help="a rank reports its batches at most once per this many ms of training (0 = a frame per batch)",
        doc="a rank sends its batch reports (which positions it trained, its timing, its loss) at most "
        "once per this many ms of its training time, several batches to a frame; it sends at once when "
        "its plan runs out or is down to its last batch (the next plan then comes while it trains it), "
        "when throttled and before any other frame, so no decision waits on it. "
        "0 = a frame per batch. Batches slower than this are reported one by one, as before; fast "
        "batches on many ranks are what would otherwise swamp one coordinator. Must be below "
        "`heartbeat_interval_s`; many ranks stretch it (`batch_reports_per_s`)",
    )  # fmt: skip
    batch_reports_per_s: float = setting(
        2000.0, before=0.0,  # (no stretch until 9479eff)
        help="the batch-report frames a second the coordinator plans for, all ranks together: N ranks "
        "report at most once per max(batch_report_ms, 1000*N / this) ms, at most half the heartbeat "
        "interval (0 = no plan: batch_report_ms as set)",
        doc="the batch-report frames a second the coordinator plans for, all ranks together: with N ranks "
        "(`world_size`) each reports at most once per max(`batch_report_ms`, 1000·N / this) ms of training, "
        "and at most half of `heartbeat_interval_s` -- 25 ms up to 50 ranks, 128 ms at 256, 500 ms at "
        "1,024 (the run's `report_interval_ms`, in the `world_formed` line). A trade: at 1,024 paced "
        "ranks (100-400 ms batches) the ranks sent about 40 % fewer report frames, the coordinator spent "
        "7-20 % less CPU per batch and the ranks idled 0.6-2.3 points less (3 sittings); at 256 (10-40 ms "
        "batches) the coordinator spent 4-28 % less CPU per batch but the ranks idled 0.4-1.9 points "
        "more in 4 sittings of 5 (`bench/control_scale.py --peer-reports-per-s 0`). 0 = "
        "`batch_report_ms` as set; `batch_report_ms` 0 is always a frame per batch",
    )  # fmt: skip
    report_batches: int = setting(
        0,  # (off by default: its default is also what came before it, so no `before`)
        help="with a stretched report interval, a rank also reports once it holds this many batches and "
        "batch_report_ms of training (0 = no cap)",
        doc="with the report interval stretched (`batch_reports_per_s`), a rank also reports once it holds "
        "this many batches and at least `batch_report_ms` of training: a stretch spanning many batches "
        "leaves the coordinator planning on staler progress. Measured (`bench/control_scale.py`, 2 "
        "sittings each, 4 against 0): 256 paced ranks at 10-40 ms batches idled 1.0-1.2 points less for "
        "16-22 % more coordinator CPU per batch; 1,024 at 100-400 ms idled the same but their decision "
        "latency rose (p50 +13-20 ms); 8 at 256 changed nothing measurable. For many fast ranks; "
        "unstretched runs never cap. 0 = no cap",
    )  # fmt: skip
    reduce_stall_s: float = setting(
        300.0, help="an averaging round pending this long ends the run (ShutdownWithSave ReduceStall)",
        doc="an averaging round pending this long ends the run",
    )  # fmt: skip
    form_timeout_s: float = setting(
        300.0, aliases=("max_join_timeout_s",),
        help="the world must form (the quorum admitted) within this long, or the run fails naming who is "
        "missing; 0 = wait forever (alias max_join_timeout_s)",
        doc="the hard cap of the join window (alias `max_join_timeout_s`): the world must form (the quorum "
        "admitted) within this long of the service's first event, or "
        "the run fails (exit 1) naming each missing slot and why: its last refusal (`refused: world_size 4 "
        "differs ...`), how it was lost before the start, or `never said hello`; 0 = wait forever. Every "
        "refused hello is also logged with its reason when it happens. It fails sooner -- at once -- when a "
        "slot's process ended before the world formed, its agent does not start it again, and the world "
        "can no longer form without it (`the world can no longer form ...`, naming the rank, its exit and "
        "last line)",
    )  # fmt: skip
    model_signature: bytes = setting(
        b"",
        help="hex sha256 every rank's model must match (logged at world_formed); empty = the first "
        "admitted rank's",
        doc="hex sha256 every rank's model must present (module types, parameter and buffer names, shapes, "
        "dtypes; `flodl_worker.params.model_signature`, logged by the `world_formed` line). Unset: the "
        "first admitted rank's; a hello with another model or dataset length *before the world forms* is "
        "answered `deferred` (not refused: the rank keeps asking), a majority of deferred slots evicts the "
        "minority holding the slots, and a holder that vanishes releases the cohort — so one early foreign "
        "hello cannot lock the real ranks out. On an untrusted network, pin it",
    )  # fmt: skip
    final_eval: bool = setting(True, help="evaluate on the eval rank after the last average")
    # -- Cadence (ElChe) ---------------------------------------------------------------
    anchor: int = setting(
        4, help="cadence: initial batches of the slowest rank per window (faster ranks run proportionally "
        "more)",
        doc="cadence: initial batches of the slowest rank per window",
    )  # fmt: skip
    min_anchor: Optional[int] = setting(
        None, help="cadence: window-pressure growth floor; 0 = the initial anchor",
    )  # fmt: skip
    max_anchor: int = setting(
        1000, help="cadence: window-pressure growth ceiling (a staleness safety net; the overhead tune "
        "normally settles far below it)",
        doc="cadence: window-pressure growth ceiling",
    )  # fmt: skip
    overhead_target: float = setting(
        0.05, help="cadence: grow windows while a window's fixed cost -- the exposed reduce, the first "
        "batch's fill and the time the ranks waited for their next plan (the coordinator's and the "
        "network's turnaround, measured by the ranks) -- exceeds this share of a window",
    )  # fmt: skip
    max_batch_diff: Optional[int] = setting(
        None, help="cadence: cap on how far a rank's count moves per window, and the Throttle spread "
        "(a rank this many steps ahead of the slowest pauses); 0 = off",
    )  # fmt: skip
    guard: str = setting(
        "level", choices=GUARDS, help="cadence: convergence guard over replica divergence",
        doc="cadence: convergence guard over replica divergence: `level`, `growth`, `none`",
    )  # fmt: skip
    meta_controller: bool = setting(
        True, help="cadence: shrink windows on a learning-rate cliff or a run of guard vetoes",
    )  # fmt: skip
    # Before any measurement every rank gets the same count, so the fastest idles while the
    # slowest finishes it: a short probe window bounds that cost. Ours, not the reference's
    # (None: the anchor, as in the reference).
    probe_batches: Optional[int] = setting(
        1, help="cadence: batches per rank in the first, uncalibrated window; 0 = the anchor",
    )  # fmt: skip
    # Integer windows never end together (and the probe window not at all): a rank that
    # ran its window idles at the reduce barrier until the slowest ends its own. Ours; on
    # by default (issue 11: 0.954 vs 0.908 of the raw-solo sum on 1,1,2,3,5,8 in the
    # simulator). A round then folds up to two windows, so short epochs can aggregate at
    # one consensus: each still gets its own checkpoint (``_checkpointing``).
    run_ahead: bool = setting(
        True, help="cadence: a rank that ran its window while others still train theirs keeps training "
        "(at most one more window, or two of the slowest batch when longer) instead of idling at the reduce "
        "barrier, in chunks that outlast the wait and its last turnaround, sent before it runs dry; false: "
        "it waits there",
    )  # fmt: skip
    # -- checkpoints and failure policy (``_checkpointing``) ----------------------------
    checkpoint_every: int = setting(
        0, help="a consensus checkpoint every N aggregated epochs (0 = only when the run fails, if "
        "checkpoint_dir is set)",
        doc="a checkpoint every N epochs (0 = only when the run fails, if `checkpoint_dir` is set)",
    )  # fmt: skip
    # Whether the run's end by failure or operator stop asks the role rank to save (the
    # service: whether it has a checkpoint_dir). Not a setting.
    checkpoint_on_failure: bool = False
    max_failure: str = setting(
        "", help="end the run (ShutdownWithSave) once this many ranks are dead at once: N, or P% of "
        "world_size; empty = never",
        doc="end the run (ShutdownWithSave) once this many ranks are dead at once: `N` or `P%` of world_size. "
        "It counts ranks down now: a slot a restarted rank took again no longer counts",
    )  # fmt: skip
    # -- callback roles (``_roles``) ----------------------------------------------------
    epoch_callback_policy: str = setting(
        "fastest",
        help="who checkpoints and evaluates: fastest (the fastest alive rank by ElChe pace, re-elected on "
        "its death) or rank:N",
        doc="which rank checkpoints and evaluates: the fastest (re-elected on its death) or `rank:N`",
    )  # fmt: skip

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
        if not 0.0 <= self.batch_report_ms < self.heartbeat_interval_s * 1000.0:
            raise ValueError(
                f"batch_report_ms must be in [0, heartbeat_interval_s * 1000 = {self.heartbeat_interval_s * 1000:g}),"
                f" got {self.batch_report_ms:g}"
            )
        if self.report_batches < 0:
            raise ValueError(f"report_batches must be >= 0 (0: no cap), got {self.report_batches}")
        if not self.batch_reports_per_s >= 0:
            raise ValueError(f"batch_reports_per_s must be >= 0 (0: batch_report_ms as set), got {self.batch_reports_per_s}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if not self.form_timeout_s >= 0:
            raise ValueError(f"form_timeout_s must be >= 0 (0: no deadline), got {self.form_timeout_s}")
        if self.min_ranks is not None and not 1 <= self.min_ranks <= self.world_size:
            raise ValueError(f"min_ranks must be in [1, world_size={self.world_size}], got {self.min_ranks}")
        if not self.join_timeout_s >= 0:
            raise ValueError(f"join_timeout_s must be >= 0, got {self.join_timeout_s}")
        if self.elastic and self.form_timeout_s > 0 and self.join_timeout_s > self.form_timeout_s:
            raise ValueError(
                f"join_timeout_s ({self.join_timeout_s:g}) must not exceed the hard cap form_timeout_s "
                f"(max_join_timeout_s, {self.form_timeout_s:g}): raise the cap or shorten the window"
            )
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
    def report_interval_ms(self) -> float:
        """How often a rank reports its batches, at most (``RunSpec.batch_report_ms``): the
        setting, stretched so that all ``world_size`` ranks together send about
        ``batch_reports_per_s`` report frames a second, and never past half a heartbeat
        interval (reports stand in for heartbeats). A frame per batch (0) stays one."""
        ms = self.batch_report_ms
        if ms == 0.0 or self.batch_reports_per_s == 0.0:
            return ms
        stretched = min(1000.0 * self.world_size / self.batch_reports_per_s, self.heartbeat_interval_s * 500.0)
        return max(ms, stretched)

    @property
    def report_batches_cap(self) -> int:
        """``report_batches`` where the interval is stretched (``report_interval_ms`` above
        ``batch_report_ms``), else 0: an unstretched run reports as it always did."""
        return self.report_batches if self.report_interval_ms > self.batch_report_ms else 0

    @property
    def quorum(self) -> int:
        """The fewest ranks the world forms with (``min_ranks``, else the whole capacity)."""
        return self.min_ranks or self.world_size

    @property
    def elastic(self) -> bool:
        """The world may form (and run) with fewer ranks than its capacity."""
        return self.quorum < self.world_size

    @property
    def batch_diff_cap(self) -> Optional[int]:
        """``max_batch_diff`` with 0 meaning off, as None."""
        return self.max_batch_diff or None
