"""flodl_worker.progress: the run's clock on a rank and an LR schedule following it."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

import flodl_worker
from flodl.rank import Admitted, BatchTrained, ControlReceived, RankMachine
from flodl.wire import pb
from flodl_worker.run_progress import LrScheduleError, ProgressClock


def admitted(total=100, epochs=2) -> RankMachine:
    m = RankMachine(0)
    m.handle(Admitted(spec=pb.RunSpec(total_samples=total, num_epochs=epochs, batch_size=10, gamma=1.0)))
    return m


def set_global_step(m: RankMachine, step: int, samples: int) -> None:
    m.handle(ControlReceived(control=pb.Control(set_global_step=pb.Control.SetGlobalStep(global_step=step, samples_committed=samples))))


def test_progress_is_the_coordinators_committed_work_plus_this_ranks_unfolded_and_never_goes_back():
    m = admitted()
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trace = io.StringIO()
    clock = ProgressClock(m, lambda: opt, lambda p: 1.0 - p.fraction, trace)
    clock.tick()
    assert flodl_worker.progress().fraction == 0.0 and opt.param_groups[0]["lr"] == 1.0
    for _ in range(3):
        m.handle(BatchTrained(epoch=0, offset=0, samples=10))
    clock.tick()
    p = flodl_worker.progress()
    assert (p.global_step, p.samples, p.total_samples, p.epoch) == (3, 30, 200, 0.3)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.85)
    # The consensus folds those steps before the coordinator's count arrives: no dip.
    m.folded_step, m.steps_since_avg = 3, 0
    clock.tick()
    assert flodl_worker.progress().samples == 30
    set_global_step(m, 9, 90)  # the cohort's work, this rank's included
    clock.tick()
    assert (flodl_worker.progress().global_step, flodl_worker.progress().samples) == (9, 90)
    set_global_step(m, 20, 200)  # the final average: every rank at fraction 1
    clock.tick()
    assert flodl_worker.progress().fraction == 1.0 and opt.param_groups[0]["lr"] == 0.0
    assert trace.getvalue().splitlines()[-1] == "20 200 1.000000 0.0"


@pytest.mark.parametrize("bad", [float("nan"), -0.1, "fast", None])
def test_a_schedule_returning_no_usable_lr_is_an_error_that_says_so(bad):
    clock = ProgressClock(admitted(), lambda: None, lambda p: bad)
    with pytest.raises(LrScheduleError, match="lr_schedule returned"):
        clock.tick()


def test_without_a_schedule_the_lr_is_left_alone():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    ProgressClock(admitted(), lambda: opt).tick()
    assert opt.param_groups[0]["lr"] == 0.3


def test_progress_outside_a_rank_is_an_error_not_a_zero(monkeypatch):
    import flodl_worker.run_progress as mod

    monkeypatch.setattr(mod, "_current", None)
    with pytest.raises(RuntimeError, match="only known inside run_rank"):
        flodl_worker.progress()


def test_importing_flodl_worker_still_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, flodl_worker; flodl_worker.Progress; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
