"""Checkpoint meta: what the coordinator must remember to resume a run exactly.

Theory of operation
-------------------
A checkpoint has two halves written by two processes (ARCHITECTURE §6, reference
wire-and-worker §7): the *role rank* saves model + optimizer state (``model.pt``) right
after it applied a consensus, and the *coordinator* writes ``meta.json`` -- the
trajectory below. This module is the pure half of the coordinator's part: it reads
the state and returns plain JSON-safe values; it writes nothing, reads no clock and
never imports torch. The service shell (``flodl_coordinator.checkpoints``) does the
I/O: atomic files, sha256 of ``model.pt``, refusing torn or foreign checkpoints.

* ``checkpoint_meta(state, version)`` -- the meta of a checkpoint taken at averaging
  version ``version``. Coverage is recorded as *covered* ranges: the committed
  positions (ARCHITECTURE §6: folded into the consensus) of every epoch that is
  dispatched but not yet aggregated. Epochs up to ``last_aggregated_epoch`` are done
  by definition; later ones have not started. Why covered == "in the weights":

  - taken at a finished round, with the role rank saving that round's consensus
    (``Checkpoint.cycle``), the committed positions are exactly the batches the
    consensus folded in;
  - taken at ``ShutdownWithSave`` (``cycle = 0``: the weights the rank holds), every
    committed batch was folded by a consensus that reached the role rank *before*
    the save command did (one ROUTER, one DEALER: FIFO), so covered ⊆ weights; the
    rank's own unfolded steps are in the weights too but not covered, and are
    trained again after resume (a bounded, honest re-train, never a lost sample).

* ``validate_meta(meta, config)`` -- every reason this run cannot resume from
  ``meta``, named (empty list = fine). The shuffle is ``f(seed, epoch)``, so a seed,
  dataset size or world mismatch would silently train other samples (or misapply
  per-rank ElChe state): refused, never "best effort".
* ``resume_plan(meta)`` -- a ``ResumePoint``: the epoch to re-enter, the uncovered
  ranges of every partly done epoch (the complement of covered within
  ``[0, expected)``), counters, history and the opaque ``policy_state``.

Coverage ranges are ``[offset, size]`` pairs of permutation *positions*, sorted and
disjoint, ``size > 0``. ``policy_state`` is opaque here: whatever JSON-safe dict the
policy engine wants back (by default ElChe's ``to_state`` plus the guard's trend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ._config import CoreConfig
from ._errors import LocalViolation
from . import _coverage
from ._state import CoordinatorState

__all__ = [
    "SCHEMA_VERSION",
    "SAVE_REASONS",
    "ResumePoint",
    "checkpoint_meta",
    "validate_meta",
    "resume_plan",
    "covered_ranges",
    "complement",
    "default_policy_state",
]

# Bump when a reader of the old layout would misread the new one. Readers refuse a
# *newer* schema (they cannot know what they would ignore) and accept older ones they
# know how to read.
SCHEMA_VERSION = 1

# The original's save_reason vocabulary (wire SaveReason, lower-cased, prefix dropped).
SAVE_REASONS = (
    "graceful_shutdown",
    "max_failure_exceeded",
    "single_survivor",
    "all_ranks_lost",
    "reduce_stall",
    "checkpoint",
)

Range = tuple[int, int]


# -- ranges ------------------------------------------------------------------------------


def covered_ranges(bitmap: bytes | bytearray) -> list[Range]:
    """``[(offset, size)]`` of the runs of 1-bytes in a committed bitmap, in order."""
    out: list[Range] = []
    pos, end = 0, len(bitmap)
    while pos < end:
        start = bitmap.find(1, pos)
        if start < 0:
            break
        stop = bitmap.find(0, start)
        stop = end if stop < 0 else stop
        out.append((start, stop - start))
        pos = stop
    return out


def complement(ranges: Sequence[Sequence[int]], total: int) -> list[Range]:
    """The ranges of ``[0, total)`` not in ``ranges`` (sorted, disjoint, in bounds)."""
    out: list[Range] = []
    cursor = 0
    for off, size in ranges:
        if off > cursor:
            out.append((cursor, off - cursor))
        cursor = max(cursor, off + size)
    if cursor < total:
        out.append((cursor, total - cursor))
    return out


def _range_errors(ranges: Any, total: int) -> Optional[str]:
    """Why ``ranges`` is not a sorted, disjoint, in-bounds list of positive ranges."""
    if not isinstance(ranges, list):
        return "covered is not a list"
    cursor = 0
    for item in ranges:
        if (
            not isinstance(item, (list, tuple))
            or len(item) != 2
            or not all(_is_int(x) for x in item)
        ):
            return f"range {item!r} is not [offset, size]"
        off, size = item
        if size <= 0 or off < cursor or off + size > total:
            return f"range [{off}, {size}] overlaps, is unsorted, empty or outside [0, {total})"
        cursor = off + size
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- writing -----------------------------------------------------------------------------


def default_policy_state(state: CoordinatorState) -> dict[str, Any]:
    """ElChe's trajectory and the guard's trend under Cadence; ``{}`` under Sync."""
    cad = state.cadence
    if cad is None:
        return {}
    trend = cad.guard.trend_history() if cad.guard is not None else None
    return {"elche": cad.elche.to_state(trend)}


def _check_json_safe(x: Any, where: str = "policy_state") -> None:
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_json_safe(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                raise LocalViolation(f"{where}: key {k!r} is not a string")
            _check_json_safe(v, f"{where}.{k}")
        return
    raise LocalViolation(f"{where}: {type(x).__name__} is not JSON-safe")


def checkpoint_meta(
    state: CoordinatorState,
    version: int,
    *,
    reason: str = "checkpoint",
    cycle: Optional[int] = None,
    policy_state: Optional[Mapping[str, Any]] = None,
    through: Optional[int] = None,
) -> dict[str, Any]:
    """The JSON-safe meta of a checkpoint at averaging ``version`` (reads, never writes).

    ``cycle`` is the consensus cycle whose weights the rank saves (default: the last
    round's); ``policy_state`` defaults to ``default_policy_state(state)``. Call it at
    the step where the save is decided, so the coverage is the one of that instant.

    ``through``: the epoch this checkpoint is *of* (default: the last aggregated). An
    epoch aggregated after it at the same consensus is recorded as wholly covered
    (the weights hold all of it), so a resume re-enters at ``through + 1`` and skips
    exactly what the weights hold.
    """
    if reason not in SAVE_REASONS:
        raise LocalViolation(f"checkpoint reason {reason!r} is not one of {SAVE_REASONS}")
    ps = dict(default_policy_state(state) if policy_state is None else policy_state)
    _check_json_safe(ps)
    cfg = state.config
    last = state.metrics.last_aggregated if through is None else through
    epochs = []
    for e in sorted(state.coverage.epochs):
        ec = state.coverage.epochs[e]
        if last is not None and e <= last:
            continue
        # Frozen past ``through``: aggregated after it at this consensus, all of it held.
        covered = ([[0, ec.expected]] if ec.expected else []) if ec.frozen else [[o, s] for o, s in covered_ranges(ec.committed)]
        epochs.append({"epoch": e, "expected": ec.expected, "covered": covered, "discarded": ec.discarded})
    cad = state.cadence
    done = [e for e in sorted(state.coverage.epochs) if last is not None and e <= last]
    rows = [dict(row) for row in state.metrics.history if last is not None and row.get("epoch", 0) <= last]
    return {
        "schema_version": SCHEMA_VERSION,
        "reason": reason,
        "version": int(version),
        "cycle": int(state.rounds.cycle if cycle is None else cycle),
        "global_step": state.rounds.global_step,
        "averages": state.rounds.version,
        "averages_per_epoch": {str(e): n for e, n in sorted(cad.averages.items())} if cad else {},
        "run": {
            "seed": cfg.seed,
            "world_size": cfg.world_size,
            "total_samples": state.total_samples,
            "batch_size": cfg.batch_size,
            "num_epochs": cfg.num_epochs,
            "policy": cfg.policy,
        },
        "epoch": 0 if last is None else last + 1,
        "last_aggregated_epoch": last,
        "alive_ranks": state.alive_ranks(),
        "coverage": {"epochs": epochs},
        "history": {
            "coverage": [_summary_row(state, e) for e in done],
            "epochs": rows,
        },
        "policy_state": ps,
    }


def _summary_row(state: CoordinatorState, epoch: int) -> dict[str, int]:
    return _coverage.epoch_summary(state.coverage.epochs[epoch])


# -- reading -----------------------------------------------------------------------------

_RUN_INTS = ("seed", "world_size", "total_samples", "batch_size", "num_epochs")
_TOP_INTS = ("version", "cycle", "global_step", "averages", "epoch")


def _structure_errors(meta: Any) -> list[str]:
    """Reasons ``meta`` is not a readable checkpoint meta of a schema we know."""
    if not isinstance(meta, dict):
        return ["meta is not a JSON object"]
    sv = meta.get("schema_version")
    if not _is_int(sv):
        return ["meta has no integer schema_version"]
    if sv > SCHEMA_VERSION:
        return [f"meta schema_version {sv} is newer than this flodl reads ({SCHEMA_VERSION}): upgrade flodl"]
    if sv < 1:
        return [f"meta schema_version {sv} is not supported"]
    errs = [f"meta field {k!r} is missing or not an integer" for k in _TOP_INTS if not _is_int(meta.get(k))]
    run = meta.get("run")
    if not isinstance(run, dict):
        errs.append("meta field 'run' is missing")
        run = {}
    errs += [f"meta field 'run.{k}' is missing or not an integer" for k in _RUN_INTS if not _is_int(run.get(k))]
    if not isinstance(run.get("policy"), str):
        errs.append("meta field 'run.policy' is missing")
    last = meta.get("last_aggregated_epoch")
    if last is not None and not _is_int(last):
        errs.append("meta field 'last_aggregated_epoch' is not an integer or null")
    if not isinstance(meta.get("policy_state", {}), dict):
        errs.append("meta field 'policy_state' is not an object")
    cov = meta.get("coverage")
    if not isinstance(cov, dict) or not isinstance(cov.get("epochs"), list):
        return errs + ["meta field 'coverage.epochs' is missing"]
    seen: set[int] = set()
    for ent in cov["epochs"]:
        if not isinstance(ent, dict) or not _is_int(ent.get("epoch")) or not _is_int(ent.get("expected")):
            errs.append(f"coverage entry {ent!r} has no integer epoch/expected")
            continue
        e = ent["epoch"]
        if e in seen:
            errs.append(f"coverage of epoch {e} appears twice")
        seen.add(e)
        why = _range_errors(ent.get("covered"), ent["expected"])
        if why:
            errs.append(f"coverage of epoch {e} is malformed: {why}")
        if _is_int(meta.get("epoch")) and e < meta["epoch"]:
            errs.append(f"coverage of epoch {e} is before the resume epoch {meta['epoch']}")
    return errs


def validate_meta(meta: Any, config: CoreConfig, *, total_samples: Optional[int] = None) -> list[str]:
    """Every reason a run with ``config`` cannot resume from ``meta`` ([] = it can).

    ``total_samples`` is the epoch size when the config leaves it 0 (the cohort's
    dataset length); with neither, the size is checked later, at admission.
    """
    errs = _structure_errors(meta)
    if errs:
        return errs
    run = meta["run"]
    mine = {
        "seed": config.seed,
        "world_size": config.world_size,
        "batch_size": config.batch_size,
        "policy": config.policy,
    }
    size = config.total_samples or total_samples
    if size:
        mine["total_samples"] = size
    why = {
        "seed": "the shuffle is f(seed, epoch): another seed trains other samples",
        "world_size": "per-rank scheduler state would not fit",
        "batch_size": "global_step and the window plan count batches of the saved size",
        "policy": "the saved policy_state belongs to another policy",
        "total_samples": "coverage positions index the saved epoch size",
    }
    for key, value in mine.items():
        if run[key] != value:
            errs.append(f"{key} {run[key]!r} in the checkpoint differs from this run's {value!r} ({why[key]})")
    if meta["epoch"] >= config.num_epochs:
        errs.append(
            f"the checkpoint resumes at epoch {meta['epoch']} but this run has only "
            f"{config.num_epochs} epochs: nothing left to train (raise --epochs)"
        )
    return errs


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    """Where a resumed run picks up (read-only values from a validated meta).

    ``holes`` maps each partly done epoch to its uncovered ranges; ``expected`` to its
    size. An epoch past those (and past ``last_aggregated_epoch``) is untouched: all of
    ``[0, total_samples)`` is left.
    """

    epoch: int
    last_aggregated_epoch: Optional[int]
    seed: int
    total_samples: int
    version: int
    cycle: int
    global_step: int
    averages_per_epoch: tuple[tuple[int, int], ...] = ()
    holes: tuple[tuple[int, tuple[Range, ...]], ...] = ()
    covered: tuple[tuple[int, tuple[Range, ...]], ...] = ()
    expected: tuple[tuple[int, int], ...] = ()
    policy_state: Any = field(default_factory=dict)
    history: Any = field(default_factory=dict)
    reason: str = "checkpoint"

    def uncovered(self, epoch: int) -> tuple[Range, ...]:
        """Positions of ``epoch`` still to train after the resume."""
        if self.last_aggregated_epoch is not None and epoch <= self.last_aggregated_epoch:
            return ()
        for e, ranges in self.holes:
            if e == epoch:
                return ranges
        return ((0, self.total_samples),) if self.total_samples > 0 else ()

    def covered_in(self, epoch: int) -> tuple[Range, ...]:
        """Positions of a partly done ``epoch`` already committed before the save."""
        for e, ranges in self.covered:
            if e == epoch:
                return ranges
        return ()

    def remaining(self, epoch: int) -> int:
        return sum(size for _, size in self.uncovered(epoch))


def resume_plan(meta: Mapping[str, Any]) -> ResumePoint:
    """The ``ResumePoint`` of a meta (raises ValueError naming the defects if unreadable).

    Uncovered = the complement of covered within ``[0, expected)``, per recorded epoch.
    """
    errs = _structure_errors(meta)
    if errs:
        raise ValueError("; ".join(errs))
    holes, covered, expected = [], [], []
    for ent in sorted(meta["coverage"]["epochs"], key=lambda x: x["epoch"]):
        e, n = ent["epoch"], ent["expected"]
        cov = tuple((int(o), int(s)) for o, s in ent["covered"])
        holes.append((e, tuple(complement(cov, n))))
        covered.append((e, cov))
        expected.append((e, n))
    ape = meta.get("averages_per_epoch") or {}
    return ResumePoint(
        epoch=meta["epoch"],
        last_aggregated_epoch=meta.get("last_aggregated_epoch"),
        seed=meta["run"]["seed"],
        total_samples=meta["run"]["total_samples"],
        version=meta["version"],
        cycle=meta["cycle"],
        global_step=meta["global_step"],
        averages_per_epoch=tuple(sorted((int(k), int(v)) for k, v in ape.items())),
        holes=tuple(holes),
        covered=tuple(covered),
        expected=tuple(expected),
        policy_state=meta.get("policy_state") or {},
        history=meta.get("history") or {},
        reason=str(meta.get("reason", "checkpoint")),
    )
