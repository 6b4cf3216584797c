"""The service's checkpoint glue: where the core's decisions meet the file system.

Theory of operation
-------------------
The core decides *when* to checkpoint and *who* saves (a ``Checkpoint{version,
target_rank, cycle}`` command) and *what* the coordinator remembers (a
``StageCheckpoint(version, meta)`` built by
``flodl.core.checkpoint_meta``). Paths are not the core's business: this
shell stamps them onto the outgoing frames.

* ``stamp(control)``: a ``Checkpoint`` gets ``path`` = a fresh staging path from the
  ``CheckpointStore`` (``checkpoints``). Other commands pass through untouched.
* ``stamp_ack(ack)``: on a resumed run, an accepted ``hello_ack`` carries
  ``RunSpec.resume_from`` = the verified ``model.pt``; the rank loads it after
  building its model and optimizer.
* ``stage`` consumes the core's ``StageCheckpoint``; ``on_result`` a rank's
  ``CheckpointResult``. The store joins the two per version and commits atomically.
* ``outer``: the bus outer optimizer (``outer``). ``stage`` hands the store its state
  right after the checkpoint's cycle as the ``outer.npz`` sidecar (written before
  ``meta.json``, sha256 in it); a resume restores it, and refuses a torn or foreign one.
* ``lingering(now)``: a ``ShutdownWithSave`` ends the core's run in the same step that
  asks the role rank to save, so the service keeps its loop alive -- at most
  ``liveness_timeout_s`` -- until the save is answered and committed.
* ``missing(state)``: nothing is lost quietly. Every version whose meta the core
  decided (``asked``) must end committed; one that does not -- every rank refused or
  failed it (``checkpoint_abandoned``, also kept in the core's replayed
  ``checkpoints.abandoned``), its save was never answered, its commit failed (a full
  disk) -- or a save the core deferred to a round that never finished, is *missing*,
  with the last reason seen. The run summary (``checkpoints.missing``), ``/status`` and
  the exit code report it: the run is not ok (``service``).

Resume is resolved at construction: a bad ``--resume`` (torn, foreign, newer schema,
other seed / world / batch / dataset size / policy, nothing left to train) raises
``SettingsError`` with one line before any socket is bound. A resumed run whose
``total_samples`` was left 0 is pinned to the checkpoint's, so a rank with another
dataset size is refused at hello by the core's own rule.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Optional

from flodl.core import CHECKPOINT_META, Notice, StageCheckpoint
from flodl.fsutil import describe_write_error
from flodl.wire import pb

from .checkpoints import Checkpoint, CheckpointError, CheckpointStore, Committed, epoch_of, resolve_resume
from .outer import OuterError, OuterOptimizer, load_state, save_state
from .settings import Settings, SettingsError

__all__ = ["Checkpointing", "META_NOTICE", "OUTER_FILE"]

log = logging.getLogger("flodl.checkpoint")

META_NOTICE = CHECKPOINT_META  # the kind of the core's StageCheckpoint (a Notice, for the log)
OUTER_FILE = "outer.npz"  # the outer optimizer's state, a sidecar of the checkpoint


class Checkpointing:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: Optional[CheckpointStore] = None
        self.resumed: Optional[Checkpoint] = None
        self.point = None  # flodl.core.ResumePoint of a resumed run
        self._linger_until: Optional[float] = None
        # (version, epoch) of every meta the core decided: each must commit. Two epochs
        # aggregated at one consensus are two checkpoints of one save.
        self.asked: set[tuple[int, Optional[int]]] = set()
        self._why: dict[int, str] = {}  # version -> the last reason it did not commit
        # The bus reducer's outer optimizer lives here: its state is saved with every
        # checkpoint (``outer.npz``) and restored on resume, before the reducer exists.
        self.outer = OuterOptimizer(
            getattr(settings, "outer_optimizer", "none"),
            lr=getattr(settings, "outer_lr", 1.0),
            momentum=getattr(settings, "outer_momentum", 0.0),
        )
        if settings.checkpoint_dir:
            try:
                self.store = CheckpointStore(settings.checkpoint_dir, keep=settings.checkpoint_keep)
            except CheckpointError as e:
                raise SettingsError(f"config error: {e}") from None
        if settings.resume:
            try:
                self.resumed, self.point = resolve_resume(settings.resume, settings.core_config())
            except CheckpointError as e:
                raise SettingsError(f"resume refused: {e}") from None
            log.info(
                "resuming from %s: epoch %d, %d samples of it left, global step %d",
                self.resumed.path, self.point.epoch, self.point.remaining(self.point.epoch), self.point.global_step,
            )
            self._resume_outer(self.resumed)

    def _resume_outer(self, ck: Checkpoint) -> None:
        """Restore the outer optimizer's state (``outer.npz``, sha256-checked on load)."""
        if not self.outer.enabled:
            return
        if OUTER_FILE not in ck.meta.get("sidecars", {}):
            log.warning("%s holds no %s: the %s outer optimizer starts afresh (anchor = the first consensus)",
                        ck.path, OUTER_FILE, self.outer.kind)
            return
        try:
            self.outer.restore(load_state(os.path.join(ck.path, OUTER_FILE)))
        except OuterError as e:
            raise SettingsError(f"resume refused: {e}") from None

    def pinned(self, settings: Settings) -> Settings:
        """``settings`` with the epoch size fixed to the checkpoint's on a resumed run."""
        if self.point is not None and settings.total_samples == 0:
            return replace(settings, total_samples=self.point.total_samples)
        return settings

    # -- outbound stamping ---------------------------------------------------------------

    STAMPS = "checkpoint"  # the only kind of Control ``stamp`` may change

    def stamp(self, rank: int, control: pb.Control) -> pb.Control:
        if control.WhichOneof("cmd") != self.STAMPS or self.store is None:
            return control
        out = pb.Control()
        out.CopyFrom(control)
        try:
            out.checkpoint.path = self.store.model_path(control.checkpoint.version, rank)
        except OSError as e:  # the rank will answer "no path" and the core fails over
            why = describe_write_error(e, self.store.root, "checkpoint_dir")
            self._why[control.checkpoint.version] = f"cannot stage a directory for rank {rank}: {why}"
            log.error("checkpoint v%d: cannot stage a directory for rank %d: %s", control.checkpoint.version, rank, why)
        return out

    def stamp_ack(self, ack: pb.HelloAck) -> pb.HelloAck:
        if self.resumed is None or not ack.accepted:
            return ack
        out = pb.HelloAck()
        out.CopyFrom(ack)
        out.run.resume_from = self.resumed.model_path
        return out

    # -- inbound -------------------------------------------------------------------------

    def stage(self, cmd: StageCheckpoint) -> None:
        """The core decided checkpoint ``cmd.version`` (its ``Checkpoint`` to the saving
        rank goes out with it): stage the meta, and the outer state as a sidecar."""
        version = cmd.version
        if self.store is None:
            log.warning("checkpoint v%d decided but no checkpoint_dir is set: ignored", version)
            return
        meta = cmd.meta
        self.asked.add((version, epoch_of(meta)))
        self._report(self.store.stage_meta(version, meta, sidecars=self._outer_sidecar(version, meta)))

    def on_notice(self, cmd: Notice) -> bool:
        """True if ``cmd`` was the core's checkpoint order, staged here: a
        ``StageCheckpoint``, or a plain ``Notice`` of its kind (as a caller replaying
        logged records hands it over)."""
        if not isinstance(cmd, StageCheckpoint):
            if cmd.kind != META_NOTICE:
                return False
            cmd = StageCheckpoint.of(cmd.data["version"], cmd.data["meta"])
        self.stage(cmd)
        return True

    def _outer_sidecar(self, version: int, meta: dict) -> dict:
        """``outer.npz`` of the state right after the checkpoint's cycle (0: the latest)."""
        if not self.outer.enabled:
            return {}
        state = self.outer.state_at(int(meta.get("cycle", 0)))
        if state is None:
            if self.outer.latest is not None:
                log.warning("checkpoint v%d: the outer state of cycle %s is gone; saved without it",
                            version, meta.get("cycle"))
            return {}
        return {OUTER_FILE: lambda fh: save_state(state, fh)}

    def on_result(self, rank: int, res: pb.Timing.CheckpointResult) -> None:
        if self.store is None:
            return
        error = res.error if res.HasField("error") else None
        self._report(self.store.on_result(res.version, rank, error=error, sha256=res.sha256))

    def _report(self, outcomes: list) -> None:
        for o in outcomes:
            if isinstance(o, Committed):
                log.info("checkpoint v%d (epoch %s) committed: %s (model saved by rank %d)",
                         o.version, o.epoch, o.path, o.rank)
            else:
                self._why[o.version] = o.reason
                log.warning("checkpoint v%d not saved by rank %d: %s", o.version, o.rank, o.reason)

    def on_abandoned(self, cmd: Notice) -> None:
        """The core's ``checkpoint_abandoned``: no rank left to ask for this version."""
        version = int(cmd.data.get("version", -1))
        self._why[version] = f"abandoned after ranks {cmd.data.get('tried')} (last: {cmd.data.get('detail')})"
        log.error("checkpoint v%d cannot be made: %s", version, self._why[version])

    # -- end of run ----------------------------------------------------------------------

    def lingering(self, now: float) -> bool:
        """Keep the loop alive (bounded) while a decided save still waits for its rank."""
        if self.store is None or not self.store.awaiting():
            return False
        if self._linger_until is None:
            self._linger_until = now + self.settings.liveness_timeout_s
            log.info("waiting up to %gs for the role rank's checkpoint save", self.settings.liveness_timeout_s)
        if now < self._linger_until:
            return True
        log.warning("checkpoint save not answered within %gs: abandoned", self.settings.liveness_timeout_s)
        for v, _ in self.asked:
            self._why.setdefault(v, f"the save was not answered within {self.settings.liveness_timeout_s:g}s")
        self.store.forget()
        return False

    def missing(self, state=None) -> list[dict[str, Any]]:
        """Every asked checkpoint that was not committed, with why (empty = all made)."""
        if self.store is None:
            return []
        done = {(c.version, c.epoch) for c in self.store.committed}
        ck = getattr(state, "checkpoints", None)
        abandoned = set(getattr(ck, "abandoned", ()) or ())
        keys = self.asked | {(v, None) for v in abandoned if not any(a == v for a, _ in self.asked)}
        out = []
        for v, e in sorted(keys - done, key=lambda k: (k[0], -1 if k[1] is None else k[1])):
            why = self._why.get(v) or ("abandoned: no rank could save it" if v in abandoned else "never answered")
            out.append({"version": v, "epoch": e, "reason": why})
        if ck is not None and getattr(ck, "deferred", None) is not None:
            cycle = state.rounds.cycle
            epochs = list(getattr(ck, "deferred_epochs", ()) or ())
            out.append({"version": None, "epoch": epochs[0] if epochs else None,
                        "reason": f"a checkpoint of epoch(s) {epochs} was due while round {cycle} was open, "
                                  f"and that round never finished"})
        return out

    def missing_reason(self, missing: list[dict[str, Any]]) -> str:
        names = ", ".join(_name(m) for m in missing)
        first = missing[0]["reason"]
        return f"{len(missing)} asked checkpoint(s) not committed ({names}): {first}"

    def summary(self, state=None) -> dict[str, Any]:
        s = self.store
        return {
            "dir": s.root if s else None,
            "asked": [{"version": v, "epoch": e} for v, e in _sorted(self.asked)],
            "committed": [
                {"version": c.version, "epoch": c.epoch, "rank": c.rank, "path": c.path} for c in (s.committed if s else [])
            ],
            "epochs": sorted({c.epoch for c in (s.committed if s else []) if c.epoch is not None}),
            "failed": [{"version": f.version, "rank": f.rank, "reason": f.reason} for f in (s.failed if s else [])],
            "missing": self.missing(state),  # asked, never committed: the run is not ok
            "resumed_from": self.resumed.path if self.resumed else None,
        }

    def status(self, state=None) -> dict[str, Any]:
        """The ``/status`` view: counts and what is missing so far (pending saves are not)."""
        s = self.store
        pending = set(getattr(getattr(state, "checkpoints", None), "pending", {}) or {})
        missing = [m for m in self.missing(state) if m["version"] not in pending and m["version"] is not None]
        return {
            "asked": len(self.asked),
            "committed": len(s.committed) if s else 0,
            "epochs": sorted({c.epoch for c in (s.committed if s else []) if c.epoch is not None}),
            "latest": s.committed[-1].path if s and s.committed else None,
            "missing": missing,
        }


def _sorted(keys) -> list[tuple[int, Optional[int]]]:
    return sorted(keys, key=lambda k: (k[0], -1 if k[1] is None else k[1]))


def _name(m: dict[str, Any]) -> str:
    if m["version"] is None:
        return "one deferred"
    return f"v{m['version']}" + ("" if m.get("epoch") is None else f" (epoch {m['epoch']})")
