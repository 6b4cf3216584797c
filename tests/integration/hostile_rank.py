"""The digits example as an admitted rank that attacks the run from inside (tests only).

``HOSTILE_ATTACKS="R:kind@n,kind@n,..."`` makes rank R replace its contribution in its
n-th averaging round with a forgery (any other rank, or no variable: the plain example):

* ``nan``: NaN tensors with its honest weight (item 6: must leave the round at once);
* ``weight``: zeros with weight 1e9 (item 7: the weight is the coordinator's to derive);
* ``huge``: 3e38 everywhere with its honest weight (item 8: finite, absurd, bounded).

(Not ``FLODL_*``: the coordinator refuses unknown variables of its own namespace.)
"""

from __future__ import annotations

import os
import sys

import numpy as np

from flodl.wire import pack_round
from flodl_worker import averaging


def _attacks() -> dict[int, str]:
    spec = os.environ.get("HOSTILE_ATTACKS", "")
    if not spec:
        return {}
    rank, _, rest = spec.partition(":")
    if int(rank) != int(os.environ.get("FLODL_RANK", "-1")):
        return {}
    return {int(n): kind for kind, _, n in (a.partition("@") for a in rest.split(","))}


def _forge(kind: str, pre: list, honest: float) -> tuple[list, float]:
    if kind == "nan":
        return [np.full_like(a, np.nan) for a in pre], honest
    if kind == "weight":
        return [np.zeros_like(a) for a in pre], 1e9
    if kind == "huge":
        return [np.full_like(a, 3e38) for a in pre], honest
    raise ValueError(f"unknown attack {kind!r}")


def install(attacks: dict[int, str]) -> None:
    honest_take = averaging.BusAverager.take
    rounds = [0]

    def take(self, cmd) -> None:  # the rank shell's TakeSnapshot: snapshot, then send the round
        rounds[0] += 1
        kind = attacks.get(rounds[0])
        if kind is None:
            return honest_take(self, cmd)
        r = self.rank
        snap = self._snapshot(cmd)  # the rank's own bookkeeping stays honest
        arrays, weight = _forge(kind, list(snap.pre), cmd.weight)  # the parameters forged, the f32 buffers honest
        header, blobs = pack_round(
            arrays + list(snap.bufs), cycle=cmd.cycle, weight=weight, bf16=r.spec.bf16_wire,
            buffers=len(snap.bufs), buffer_weight=averaging.mover_mass(cmd.weight),
        )  # fmt: skip
        print(f"hostile rank {r.cfg.rank}: round {rounds[0]} (cycle {cmd.cycle}) forged: {kind}", file=sys.stderr, flush=True)
        r._send("round", header, blobs)

    averaging.BusAverager.take = take


if __name__ == "__main__":
    install(_attacks())
    from flodl_worker.examples import digits

    digits.main(sys.argv[1:])
