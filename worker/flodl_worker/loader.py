"""flodl_worker.loader: a rank's batches, loaded inline or by worker processes.

Theory of operation
-------------------
What a rank trains is flodl's decision, not the loader's: the rank machine hands out
``TrainBatch(epoch, offset, count)`` = positions ``[offset, offset+count)`` of the
epoch's permutation (``flodl.shuffle``), and the sample ids are computed here, in the
rank process, from that permutation. The loader only turns ids into a batch, so the
coverage the coordinator audits is exactly what was planned, whatever the workers do.

* ``num_workers == 0`` (inline): ``dataset.tensors`` indexed at once for a
  TensorDataset-like dataset, else ``collate([dataset[i] for i in ids])``.
* ``num_workers > 0``: that many worker processes (``fork`` where available, so the
  dataset is inherited, not pickled) run ``dataset[i]`` (its per-sample transforms
  included) and ``collate``; tensors come back through shared memory
  (``torch.multiprocessing``). The rank keeps up to ``prefetch`` batches in flight,
  read from the plans it already holds (``RankMachine.upcoming``: the current chunk,
  then the queued plans; plans only queue behind, so a prefetched batch is one the
  machine will hand out). A batch asked for that was not prefetched is loaded at once.
  Each result carries its key (epoch, offset, count) and must match the batch asked
  for.
* ``data_ms`` (``Timing.Batch``) is the time the step waited for its batch: with
  workers that keep up it is ~0; it feeds ElChe's delivered cost on the coordinator.

A ``__getitem__`` that raises in a worker fails the rank with the worker's traceback (as
inline); a worker that dies (killed, out of memory) is named with its exit code; a
worker whose rank died (kill -9) notices within ``POLL_S`` and exits.
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["BatchLoader", "LoaderError", "DEFAULT_PREFETCH_PER_WORKER"]

log = logging.getLogger("flodl.rank")

DEFAULT_PREFETCH_PER_WORKER = 2  # batches in flight per worker when prefetch is not given
POLL_S = 1.0  # while waiting for a batch: how often the workers' liveness is checked
JOIN_S = 2.0

Key = tuple[int, int, int]  # (epoch, offset, count)


class LoaderError(RuntimeError):
    """A data-loader worker failed or died; ``str(e)`` names which and why."""


def _collate(items: list) -> Any:
    from torch.utils.data import default_collate

    return default_collate(items)


def _worker(dataset, collate, tasks, results, index: int, seed: int, parent: int) -> None:
    """One loader process: ``(key, ids)`` in, ``(key, batch, error)`` out, until None --
    or until the rank is gone (killed -9: nobody would ever send the None)."""
    torch.set_num_threads(1)  # the rank's own process trains; workers must not oversubscribe
    torch.manual_seed(seed + index)  # random per-sample transforms differ per worker
    np.random.seed((seed + index) % (1 << 32))
    results.cancel_join_thread()  # at exit, never wait for the rank to read what is left
    while True:
        try:
            task = tasks.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        key, ids = task
        try:
            batch = collate([dataset[int(i)] for i in ids])
        except Exception:  # noqa: BLE001 - sent back to the rank, which fails with it
            results.put((key, None, traceback.format_exc()))
            continue
        results.put((key, batch, None))


class BatchLoader:
    """Batches for a rank. ``ids(epoch, offset, count)`` gives the sample ids (the
    permutation's slice); ``upcoming(n)`` the next planned batches (prefetch)."""

    def __init__(
        self,
        dataset,
        ids: Callable[[int, int, int], np.ndarray],
        upcoming: Callable[[int], list],
        *,
        num_workers: int = 0,
        prefetch: int | None = None,
        collate: Callable[[list], Any] | None = None,
        seed: int = 0,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"prefetch={prefetch} must be >= 1 (batches in flight)")
        self.dataset, self.ids, self.upcoming = dataset, ids, upcoming
        self.collate = collate or _collate
        self.num_workers = num_workers
        self.prefetch = prefetch if prefetch is not None else DEFAULT_PREFETCH_PER_WORKER * max(num_workers, 1)
        self.seed = seed
        self._procs: list = []
        self._in_flight: set[Key] = set()
        self._ready: OrderedDict[Key, Any] = OrderedDict()
        self.prefetched = 0  # batches that were ready or in flight when asked for
        self.loaded_on_demand = 0

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self.num_workers == 0 or self._procs:
            return
        import torch.multiprocessing as mp

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        for i in range(self.num_workers):
            p = ctx.Process(
                target=_worker, args=(self.dataset, self.collate, self._tasks, self._results, i, self.seed, os.getpid()),
                name=f"flodl-loader-{i}", daemon=True,
            )  # fmt: skip
            p.start()
            self._procs.append(p)
        log.info("data loader: %d worker process(es), %d batch(es) in flight", self.num_workers, self.prefetch)

    def close(self) -> None:
        if not self._procs:
            return
        for _ in self._procs:
            try:
                self._tasks.put(None)
            except (OSError, ValueError):
                break
        deadline = time.monotonic() + JOIN_S
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(JOIN_S)
        self._procs = []
        for q in (self._tasks, self._results):
            q.cancel_join_thread()  # what is still queued is not needed
            q.close()

    # -- batches ------------------------------------------------------------------------

    def get(self, epoch: int, offset: int, count: int) -> Any:
        """The batch of positions ``[offset, offset+count)`` of ``epoch``."""
        ids = self.ids(epoch, offset, count)
        if self.num_workers == 0:
            return self._inline(ids)
        key = (epoch, offset, count)
        if key in self._ready or key in self._in_flight:
            self.prefetched += 1
        else:
            self.loaded_on_demand += 1
            self._submit(key, ids)
        self._top_up(skip=key)
        while key not in self._ready:
            self._receive()
        batch = self._ready.pop(key)
        self._top_up()
        return batch

    def _inline(self, ids: np.ndarray) -> Any:
        tensors = getattr(self.dataset, "tensors", None)
        if tensors is not None:
            idx = torch.from_numpy(ids)
            return [t[idx] for t in tensors]
        return self.collate([self.dataset[int(i)] for i in ids])

    def _submit(self, key: Key, ids: np.ndarray) -> None:
        self._tasks.put((key, np.asarray(ids)))
        self._in_flight.add(key)

    def _top_up(self, skip: Key | None = None) -> None:
        """Keep ``prefetch`` planned batches in flight or ready (a ready batch no longer
        planned -- it cannot be: plans only queue behind -- would not hold a slot)."""
        planned = self.upcoming(self.prefetch + 1)
        if skip is None:
            for k in [k for k in self._ready if k not in planned]:
                del self._ready[k]
        for key in planned:
            if len(self._in_flight) + len(self._ready) >= self.prefetch:
                return
            if key != skip and key not in self._in_flight and key not in self._ready:
                self._submit(key, self.ids(*key))

    def _receive(self) -> None:
        try:
            key, batch, error = self._results.get(timeout=POLL_S)
        except queue.Empty:
            dead = [p for p in self._procs if not p.is_alive()]
            if dead:
                p = dead[0]
                raise LoaderError(
                    f"data-loader worker {p.name} (pid {p.pid}) died with exit code {p.exitcode} "
                    "(killed, or out of memory?); lower num_workers or the per-sample memory"
                ) from None
            return
        key = tuple(key)
        self._in_flight.discard(key)
        if error is not None:
            raise LoaderError(f"the dataset raised in a loader worker for batch {key}:\n{error}")
        self._ready[key] = batch
