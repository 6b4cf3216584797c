"""The run's output model: where it goes, who writes it, what the summary says of it.

Theory of operation
-------------------
At the end of every successful run the consensus model is written as a plain torch
``state_dict`` (``model.pt``) plus a metadata file (``model.json``) in the output
directory: setting ``output``, else the directory of ``summary``, else nowhere (the
summary says so).

*Who writes it*: the rank that runs the final eval. After the final averaging round it
holds the last consensus (on the bus and on the collective plane alike; under Async with
``easgd_alpha`` < 1, its elastic blend with it, which is what it evaluates), it knows the
parameter and buffer names a ``state_dict`` needs (the coordinator only ever sees flat
tensors, and on the collective plane none at all), and the file is then exactly the
model the summary's ``accuracy`` measured. So this shell stamps
``ExecuteEval.save_model_path`` onto the final eval (paths are not the core's business,
as for checkpoints); the rank answers with the file's sha256 (or why it could not write
it) in its ``EvalResult``. A retried final eval (the first target failed or died) is
stamped again: the last answer counts, as it does for the accuracy.

*What the coordinator adds*: ``model.json`` -- run, epochs, accuracy, coverage, policy,
world, the writer and the sha256 -- built from the summary, and the summary's ``model``
block naming both files. When the model file is visible here its sha256 is checked
(a rank on another host without shared storage writes it on its own disk: the block
says so). A successful run whose model was not written is not ok: the reason names why.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from flodl import strictjson
from flodl.fsutil import atomic_write, describe_write_error, sha256_file
from flodl.wire import pb

from .settings import Settings, SettingsError

__all__ = ["ModelOutput", "MODEL_FILE", "META_FILE", "output_dir"]

log = logging.getLogger("flodl.coordinator")

MODEL_FILE = "model.pt"  # the names flodl_worker.output reads (the worker is not imported here)
META_FILE = "model.json"
META_FORMAT = "flodl-output-model"


def output_dir(settings: Settings) -> str:
    """Where the output model goes: ``output``, else beside ``summary``, else "" (nowhere)."""
    if settings.output:
        return os.path.abspath(settings.output)
    if settings.summary:
        return os.path.dirname(os.path.abspath(settings.summary))
    return ""


class ModelOutput:
    def __init__(self, settings: Settings) -> None:
        self.dir = output_dir(settings)
        self.session = settings.session
        self.final_eval = settings.final_eval
        self.plane = settings.plane
        self.asked: set[int] = set()  # ranks whose final eval was stamped with the path
        self.answer: Optional[tuple[int, pb.Timing.EvalResult]] = None  # (rank, its final EvalResult)
        if self.dir:  # refused at start, not found at the end of a long run
            try:
                os.makedirs(self.dir, exist_ok=True)
            except OSError as e:
                raise SettingsError(f"config error: output {self.dir}: cannot create it ({e.strerror})") from None
            if not os.access(self.dir, os.W_OK):
                raise SettingsError(f"config error: output {self.dir} is not writable (set --output to a writable directory)")

    @property
    def model_path(self) -> str:
        return os.path.join(self.dir, MODEL_FILE) if self.dir else ""

    STAMPS = "execute_eval"  # the only kind of Control ``stamp`` may change

    def stamp(self, rank: int, control: pb.Control) -> pb.Control:
        """The final eval for ``rank``, with where to write the model it evaluates."""
        if not self.dir or control.WhichOneof("cmd") != self.STAMPS or not control.execute_eval.final:
            return control
        self.asked.add(rank)
        out = pb.Control()
        out.CopyFrom(control)
        out.execute_eval.save_model_path = self.model_path
        return out

    def on_eval_result(self, rank: int, res: pb.Timing.EvalResult) -> None:
        """A final eval's answer from a rank that was asked to write the model: the last counts."""
        if rank in self.asked and res.final and (res.model_sha256 or res.HasField("model_error")):
            self.answer = (rank, res)

    def finish(self, summary: dict[str, Any], ok: bool) -> tuple[dict[str, Any], Optional[str]]:
        """The summary's ``model`` block, and the reason the run is not ok because of it
        (None when it is fine). Writes ``model.json`` beside a written model."""
        if not ok:
            return {"written": False, "reason": "the run did not complete"}, None
        if not self.dir:
            return {"written": False, "reason": "no output directory (set output, or summary: it goes beside it)"}, None
        if not self.final_eval:
            return {"written": False, "reason": "final_eval is off (the final eval's rank writes the model)"}, None
        if self.answer is None:
            why = "output model not written: no rank answered the final eval with it"
            return {"written": False, "reason": why}, why
        rank, res = self.answer
        if res.HasField("model_error"):
            why = f"output model not written by rank {rank}: {res.model_error}"
            return {"written": False, "reason": why, "rank": rank}, why
        sha = bytes(res.model_sha256).hex()
        block: dict[str, Any] = {"written": True, "path": self.model_path, "sha256": sha, "rank": rank}
        try:
            seen = sha256_file(self.model_path).hexdigest()
        except FileNotFoundError:
            seen = None
            host = next((r.get("host") for r in summary.get("ranks", []) if r.get("rank") == rank), "") or "?"
            block["note"] = f"written on rank {rank}'s host ({host}); {self.dir} is not shared with the coordinator's"
        if seen is not None and seen != sha:
            why = f"output model {self.model_path} does not match what rank {rank} wrote (sha256 {seen[:12]} != {sha[:12]})"
            return {"written": False, "reason": why, "rank": rank}, why
        meta_path = os.path.join(self.dir, META_FILE)
        try:
            atomic_write(meta_path, lambda fh: fh.write(strictjson.dumps(self._meta(summary, rank, sha),
                                                                         indent=2, sort_keys=True)), binary=False)  # fmt: skip
        except OSError as e:
            why = f"output model metadata not written: {describe_write_error(e, meta_path, 'output')}"
            return {**block, "written": False, "reason": why}, why
        block["meta"] = meta_path
        log.info("output model: %s (rank %d, sha256 %s), metadata %s", self.model_path, rank, sha[:12], meta_path)
        return block, None

    def _meta(self, s: dict[str, Any], rank: int, sha: str) -> dict[str, Any]:
        cov = s.get("coverage", [])
        exact = bool(cov) and all(c.get("duplicates") == 0 and c.get("missing") == 0 for c in cov)
        return {
            "format": META_FORMAT,
            "file": MODEL_FILE,
            "sha256": sha,
            "run": self.session,
            "epochs": s.get("epochs_completed"),
            "accuracy": s.get("accuracy"),
            "coverage": {"exact": exact, "epochs": cov},
            "policy": s.get("policy"),
            "plane": self.plane,
            "world_size": s.get("world_size"),
            "global_step": s.get("global_step"),
            "averages": s.get("averages"),
            "written_by_rank": rank,
            "load": "model.load_state_dict(torch.load('model.pt', weights_only=True))",
        }
