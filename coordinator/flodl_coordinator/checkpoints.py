"""Checkpoints on disk: atomic commits, verified loads, refusals with a reason.

Theory of operation
-------------------
A checkpoint is a directory ``<root>/ckpt-<version>/`` holding two files written by
two processes (``flodl.core._checkpoint`` explains what they mean):

* ``model.pt`` -- the role rank's ``torch.save({"model", "optimizer", ...})``;
* ``meta.json`` -- the coordinator's trajectory, plus ``model: {file, sha256, rank,
  bytes}``: the *commit marker*, written last;
* optional coordinator-side *sidecars* (``outer.npz``: the outer optimizer's anchor and
  momentum, ``flodl_coordinator.outer``), written atomically into the staging dir
  before ``meta.json``, which records each one's sha256 under ``sidecars``.

Commit protocol (nothing half-written is ever visible under a ``ckpt-*`` name):

1. For each ``Checkpoint`` command the shell hands the rank a fresh *staging*
   path, ``<root>/.staging/<name>-r<rank>-<token>/model.pt`` (``model_path``). The
   rank writes it atomically (temp file, fsync, ``os.replace``) and answers
   ``CheckpointResult{version, sha256}``.
2. The core's meta for that version arrives separately (``stage_meta``), before or
   after the result: the two are joined per version.
3. With both: the coordinator re-hashes ``model.pt`` *as it sees it* (so a
   checkpoint dir that is not shared storage, or a file torn in transit, fails here
   and not at resume), checks the rank's digest, writes ``meta.json`` atomically into
   the staging dir, fsyncs, then ``os.rename``\\ s the whole directory to
   ``<root>/<name>`` (atomic within one file system) and replaces ``<root>/latest``
   (a one-line file naming it) atomically.

Several epochs, one consensus: when two epochs aggregate at the same averaging version
(Cadence streams short epochs, ``run_ahead`` folds two windows in a round), the core asks
one save and stages one meta per epoch, each as of its epoch (``flodl.core._checkpoint``:
a later epoch the weights hold is recorded as covered). The first meta commits as
above; each other one commits its own directory ``ckpt-<version>-e<epoch>`` whose
``model.pt`` (and sidecars) are *hard links* to the first one's files: no byte is
written twice, and every directory stays whole on its own -- pruning, moving or
deleting one never breaks another, and ``load_checkpoint`` needs no indirection (a
meta naming another directory's tensors would). Where the file system refuses links the
files are copied and re-hashed.

``load_checkpoint(path)`` accepts a checkpoint directory, its ``meta.json`` or
``model.pt``, a ``latest`` file, or the root (it follows ``latest``). It refuses --
``CheckpointError`` with one line -- a missing commit marker, unreadable JSON, a
missing ``model.pt`` or sidecar, or a sha256 mismatch (torn). ``resolve_resume`` adds the run
checks of ``validate_meta`` (seed, world, dataset size, batch size, policy, epochs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional

from flodl import strictjson
from flodl.fsutil import atomic_write, describe_write_error, fsync_dir, no_space
from flodl.fsutil import sha256_file as _sha256_file
from flodl.core import CoreConfig
from flodl.core import ResumePoint, resume_plan, validate_meta

__all__ = [
    "META_FILE",
    "MODEL_FILE",
    "LATEST_FILE",
    "CheckpointError",
    "Checkpoint",
    "Committed",
    "Failed",
    "epoch_of",
    "CheckpointStore",
    "load_checkpoint",
    "resolve_resume",
    "sha256_file",
    "write_json_atomic",
    "write_text_atomic",
]

log = logging.getLogger("flodl.checkpoint")

META_FILE = "meta.json"
MODEL_FILE = "model.pt"
LATEST_FILE = "latest"
STAGING_DIR = ".staging"
# Results and metas waiting for their other half, per version. Only the newest few can
# still matter: an older one whose partner never came is forgotten, not leaked.
MAX_PENDING_VERSIONS = 8
_NAME = re.compile(r"^ckpt-(\d+)")


class CheckpointError(Exception):
    """A checkpoint cannot be used; ``str(e)`` is one line naming the reason."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A verified, complete checkpoint."""

    path: str  # the checkpoint directory
    meta: dict
    model_path: str


