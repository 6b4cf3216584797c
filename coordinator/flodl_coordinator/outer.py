"""Outer optimizers for the bus plane: what the coordinator makes of the consensus.

Theory of operation
-------------------
The reducer's work-weighted average of one round is the *consensus* ``c_t``. An outer
optimizer turns it into the *global* ``g_t`` -- the parameters every rank receives and
applies as ``theta <- g_t + (theta - snapshot)`` -- treating the window's average
progress as a pseudo-gradient (reference flodl-features §2.4)::

    delta_t = g_{t-1} - c_t                                  (progress, negated)
    none      g_t = c_t                                      (plain averaging, default)
    slowmo    u_t = beta * u_{t-1} + delta_t ;  g_t = g_{t-1} - lr * u_t
    nesterov  u_t = mu * u_{t-1} + delta_t   ;  g_t = g_{t-1} - lr * (delta_t + mu * u_t)

``lr = 1, momentum = 0`` is plain averaging for both (``g_t = c_t``, bit for bit up to
one f32 rounding). Nesterov is the DiLoCo outer step (``torch.optim.SGD(nesterov=True)``
on the pseudo-gradient); SlowMo is the heavy-ball form.

Why ``g_{t-1}`` is the right anchor although rounds overlap training: a rank's snapshot
for round ``t`` is what it got in round ``t-1`` plus every step it took since *its
previous snapshot* (the delta-preserving apply keeps the steps taken while a round was
in flight), so ``mean(snapshots_t) - g_{t-1}`` is exactly the cohort's progress since
the global it was last handed. With bf16 on the wire the ranks receive ``bf16(g_t)``:
the anchor kept is that rounded value (``quantize``), so ``delta`` measures progress
from what the ranks hold, not from a value they never saw.

The first round has no anchor (ranks may not even start from the same weights): ``g_1
= c_1`` and the momentum starts at zero. A round with zero accepted mass is not a step
(nothing was realized; every receiver keeps its local weights).

Checkpoints: the state after cycle ``c`` is what a checkpoint of cycle ``c`` must hold,
but the core may decide that checkpoint after the reducer already reduced ``c + 1``.
So the state of the last ``KEEP`` cycles is kept -- by reference: a step allocates
new arrays and never mutates old ones in place, so keeping one costs nothing extra --
and ``save_state``/``load_state`` write and read it as ``.npz`` (no pickle).
numpy only: the coordinator never imports torch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Callable, Optional, Sequence

if TYPE_CHECKING:  # numpy is imported where an outer step or its state needs it: the
    import numpy as np  # settings schema (`flodl run`'s flags) reads OUTER_KINDS alone

__all__ = [
    "OUTER_KINDS",
    "OuterError",
    "OuterState",
    "OuterOptimizer",
    "save_state",
    "load_state",
    "validate_outer",
]

OUTER_KINDS = ("none", "slowmo", "nesterov")
# States kept for checkpoints: the current cycle's and the one before (the core names
# the last *finished* round, which is at most one behind what the reducer reduced).
KEEP = 2
_NPZ_FORMAT = 1


class OuterError(Exception):
    """Outer-optimizer settings or saved state that cannot be used; one line, why."""


@dataclass(frozen=True, slots=True)
class OuterState:
    """Everything needed to continue: the anchor ``g`` and the momentum ``u`` after ``cycle``."""

    kind: str
    cycle: int
    steps: int  # outer steps taken (rounds with mass > 0)
    anchor: tuple[np.ndarray, ...]
    momentum: tuple[np.ndarray, ...]
    lr: float = 1.0
    beta: float = 0.0


def validate_outer(kind: str, lr: float, momentum: float) -> Optional[str]:
    """Why these settings are unusable (one line), or None."""
    if kind not in OUTER_KINDS:
        return f"outer_optimizer must be one of {', '.join(OUTER_KINDS)}, got {kind!r}"
    if not (math.isfinite(lr) and lr > 0):
        return f"outer_lr must be a finite number > 0, got {lr!r}"
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        return f"outer_momentum must be in [0, 1), got {momentum!r}"
    return None


class OuterOptimizer:
    def __init__(self, kind: str = "none", *, lr: float = 1.0, momentum: float = 0.0) -> None:
        why = validate_outer(kind, lr, momentum)
        if why:
            raise OuterError(why)
        self.kind, self.lr, self.beta = kind, float(lr), float(momentum)
        self._states: OrderedDict[int, OuterState] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def latest(self) -> Optional[OuterState]:
        return next(reversed(self._states.values()), None)

    def state_at(self, cycle: int) -> Optional[OuterState]:
        """The state right after ``cycle`` (0: the latest), if still kept.

        That is the newest state of a cycle <= ``cycle``: a round with zero mass is no
        step, so the state after it is the one before it. None when every kept state is
        newer (the one asked for was already let go)."""
        if cycle == 0:
            return self.latest
        for c in reversed(self._states):
            if c <= cycle:
                return self._states[c]
        return None

    def restore(self, state: OuterState) -> None:
        if state.kind != self.kind:
            raise OuterError(f"the saved outer state is for {state.kind!r}, this run uses {self.kind!r}")
        self._states.clear()
        self._states[state.cycle] = state

    def reset(self) -> None:
        self._states.clear()

    def step(
        self,
        cycle: int,
        consensus: Sequence[np.ndarray],
        *,
        quantize: Optional[Callable[[np.ndarray], np.ndarray]] = None,
    ) -> list[np.ndarray]:
        """The global ``g_t`` for the consensus ``c_t`` of ``cycle`` (f32 arrays, new)."""
        if not self.enabled:
            return list(consensus)
        import numpy as np
        prev = self.latest
        if prev is not None and (
            len(prev.anchor) != len(consensus)
            or any(a.shape != c.shape for a, c in zip(prev.anchor, consensus))
        ):
            raise OuterError("the outer state's tensor shapes differ from this round's consensus")
        if prev is None:
            new = [np.array(c, dtype=np.float32, copy=True) for c in consensus]
            mom = tuple(np.zeros_like(c) for c in new)
        else:
            lr, beta = np.float32(self.lr), np.float32(self.beta)
            new, moms = [], []
            for g, u, c in zip(prev.anchor, prev.momentum, consensus):
                delta = g - c
                m = beta * u + delta
                moms.append(m)
                if self.kind == "slowmo":
                    new.append(g - lr * m)
                else:  # nesterov
                    new.append(g - lr * (delta + beta * m))
            mom = tuple(moms)
        if quantize is not None:
            new = [quantize(a) for a in new]
        steps = prev.steps + 1 if prev is not None else 1
        self._states.pop(cycle, None)  # a resumed run may count cycles afresh: newest last
        self._states[cycle] = OuterState(self.kind, cycle, steps, tuple(new), mom, self.lr, self.beta)
        while len(self._states) > KEEP:
            self._states.popitem(last=False)
        return new


def save_state(state: OuterState, fh: BinaryIO) -> None:
    """Write ``state`` as an uncompressed .npz (arrays g0.., u0..; no pickled objects)."""
    import numpy as np

    arrays = {
        "format": np.array(_NPZ_FORMAT, dtype=np.int64),
        "kind": np.array(state.kind),
        "cycle": np.array(state.cycle, dtype=np.int64),
        "steps": np.array(state.steps, dtype=np.int64),
        "lr": np.array(state.lr, dtype=np.float64),
        "beta": np.array(state.beta, dtype=np.float64),
        "count": np.array(len(state.anchor), dtype=np.int64),
    }
    for i, (g, u) in enumerate(zip(state.anchor, state.momentum)):
        arrays[f"g{i}"] = np.asarray(g, dtype=np.float32)
        arrays[f"u{i}"] = np.asarray(u, dtype=np.float32)
    np.savez(fh, **arrays)


def load_state(path: str) -> OuterState:
    """Read what ``save_state`` wrote; ``OuterError`` naming the defect otherwise."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != _NPZ_FORMAT:
                raise OuterError(f"{path}: outer state format {int(z['format'])} is not {_NPZ_FORMAT}")
            n = int(z["count"])
            anchor = tuple(np.array(z[f"g{i}"], dtype=np.float32) for i in range(n))
            momentum = tuple(np.array(z[f"u{i}"], dtype=np.float32) for i in range(n))
            state = OuterState(
                kind=str(z["kind"]),
                cycle=int(z["cycle"]),
                steps=int(z["steps"]),
                anchor=anchor,
                momentum=momentum,
                lr=float(z["lr"]),
                beta=float(z["beta"]),
            )
    except OuterError:
        raise
    except (OSError, KeyError, ValueError, EOFError) as e:
        raise OuterError(f"{path}: outer state is unreadable ({type(e).__name__}: {e})") from None
    if state.kind not in OUTER_KINDS or any(g.shape != u.shape for g, u in zip(anchor, momentum)):
        raise OuterError(f"{path}: outer state is inconsistent (kind {state.kind!r} or shapes)")
    return state
