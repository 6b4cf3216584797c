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
from flodl_worker.params import f32, gamma_mass


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
    honest_request = averaging.BusAverager.on_request
    rounds = [0]

    def on_request(self, cycle: int) -> None:
        rounds[0] += 1
        kind = attacks.get(rounds[0])
        if kind is None:
            return honest_request(self, cycle)
        r = self.rank
        n = r.steps_since_avg
        w = gamma_mass(n, r.spec.gamma)
        pre = [f32(p).copy() for p in r.params]
        arrays, weight = _forge(kind, pre, w)
        header, blobs = pack_round(arrays, cycle=cycle, weight=weight, bf16=r.spec.bf16_wire)
        self.snapshots[cycle] = averaging.Snapshot(n=n, step_count=r.local_step, pre=pre, weight=w)
        print(f"hostile rank {r.cfg.rank}: round {rounds[0]} (cycle {cycle}) forged: {kind}", file=sys.stderr, flush=True)
        r._send("round", header, blobs)

    averaging.BusAverager.on_request = on_request


if __name__ == "__main__":
    install(_attacks())
    from flodl_worker.examples import digits

    digits.main(sys.argv[1:])
