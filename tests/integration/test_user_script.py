"""``flodl run --local -- python script.py ARGS``: the user's own script as the ranks.

A script that trains (BatchNorm, dropout, its own arguments) runs to the end and leaves the
output model, which plain torch loads into a fresh model that evaluates to the summary's
accuracy; a script that fails at import in one of three ranks ends the run at once (the
world can no longer form), naming that rank, its exit code and its last stderr line, in the
output, the summary and the exit code -- not after form_timeout_s.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from flodl_worker import load_consensus

from runlocal import assert_exact_coverage, run_local

pytestmark = pytest.mark.integration

TRAIN, TEST = 256, 128
SCRIPT = f'''
import argparse
import torch
from torch import nn
from torch.utils.data import TensorDataset
from flodl_worker.rank import run_rank

def model():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn({TRAIN + TEST}, 8, generator=g)
    return x, x[:, :3].argmax(dim=1)

def evaluate(m):
    x, y = data()
    return float((m(x[{TRAIN}:]).argmax(dim=1) == y[{TRAIN}:]).float().mean())

def step(m, opt, batch):
    x, y = batch
    opt.zero_grad()
    loss = nn.functional.cross_entropy(m(x), y)
    loss.backward()
    opt.step()
    return loss

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, required=True)  # the script's own ARGS reach it
    lr = p.parse_args().lr
    x, y = data()
    run_rank(model, lambda m: torch.optim.SGD(m.parameters(), lr=lr), step,
             TensorDataset(x[:{TRAIN}], y[:{TRAIN}]), eval_fn=evaluate, task="user-script")
'''
COMMON = ("--ranks", "2", "--epochs", "2", "--batch-size", "16", "--base-ms", "0", "--policy", "sync")


def _module(path):
    spec = importlib.util.spec_from_file_location("user_train_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_user_script_trains_and_its_output_model_loads_with_plain_torch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc, summary, trace = run_local(tmp_path, *COMMON, "--", sys.executable, str(script), "--lr", "0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["ok"] and summary["task"] == "train.py", summary["reason"]
    assert_exact_coverage(summary, trace, epochs=2, expected=TRAIN)

    model = summary["model"]
    assert model["written"] and model["path"] == str(tmp_path / "model.pt"), model  # beside the summary
    assert f"model: {model['path']}" in proc.stdout
    meta = json.loads((tmp_path / "model.json").read_text())
    assert (meta["accuracy"], meta["epochs"], meta["world_size"], meta["policy"]) == (
        summary["accuracy"], 2, 2, "sync")  # fmt: skip
    assert meta["coverage"]["exact"] and meta["sha256"] == model["sha256"]

    # Plain torch, a fresh model: the file is exactly what the final eval measured.
    user = _module(script)
    fresh = user.model()
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    fresh.eval()
    with torch.no_grad():
        assert user.evaluate(fresh) == pytest.approx(summary["accuracy"], abs=1e-7)
    assert set(fresh.state_dict()) >= {"1.running_mean", "1.running_var"}  # buffers travel too

    again = user.model()  # the helper: same weights, and the metadata
    assert load_consensus(str(tmp_path), again)["accuracy"] == summary["accuracy"]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), fresh.state_dict().values()))


def test_a_script_failing_at_import_in_one_of_three_ranks_ends_the_run_naming_it(tmp_path):
    # Rank 1 can never come (its agent has no restarts left): the coordinator fails the
    # run at once, naming it, instead of waiting form_timeout_s (300 s) for it.
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nif os.environ["FLODL_RANK"] == "1":\n    import flodl_no_such_module_here\n' + SCRIPT)
    args = ("--ranks", "3", *COMMON[2:])
    proc, summary, _ = run_local(tmp_path, *args, "--", sys.executable, str(bad), "--lr", "0.1", timeout=150)
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = "ModuleNotFoundError: No module named 'flodl_no_such_module_here'"
    assert f"flodl: rank 1 exited with code 1: {error}" in proc.stderr  # said the moment it ended
    reason = summary["reason"]
    assert not summary["ok"] and reason.startswith("the world can no longer form (every slot is needed): "), reason
    assert f"rank 1: exited with code 1 before the world formed; its last line: {error}" in reason
    assert "its agent does not start it again" in reason
    # (0 and 2 may not have said hello yet: the launcher stops them, SIGTERM, once the run ended)
    failed = [(e["rank"], e["code"], e["last_lines"][-1]) for e in summary["rank_exits"] if e["code"] not in (0, -15)]
    assert failed == [(1, 1, error)]
    assert summary["model"] == {"written": False, "reason": "the run did not complete"}
    assert not (tmp_path / "model.pt").exists()
