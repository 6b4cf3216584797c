"""flodl_worker.loader: batches by worker processes, along the plans, the same as inline."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from flodl_worker.loader import BatchLoader, LoaderError

N = 64
PERM = np.random.default_rng(0).permutation(N)
X, Y = torch.randn(N, 3), torch.arange(N)


class MapStyle(Dataset):
    """``__getitem__`` per sample (no ``.tensors``); raises at ``bad``."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return N

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return X[i], Y[i]


def ids(epoch: int, offset: int, count: int) -> np.ndarray:
    return PERM[offset : offset + count]


class Plans:
    """Stands in for RankMachine.upcoming: a queue of planned batches, taken in order."""

    def __init__(self, keys) -> None:
        self.keys = list(keys)

    def upcoming(self, n: int):
        return self.keys[:n]

    def take(self):
        return self.keys.pop(0)


def batches(n=8, size=8):
    return [(0, i * size, size) for i in range(n)]


def test_workers_give_the_inline_batches_prefetched_along_the_plan():
    inline = BatchLoader(TensorDataset(X, Y), ids, lambda n: [])
    plans = Plans(batches())
    loader = BatchLoader(MapStyle(), ids, plans.upcoming, num_workers=2, prefetch=3)
    loader.start()
    try:
        for _ in range(8):
            key = plans.take()  # the machine hands the batch out, then the rank asks for it
            got, want = loader.get(*key), inline.get(*key)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert got[1].tolist() == PERM[key[1] : key[1] + key[2]].tolist()  # exactly the planned ids
        assert loader.loaded_on_demand == 1 and loader.prefetched == 7  # only the first was not ahead
    finally:
        loader.close()


def test_a_batch_outside_the_plan_is_loaded_at_once():
    loader = BatchLoader(MapStyle(), ids, lambda n: [], num_workers=1)
    loader.start()
    try:
        assert loader.get(3, 5, 4)[1].tolist() == PERM[5:9].tolist()
        assert loader.loaded_on_demand == 1
    finally:
        loader.close()


def test_a_dataset_error_in_a_worker_fails_with_its_traceback():
    bad = int(PERM[10])
    loader = BatchLoader(MapStyle(bad=bad), ids, lambda n: [], num_workers=1)
    loader.start()
    try:
        with pytest.raises(LoaderError, match=f"sample {bad} is corrupt"):
            loader.get(0, 8, 8)
    finally:
        loader.close()


def test_a_worker_that_dies_is_named_with_its_exit_code():
    loader = BatchLoader(MapStyle(), ids, lambda n: [], num_workers=1)
    loader.start()
    try:
        os.kill(loader._procs[0].pid, signal.SIGKILL)
        loader._procs[0].join(10)
        with pytest.raises(LoaderError, match="died with exit code -9"):
            loader.get(0, 0, 8)
    finally:
        loader.close()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_workers=-1"):
        BatchLoader(MapStyle(), ids, lambda n: [], num_workers=-1)
    with pytest.raises(ValueError, match="prefetch=0"):
        BatchLoader(MapStyle(), ids, lambda n: [], num_workers=1, prefetch=0)


def _a_rank_with_loader_workers(conn) -> None:
    loader = BatchLoader(MapStyle(), ids, lambda n: [], num_workers=2)
    loader.start()
    conn.send([p.pid for p in loader._procs])
    signal.pause()  # until killed


def test_workers_of_a_rank_killed_with_sigkill_exit_on_their_own():
    """No orphans: the rank (here a forked child) is killed -9 with its workers idle."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    rank = ctx.Process(target=_a_rank_with_loader_workers, args=(theirs,))
    rank.start()
    assert mine.poll(30), "the rank never started its workers"
    pids = mine.recv()
    assert len(pids) == 2
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10)
    deadline = time.monotonic() + 20
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.1)  # polling other processes' exit: nothing to wait on
    assert not alive, f"loader workers {alive} outlived their rank"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited (its reaper is init)
    except FileNotFoundError:
        return False
