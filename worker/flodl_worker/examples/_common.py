"""Pieces shared by the example tasks: an MLP, a classification step and accuracy."""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn

from flodl_worker.run_world import world_size  # known inside run_rank, before optimizer_fn is called

__all__ = [
    "mlp", "classification_step", "accuracy_fn", "epoch_report_fn", "make_optimizer", "add_optim_args", "scaled_lr",
]  # fmt: skip

LR_SCALES = ("auto", "none", "sqrt", "linear")


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


def classification_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def accuracy_fn(x: torch.Tensor, y: torch.Tensor):
    def evaluate(model: nn.Module) -> float:
        dev = next(model.parameters()).device  # the rank's device (run_rank(device=...))
        return float((model(x.to(dev)).argmax(dim=1).cpu() == y).float().mean())

    return evaluate


def epoch_report_fn(x: torch.Tensor, y: torch.Tensor):
    """An ``epoch_fn``: one line per epoch on stderr from the elected rank."""
    evaluate = accuracy_fn(x, y)

    def report(model: nn.Module, epoch: int, metrics: dict) -> None:
        model.eval()
        with torch.no_grad():
            acc = evaluate(model)
        print(f"epoch {epoch + 1}: avg loss {metrics['avg_loss']:.4f}, held-out accuracy {acc:.4f}", file=sys.stderr)

    return report


def positive_int(s: str) -> int:
    """An argparse type: an integer >= 1 (sample counts, sizes), refused by name otherwise."""
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{s} must be >= 1")
    return n


def scaled_lr(lr: float, rule: str, world: int, optimizer: str = "sgd") -> float:
    """``lr`` for a run of ``world`` ranks: x1 (none), x sqrt(world) (sqrt) or x world (linear);
    ``auto`` is sqrt for Adam and none for SGD.

    Under parameter averaging SGD at ``lr`` already takes the step DDP takes at ``lr``;
    Adam needs ``lr * sqrt(world)`` for it (``flodl_worker.run_world``)."""
    if rule not in LR_SCALES:
        raise ValueError(f"lr scale {rule!r} is not one of {', '.join(LR_SCALES)}")
    if rule == "auto":
        rule = "sqrt" if optimizer == "adam" else "none"
    return lr * {"none": 1.0, "sqrt": math.sqrt(world), "linear": float(world)}[rule]


def add_optim_args(
    p: argparse.ArgumentParser, *, lr: float, hidden: int | None = 64, optimizer: str = "sgd"
) -> None:
    """--epoch-report, --optimizer, --lr, --lr-scale, --momentum and (``hidden`` not None) --hidden."""
    p.add_argument("--epoch-report", action="store_true",
                   help="the elected epoch-callback rank prints held-out metrics after every epoch")
    if hidden is not None:
        p.add_argument("--hidden", type=int, default=hidden, help=f"hidden units (default {hidden})")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=optimizer, help=f"default {optimizer}")
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default {lr})")
    p.add_argument("--lr-scale", choices=LR_SCALES, default="auto",
                   help="scale --lr by the run's world size K: none, sqrt (x sqrt(K)), linear (x K); auto (default) "
                        "= sqrt for adam (the step DDP takes at --lr), none for sgd (already DDP's step)")  # fmt: skip
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")


def make_optimizer(args: argparse.Namespace):
    """An ``optimizer_fn``: --optimizer at --lr scaled by --lr-scale for the run's world size."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        lr = scaled_lr(args.lr, args.lr_scale, world_size(), args.optimizer)
        if args.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=lr)
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)

    return build
