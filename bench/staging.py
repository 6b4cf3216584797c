"""A bus snapshot of many parameter tensors: one flat staging copy vs a copy per tensor.

Each bus round the rank deep-copies its parameters to host memory (the snapshot) and
scales that copy by its mass (the frame it sends). Measured on the same model in one
invocation: ``per_tensor`` (what the rank did before ``flodl_worker.staging``: per
tensor an f32 view, a copy, then a scaled temporary) vs ``flat`` (``FlatStaging``: one
allocation, one copy pass, one vectorised multiply into a second flat array).
Medians of ``--repeats``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from flodl_worker.params import f32
from flodl_worker.staging import FlatStaging


def model(tensors: int, params: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    each = params // tensors
    return [torch.nn.Parameter(torch.randn(each)) for _ in range(tensors)]


def per_tensor(ps: list[torch.Tensor], w: float) -> list[np.ndarray]:
    pre = [f32(p).copy() for p in ps]
    return [a * np.float32(w) for a in pre]


def flat(st: FlatStaging, w: float) -> list[np.ndarray]:
    pre = st.gather()
    out = np.empty_like(pre)
    np.multiply(pre, np.float32(w), out=out)
    return st.views(out)


def timed(fn, repeats: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=int, default=10_000_000)
    p.add_argument("--tensors", type=int, nargs="+", default=[8, 200, 2000])
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args()
    torch.set_num_threads(1)
    out = {"cpus": os.cpu_count(), "load_1m": os.getloadavg()[0], "params": a.params, "repeats": a.repeats, "runs": []}
    for n in a.tensors:
        ps = model(n, a.params)
        st = FlatStaging(ps)
        assert all(np.array_equal(x, y) for x, y in zip(per_tensor(ps, 3.0), flat(st, 3.0)))
        old = timed(lambda: per_tensor(ps, 3.0), a.repeats)
        new = timed(lambda: flat(st, 3.0), a.repeats)
        out["runs"].append({"tensors": n, "per_tensor_ms": round(old, 2), "flat_ms": round(new, 2),
                            "x_per_tensor": round(old / new, 2)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
