"""The run's world size inside a rank (``flodl_worker.world_size``) and the examples' LR
rule built on it (``--lr-scale``: Adam needs lr * sqrt(K) under parameter averaging to
step as far as DDP at lr; SGD needs nothing)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

import flodl_worker
from flodl_worker import run_world
from flodl_worker.examples._common import add_optim_args, make_optimizer, scaled_lr


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setattr(run_world, "_world", None)
    return run_world


def test_world_size_is_unknown_outside_a_rank_and_the_published_one_inside(world):
    with pytest.raises(RuntimeError, match="only known inside run_rank"):
        flodl_worker.world_size()
    world.set_world_size(6)
    assert flodl_worker.world_size() == 6
    with pytest.raises(ValueError, match=">= 1"):
        world.set_world_size(0)


@pytest.mark.parametrize(
    "rule, optimizer, factor",
    [("auto", "adam", math.sqrt(4)), ("auto", "sgd", 1.0), ("none", "adam", 1.0), ("sqrt", "sgd", 2.0),
     ("linear", "adam", 4.0)],
)  # fmt: skip
def test_scaled_lr_rules(rule, optimizer, factor):
    assert scaled_lr(0.01, rule, 4, optimizer) == pytest.approx(0.01 * factor)


def test_scaled_lr_refuses_an_unknown_rule():
    with pytest.raises(ValueError, match="not one of auto, none, sqrt, linear"):
        scaled_lr(0.01, "cubic", 4)


@pytest.mark.parametrize("argv, lr", [(["--optimizer", "adam"], 0.03), (["--optimizer", "sgd"], 0.01),
                                      (["--optimizer", "adam", "--lr-scale", "none"], 0.01)])  # fmt: skip
def test_example_optimizer_takes_the_scaled_lr_for_the_admitted_world(world, argv, lr):
    p = argparse.ArgumentParser()
    add_optim_args(p, lr=0.01)
    world.set_world_size(9)
    opt = make_optimizer(p.parse_args(argv))(torch.nn.Linear(2, 2))
    assert opt.param_groups[0]["lr"] == pytest.approx(lr)
    assert isinstance(opt, torch.optim.Adam if "adam" in argv else torch.optim.SGD)