@dataclass(frozen=True, slots=True)
class Committed:
    version: int
    rank: int
    path: str
    epoch: Optional[int] = None  # the meta's last_aggregated_epoch: the epoch it is of


def epoch_of(meta: dict) -> Optional[int]:
    """The epoch a checkpoint meta is of (its ``last_aggregated_epoch``; None before any)."""
    e = meta.get("last_aggregated_epoch")
    return e if isinstance(e, int) and not isinstance(e, bool) else None


@dataclass(frozen=True, slots=True)
class Failed:
    version: int
    rank: int
    reason: str


# -- atomic files --------------------------------------------------------------------------




def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so readers see the old file or the new one, never half."""
    atomic_write(path, lambda fh: fh.write(text), binary=False)


def write_json_atomic(path: str, obj: Any) -> None:
    write_text_atomic(path, strictjson.dumps(obj, indent=1, sort_keys=True) + "\n")


def sha256_file(path: str) -> str:
    return _sha256_file(path).hexdigest()


# -- loading -------------------------------------------------------------------------------


def _resolve_dir(path: str) -> str:
    """The checkpoint directory ``path`` designates (follows ``latest``)."""
    p = os.path.abspath(path)
    if os.path.isfile(p):
        base = os.path.basename(p)
        if base in (META_FILE, MODEL_FILE):
            return os.path.dirname(p)
        if base == LATEST_FILE:
            return _follow_latest(os.path.dirname(p))
        raise CheckpointError(f"{path} is not a checkpoint (expected a directory, {META_FILE} or {LATEST_FILE})")
    if not os.path.isdir(p):
        raise CheckpointError(f"{path} does not exist")
    if not os.path.exists(os.path.join(p, META_FILE)) and os.path.isfile(os.path.join(p, LATEST_FILE)):
        return _follow_latest(p)
    return p


def _follow_latest(root: str) -> str:
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8") as fh:
            name = fh.read().strip()
    except OSError as e:
        raise CheckpointError(f"cannot read {os.path.join(root, LATEST_FILE)}: {e.strerror}") from None
    if not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{os.path.join(root, LATEST_FILE)} names {name!r}, not a checkpoint directory")
    return os.path.join(root, name)


def load_checkpoint(path: str) -> Checkpoint:
    """A complete, verified checkpoint at ``path``, or ``CheckpointError`` saying why not."""
    d = _resolve_dir(path)
    meta_path = os.path.join(d, META_FILE)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"torn checkpoint {d}: no {META_FILE} (the commit marker): the save never completed")
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"torn checkpoint {d}: {META_FILE} is unreadable ({e})") from None
    try:
        resume_plan(meta)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {d} is not usable: {e}") from None
    model = meta.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("sha256"), str):
        raise CheckpointError(f"torn checkpoint {d}: {META_FILE} records no model sha256")
    name = model.get("file", MODEL_FILE)
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise CheckpointError(f"checkpoint {d}: {META_FILE} names an invalid model file {name!r}")
    model_path = os.path.join(d, name)
    if not os.path.isfile(model_path):
        raise CheckpointError(f"torn checkpoint {d}: {name} is missing")
    got = sha256_file(model_path)
    if got != model["sha256"]:
        raise CheckpointError(
            f"torn checkpoint {d}: {name} sha256 {got[:16]}… differs from the recorded {model['sha256'][:16]}…"
        )
    _verify_sidecars(d, meta)
    return Checkpoint(path=d, meta=meta, model_path=model_path)


def _verify_sidecars(d: str, meta: dict) -> None:
    """Every sidecar ``meta.json`` lists (e.g. the outer optimizer's ``outer.npz``) is
    present and has the recorded sha256: a checkpoint is whole or refused."""
    sidecars = meta.get("sidecars", {})
    if not isinstance(sidecars, dict):
        raise CheckpointError(f"checkpoint {d}: {META_FILE} has a malformed sidecars record")
    for name, rec in sidecars.items():
        if not isinstance(name, str) or "/" in name or name.startswith(".") or not isinstance(rec, dict):
            raise CheckpointError(f"checkpoint {d}: {META_FILE} names an invalid sidecar {name!r}")
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"torn checkpoint {d}: {name} is missing")
        got = sha256_file(path)
        if got != rec.get("sha256"):
            raise CheckpointError(
                f"torn checkpoint {d}: {name} sha256 {got[:16]}… differs from the recorded {str(rec.get('sha256'))[:16]}…"
            )


def resolve_resume(
    path: str, config: CoreConfig, *, total_samples: Optional[int] = None
) -> tuple[Checkpoint, ResumePoint]:
    """Load ``path`` and check it against the run; ``CheckpointError`` on any defect."""
    ck = load_checkpoint(path)
    reasons = validate_meta(ck.meta, config, total_samples=total_samples)
    if reasons:
        raise CheckpointError(f"cannot resume from {ck.path}: " + "; ".join(reasons))
    return ck, resume_plan(ck.meta)


# -- the store: staging, joining, committing ------------------------------------------------


def _order(epoch: Optional[int]) -> int:
    """Metas of one version commit oldest epoch first (None: before any epoch)."""
    return -1 if epoch is None else epoch


def _link_or_copy(src: str, dst: str) -> None:
    """``dst`` holds ``src``'s bytes: a hard link (no byte written twice), else a copy
    whose sha256 must match (a file system without hard links)."""
    try:
        os.link(src, dst)
        return
    except OSError as e:
        if no_space(e):
            raise
    shutil.copyfile(src, dst)
    if sha256_file(src) != sha256_file(dst):
        raise CheckpointError(f"copy of {src} is torn")


@dataclass(slots=True)
class _Request:
    staging: str
    result: Optional[tuple[str, bytes]] = None  # ("ok"|error text, rank's sha256)


class CheckpointStore:
    """The coordinator's side of the commit protocol, for one checkpoint root."""

    def __init__(self, root: str, *, keep: int = 0) -> None:
        self.root = os.path.abspath(root)
        self.keep = keep  # keep the newest ``keep`` checkpoints; 0 = all
        self._requests: dict[tuple[int, int], _Request] = {}
        self._metas: dict[int, dict[Optional[int], dict]] = {}  # version -> epoch -> meta
        self._saved: dict[int, Committed] = {}  # version -> its first committed directory
        self._sidecars: dict[int, dict[str, Callable[[IO], None]]] = {}  # version -> name -> writer
        self.committed: list[Committed] = []
        self.failed: list[Failed] = []
        try:
            os.makedirs(os.path.join(self.root, STAGING_DIR), exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint_dir {root}: cannot create it ({e.strerror})") from None
        if not os.access(self.root, os.W_OK):
            raise CheckpointError(f"checkpoint_dir {root} is not writable")

    def model_path(self, version: int, rank: int) -> str:
        """A fresh staging path for rank ``rank``'s save of ``version`` (what the rank writes)."""
        old = self._requests.pop((version, rank), None)
        if old is not None:
            shutil.rmtree(old.staging, ignore_errors=True)
        staging = os.path.join(self.root, STAGING_DIR, f"ckpt-{version:08d}-r{rank}-{secrets.token_hex(4)}")
        os.makedirs(staging, exist_ok=True)
        self._requests[(version, rank)] = _Request(staging)
        self._bound()
        return os.path.join(staging, MODEL_FILE)

    def stage_meta(
        self, version: int, meta: dict, *, sidecars: Optional[dict[str, Callable[[IO], None]]] = None
    ) -> list[Committed | Failed]:
        """The core's meta for ``version``; commits at once if a rank already saved it
        (or, for a second epoch of one consensus, once its first checkpoint is committed).

        ``sidecars``: coordinator-side files of this checkpoint (name -> ``write(fh)``),
        written atomically into it before ``meta.json``, which records their sha256."""
        self._metas.setdefault(version, {})[epoch_of(meta)] = meta
        if sidecars or version not in self._sidecars:
            self._sidecars[version] = dict(sidecars or {})
        self._bound()
        return self._try_commit(version)

    def on_result(self, version: int, rank: int, *, error: Optional[str], sha256: bytes = b"") -> list:
        """A rank's ``CheckpointResult``; returns what it settled (Committed / Failed)."""
        req = self._requests.get((version, rank))
        if req is None:
            return [Failed(version, rank, "a CheckpointResult nobody asked for (ignored)")]
        if error is not None:
            del self._requests[(version, rank)]
            shutil.rmtree(req.staging, ignore_errors=True)
            return [self._fail(version, rank, f"rank {rank} could not save: {error}")]
        req.result = ("ok", bytes(sha256))
        return self._try_commit(version)

    def awaiting(self) -> bool:
        """True while a staged meta still waits for a rank's save (the shell lingers)."""
        return any(v in self._metas and r.result is None for (v, _), r in self._requests.items())

    def forget(self) -> None:
        """Drop every unfinished save (run over): their staging dirs go too."""
        for req in self._requests.values():
            shutil.rmtree(req.staging, ignore_errors=True)
        self._requests.clear()
        self._metas.clear()
        self._sidecars.clear()

    # -- internals ---------------------------------------------------------------------

    def _fail(self, version: int, rank: int, reason: str) -> Failed:
        f = Failed(version, rank, reason)
        self.failed.append(f)
        return f

    def _try_commit(self, version: int) -> list:
        metas = self._metas.get(version)
        if not metas:
            return []
        if not any(v == version for v, _ in self._requests):  # no save of it under way
            if version not in self._saved:
                self._find_saved(version)  # committed before a coordinator restart?
            if version in self._saved:  # the save is committed: the other epochs share it
                out = [self._commit_shared(version, metas.pop(e)) for e in sorted(metas, key=_order)]
                del self._metas[version]
                return out
            return []
        for (v, rank), req in list(self._requests.items()):
            if v == version and req.result is not None:
                first = min(metas, key=_order)
                out = self._commit(version, rank, req, metas[first])
                if isinstance(out, Committed):
                    del metas[first]  # the other epochs now share it
                return [out] + self._try_commit(version)  # (or another rank's save may still do)
        return []

    def _find_saved(self, version: int) -> None:
        """The committed checkpoint of ``version`` on disk, if there is one (a restarted
        coordinator forgot it): a later epoch of that consensus can still share it."""
        prefix = f"ckpt-{version:08d}"
        try:
            names = sorted(n for n in os.listdir(self.root) if n == prefix or n.startswith(prefix + "-"))
        except OSError:
            return
        for n in names:
            try:
                ck = load_checkpoint(os.path.join(self.root, n))
            except CheckpointError:
                continue
            if ck.meta.get("version") == version:
                rank = ck.meta["model"].get("rank", -1)
                self._saved[version] = Committed(version, rank if isinstance(rank, int) else -1, ck.path, epoch_of(ck.meta))
                return

    def _commit_shared(self, version: int, meta: dict) -> Committed | Failed:
        """Commit ``meta`` -- another epoch of an already committed consensus -- as its
        own directory whose files are hard links to that checkpoint's (see the module doc)."""
        first = self._saved[version]
        epoch = epoch_of(meta)
        staging = os.path.join(self.root, STAGING_DIR, f"ckpt-{version:08d}-e{epoch}-{secrets.token_hex(4)}")
        try:
            with open(os.path.join(first.path, META_FILE), encoding="utf-8") as fh:
                saved = json.load(fh)
            if saved.get("cycle") != meta.get("cycle"):  # other weights than the ones saved
                raise CheckpointError(f"it names cycle {meta.get('cycle')}, the save holds cycle {saved.get('cycle')}")
            os.makedirs(staging)
            names = [MODEL_FILE, *saved.get("sidecars", {})]
            for name in names:
                _link_or_copy(os.path.join(first.path, name), os.path.join(staging, name))
            full = dict(meta, model=saved["model"])
            if saved.get("sidecars"):
                full["sidecars"] = saved["sidecars"]
            write_json_atomic(os.path.join(staging, META_FILE), full)
            fsync_dir(staging)
            final = self._final_name(version, str(meta.get("reason", "checkpoint")), epoch=epoch)
            os.rename(staging, os.path.join(self.root, final))
            fsync_dir(self.root)
            write_text_atomic(os.path.join(self.root, LATEST_FILE), final + "\n")
        except (OSError, ValueError, KeyError, CheckpointError) as e:
            shutil.rmtree(staging, ignore_errors=True)
            why = describe_write_error(e, self.root, "checkpoint_dir") if isinstance(e, OSError) and no_space(e) else e
            return self._fail(version, first.rank, f"epoch {epoch}'s checkpoint sharing {first.path} failed: {why}")
        c = Committed(version, first.rank, os.path.join(self.root, final), epoch)
        self.committed.append(c)
        self._prune(final)
        return c

    def _commit(self, version: int, rank: int, req: _Request, meta: dict) -> Committed | Failed:
        del self._requests[(version, rank)]
        model = os.path.join(req.staging, MODEL_FILE)
        try:
            if not os.path.isfile(model):
                raise CheckpointError(
                    f"{model} (written by rank {rank}) is not visible to the coordinator: "
                    "checkpoint_dir must be on storage shared by every host"
                )
            digest = sha256_file(model)
            reported = req.result[1].hex() if req.result else ""
            if reported and reported != digest:
                raise CheckpointError(
                    f"{model} is torn: sha256 {digest[:16]}… but rank {rank} wrote {reported[:16]}…"
                )
            size = os.path.getsize(model)
            full = dict(meta, model={"file": MODEL_FILE, "sha256": digest, "rank": rank, "bytes": size})
            written = {}
            for name, write in self._sidecars.get(version, {}).items():  # before the commit marker
                path = os.path.join(req.staging, name)
                atomic_write(path, write)
                written[name] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
            if written:
                full["sidecars"] = written
            write_json_atomic(os.path.join(req.staging, META_FILE), full)
            fsync_dir(req.staging)
            final = self._final_name(version, str(meta.get("reason", "checkpoint")))
            os.rename(req.staging, os.path.join(self.root, final))
            fsync_dir(self.root)
            write_text_atomic(os.path.join(self.root, LATEST_FILE), final + "\n")
        except (OSError, CheckpointError) as e:
            shutil.rmtree(req.staging, ignore_errors=True)
            if isinstance(e, CheckpointError):
                why = str(e)
            elif no_space(e):
                why = f"commit failed: {describe_write_error(e, self.root, 'checkpoint_dir')}"
            else:
                why = f"commit failed: {e}"
            return self._fail(version, rank, why)
        for key in [k for k in self._requests if k[0] == version]:  # superseded saves
            shutil.rmtree(self._requests.pop(key).staging, ignore_errors=True)
        c = Committed(version, rank, os.path.join(self.root, final), epoch_of(meta))
        self.committed.append(c)
        self._saved[version] = c
        self._prune(final)
        return c

    def _final_name(self, version: int, reason: str, epoch: Optional[int] = None) -> str:
        base = f"ckpt-{version:08d}" + ("" if reason == "checkpoint" else f"-{reason}")
        base += "" if epoch is None else f"-e{epoch}"
        name, n = base, 1
        while os.path.exists(os.path.join(self.root, name)):
            n += 1
            name = f"{base}.{n}"
        return name

    def _prune(self, newest: str) -> None:
        if self.keep <= 0:
            return
        names = sorted(
            (n for n in os.listdir(self.root) if _NAME.match(n) and os.path.isdir(os.path.join(self.root, n))),
            key=lambda n: (int(_NAME.match(n).group(1)), os.path.getmtime(os.path.join(self.root, n))),
        )
        for n in names[: max(0, len(names) - self.keep)]:
            if n != newest:
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)

    def _bound(self) -> None:
        versions = sorted({v for v, _ in self._requests} | set(self._metas) | set(self._saved))
        for old in versions[:-MAX_PENDING_VERSIONS]:
            self._metas.pop(old, None)
            self._sidecars.pop(old, None)
            self._saved.pop(old, None)
            for key in [k for k in self._requests if k[0] == old]:
                shutil.rmtree(self._requests.pop(key).staging, ignore_errors=True)
