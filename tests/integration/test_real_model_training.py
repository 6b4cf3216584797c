"""A BatchNorm model with a per-step LR schedule and a worker-loaded map-style dataset,
trained by three unequal ranks (issue 13, items 2-5): after the final average every
rank holds the same parameters *and* BatchNorm running stats, and so does the final
consensus checkpoint; every rank ends at the schedule's last LR; coverage is exact by
the ranks' own traces with the batches loaded by worker processes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flodl_coordinator.checkpoints import load_checkpoint
from flodl_worker.buffers import averaged_buffers
from flodl_worker.examples.synthetic import model_fn
from flodl_worker.params import param_digest
from runlocal import assert_exact_coverage, run_local

pytestmark = pytest.mark.integration

TRAIN, BATCH, EPOCHS, HIDDEN, FEATURES, LR = 512, 16, 2, 16, 8, 0.05
TASK = (
    "--", "--samples", str(TRAIN), "--test-samples", "128", "--features", str(FEATURES), "--hidden", str(HIDDEN),
    "--batchnorm", "--lr-schedule", "cosine", "--lr", str(LR),
)  # fmt: skip


@pytest.mark.parametrize("plane,loader", [("bus", ("--num-workers", "2", "--sample-ms", "0.2")), ("collective", ())])
def test_batchnorm_stats_schedule_and_loader_agree_on_every_rank(tmp_path, plane, loader):
    ck = tmp_path / "ck"
    proc, summary, trace = run_local(
        tmp_path, "--ranks", "3", "--task", "synthetic", "--plane", plane, "--policy", "cadence",
        "--slowdown", "1,2,4", "--base-ms", "2", "--epochs", str(EPOCHS), "--batch-size", str(BATCH),
        "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--quiet", *TASK, *loader,
    )  # fmt: skip
    assert proc.returncode == 0 and summary and summary["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_exact_coverage(summary, trace, EPOCHS, TRAIN)
    # Buffers: the exit digest covers parameters and f32 buffers; all ranks agree ...
    digests = {r["param_digest"] for r in summary["ranks"]}
    assert len(digests) == 1 and "" not in digests, summary["ranks"]
    # ... and the final consensus checkpoint holds exactly those parameters and stats.
    point = load_checkpoint(str(ck))
    state = torch.load(os.path.join(point.path, "model.pt"), weights_only=True)["model"]
    model = model_fn(FEATURES, HIDDEN, 4, True)()
    model.load_state_dict(state)
    assert param_digest(list(model.parameters()) + averaged_buffers(model)).hex() in digests
    assert not torch.equal(state["1.running_var"], torch.ones(HIDDEN))  # the stats did train
    # Schedule: the run's progress, not each rank's steps, so every rank ends alike.
    ends, seen = set(), set()
    for r in range(3):
        lines = (trace / f"rank{r}.lr").read_text().split()
        rows = [lines[i : i + 4] for i in range(0, len(lines), 4)]
        seen.update(float(row[3]) for row in rows)
        ends.add((float(rows[-1][2]), float(rows[-1][3])))
    assert ends == {(1.0, LR * 0.01)}, ends  # cosine from LR down to 1% of it, at fraction 1
    assert len(seen) > 10 and max(seen) > LR * 0.9  # it moved per step, from the peak
    assert math.isclose(min(seen), LR * 0.01)
