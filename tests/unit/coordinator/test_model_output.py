"""The output model's coordinator half (``flodl_coordinator.output``): where it goes,
the final eval stamped with it, and what the summary (and ``ok``) say of every outcome."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from flodl.wire import pb
from flodl_coordinator.output import ModelOutput
from flodl_coordinator.settings import SettingsError, load_settings

SUMMARY = {"epochs_completed": 2, "accuracy": 0.75, "policy": "cadence", "world_size": 3, "global_step": 40,
           "averages": 6, "coverage": [{"epoch": 0, "expected": 8, "trained": 8, "duplicates": 0, "missing": 0}]}


def output(tmp_path, **flags) -> ModelOutput:
    return ModelOutput(load_settings(env={}, flags={"world_size": 3, **flags}))


def final_eval(**over) -> pb.Control:
    return pb.Control(execute_eval=pb.Control.ExecuteEval(schedule_id=2**64 - 1, target_rank=1, final=True, **over))


def test_the_output_goes_beside_the_summary_unless_set(tmp_path):
    assert output(tmp_path, summary=str(tmp_path / "s" / "summary.json")).dir == str(tmp_path / "s")
    assert output(tmp_path, summary=str(tmp_path / "s.json"), output=str(tmp_path / "o")).dir == str(tmp_path / "o")
    assert output(tmp_path).dir == ""  # neither: not written, and the summary says so
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingsError, match="output .*file.* cannot create it"):
        output(tmp_path, output=str(tmp_path / "file" / "sub"))


def test_only_the_final_eval_is_stamped_with_the_model_path(tmp_path):
    out = output(tmp_path, output=str(tmp_path))
    stamped = out.stamp(1, final_eval())
    assert stamped.execute_eval.save_model_path == str(tmp_path / "model.pt")
    assert out.stamp(1, pb.Control(execute_eval=pb.Control.ExecuteEval(schedule_id=3))).execute_eval.save_model_path == ""
    assert output(tmp_path).stamp(1, final_eval()).execute_eval.save_model_path == ""


def test_a_written_model_is_checked_and_gets_its_metadata(tmp_path):
    out = output(tmp_path, output=str(tmp_path), session="run-7")
    (tmp_path / "model.pt").write_bytes(b"weights")
    sha = hashlib.sha256(b"weights").digest()
    for rank in (2, 1):  # the first target failed its eval; the core retried on rank 1
        out.stamp(rank, final_eval())
    out.on_eval_result(3, pb.Timing.EvalResult(final=True, model_sha256=b"y" * 32))  # never asked: ignored
    out.on_eval_result(2, pb.Timing.EvalResult(final=True, error="this rank has no eval_fn", model_sha256=b"x" * 32))
    out.on_eval_result(1, pb.Timing.EvalResult(final=True, metric=0.75, model_sha256=sha))  # the retry: it counts
    block, why = out.finish(SUMMARY, ok=True)
    assert why is None
    assert block == {"written": True, "path": str(tmp_path / "model.pt"), "sha256": sha.hex(), "rank": 1,
                     "meta": str(tmp_path / "model.json")}  # fmt: skip
    meta = json.loads((tmp_path / "model.json").read_text())
    assert (meta["run"], meta["accuracy"], meta["epochs"], meta["world_size"], meta["written_by_rank"]) == (
        "run-7", 0.75, 2, 3, 1)  # fmt: skip
    assert meta["coverage"]["exact"] and meta["sha256"] == sha.hex() and meta["file"] == "model.pt"


def test_a_model_not_written_makes_a_completed_run_not_ok_and_says_why(tmp_path):
    out = output(tmp_path, output=str(tmp_path))
    out.stamp(0, final_eval())
    block, why = out.finish(SUMMARY, ok=True)
    assert not block["written"] and why == "output model not written: no rank answered the final eval with it"
    out.on_eval_result(0, pb.Timing.EvalResult(final=True, model_error="no space left on device: /x (output model)"))
    block, why = out.finish(SUMMARY, ok=True)
    assert why == "output model not written by rank 0: no space left on device: /x (output model)"
    (tmp_path / "model.pt").write_bytes(b"other bytes")
    out.on_eval_result(0, pb.Timing.EvalResult(final=True, model_sha256=hashlib.sha256(b"weights").digest()))
    block, why = out.finish(SUMMARY, ok=True)
    assert not block["written"] and "does not match what rank 0 wrote" in why
    assert not os.path.exists(tmp_path / "model.json")


def test_a_model_on_another_hosts_disk_is_named_not_failed(tmp_path):
    out = output(tmp_path, output=str(tmp_path / "not-shared"))
    out.stamp(4, final_eval())
    out.on_eval_result(4, pb.Timing.EvalResult(final=True, model_sha256=b"\x01" * 32))
    block, why = out.finish(SUMMARY, ok=True)
    assert why is None and block["written"] and "not shared" in block["note"]


def test_no_model_is_asked_of_a_run_that_failed_or_has_no_final_eval(tmp_path):
    assert output(tmp_path, output=str(tmp_path)).finish(SUMMARY, ok=False) == (
        {"written": False, "reason": "the run did not complete"}, None)  # fmt: skip
    block, why = output(tmp_path, output=str(tmp_path), final_eval=False).finish(SUMMARY, ok=True)
    assert why is None and "final_eval is off" in block["reason"]
    block, why = output(tmp_path).finish(SUMMARY, ok=True)
    assert why is None and "no output directory" in block["reason"]
