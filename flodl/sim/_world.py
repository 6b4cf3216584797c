"""A seeded, virtual-time world that drives the real ``flodl.core``.

Theory of operation
-------------------
Everything that could be nondeterministic is owned here: one ``random.Random(seed)``
draws every jitter, delay and (optional) fault; a heap of ``(time, seq, action)``
orders everything; the clock only moves by jumping to the next action. The core is
the real one — ``step(state, event)`` — and ``SimRank`` plays each rank by the same
protocol as ``flodl_worker.rank`` (``docs/protocol.md``):

* a plan (``StartEpoch`` / ``ExtendPartition`` / ``Update.next_plan``) is trained
  batch by batch; each batch takes ``ms_per_batch * (1 ± jitter)`` of virtual time and
  is reported (``BatchDone``) after a network delay;
* ``RequestParams`` snapshots the step counter and contributes to the simulated
  reducer; when every expected rank contributed (or died), each contributor gets the
  consensus after a delay and acks it (``SyncAcked``);
* ``Throttle`` pauses training at the next batch boundary until ``Update``;
* ``Shutdown`` -> ``RankExiting``.

Faults are data: ``fail_at={rank: step}`` kills a rank after that many steps (the
agent reports the exit after ``report_delay_s``); ``hang_at={rank: step}`` silences it
(only the core's liveness timeout can notice). A run is reproducible from its seed;
``Result.events`` is the exact event list, paste-able into a regression test.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from flodl.core import (
    BatchDone,
    ChunkDone,
    CoreConfig,
    EvalDone,
    ForgetRank,
    HeartbeatSeen,
    Notice,
    OpenRound,
    RankExiting,
    RankExitReported,
    RankHello,
    RunFinished,
    Send,
    SyncAcked,
    Tick,
    initial_state,
    step,
)

__all__ = ["SimConfig", "Result", "simulate"]


@dataclass(frozen=True)
class SimConfig:
    ms_per_batch: tuple[float, ...]  # one entry per rank: its compute time per batch
    total_samples: int = 1024
    batch_size: int = 16
    epochs: int = 2
    policy: str = "sync"
    seed: int = 0
    jitter: float = 0.05  # batch time multiplied by U(1-j, 1+j)
    latency_s: float = 0.0005  # one-way network delay (± 50%)
    reduce_s_per_rank: float = 0.0005  # simulated reducer work per contribution
    tick_s: float = 0.05
    heartbeat_s: float = 1.0
    liveness_timeout_s: float = 10.0
    fail_at: dict[int, int] = field(default_factory=dict)
    hang_at: dict[int, int] = field(default_factory=dict)
    report_delay_s: float = 0.01
    max_virtual_s: float = 36_000.0
    core_overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    finished: Optional[RunFinished]
    virtual_s: float
    events: list
    commands: int
    state: Any

    solo_samples_per_s: float = 0.0  # what the ranks could do alone, summed

    @property
    def summary(self) -> dict:
        return self.finished.summary if self.finished else {}

    @property
    def samples_per_s(self) -> float:
        committed = sum(c["trained"] - c["duplicates"] for c in self.summary.get("coverage", []))
        return committed / self.virtual_s if self.virtual_s > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Throughput / sum of solo throughputs (1.0 = no rank ever waited)."""
        return self.samples_per_s / self.solo_samples_per_s if self.solo_samples_per_s else 0.0


class SimRank:
    def __init__(self, world: "_World", rank: int, ms: float):
        self.w, self.rank, self.ms = world, rank, ms
        self.plans: list[list[int]] = []  # [epoch, offset, size]
        self.step = 0
        self.training = False
        self.throttled = False
        self.alive = True
        self.silent = False
        self.snapshot_step = 0
        self.chunk_batches = 0
        self.chunk_samples = 0
        self.chunk_started = 0.0

    # -- inbound ----------------------------------------------------------------------
    def on_control(self, ctl) -> None:
        if not self.alive:
            return
        kind = ctl.WhichOneof("cmd")
        if kind == "start_epoch":
            p = ctl.start_epoch.plan
            self._add_plan(p.epoch, p.partition_offset, p.partition_size)
        elif kind == "extend_partition":
            e = ctl.extend_partition
            self._add_plan(e.epoch, e.partition_offset, e.partition_size)
        elif kind == "request_params":
            self.snapshot_step = self.step
            self.w.reducer_contribute(self.rank, ctl.request_params.cycle, self.snapshot_step)
        elif kind == "throttle":
            self.throttled = True
        elif kind == "update":
            self.throttled = False
            if ctl.update.HasField("next_plan"):
                p = ctl.update.next_plan
                self._add_plan(p.epoch, p.partition_offset, p.partition_size)
            self._maybe_train()
        elif kind == "execute_eval":
            ev = ctl.execute_eval
            self.w.to_core(EvalDone, rank=self.rank, schedule_id=ev.schedule_id, epoch=ev.epoch,
                           metric=0.5, final=ev.final)  # fmt: skip
        elif kind == "shutdown" or kind == "shutdown_with_save":
            self.w.to_core(RankExiting, rank=self.rank, param_digest="sim", steps=self.step)
            self.alive = False

    def on_consensus(self, cycle: int, step_count: int) -> None:
        if self.alive:
            self.w.to_core(SyncAcked, rank=self.rank, cycle=cycle, step_count=step_count, divergence=0.0)

    # -- training ---------------------------------------------------------------------
    def _add_plan(self, epoch: int, off: int, size: int) -> None:
        if size > 0:
            self.plans.append([epoch, off, size])
            self._maybe_train()

    def _maybe_train(self) -> None:
        if self.training or self.throttled or not self.plans or not self.alive:
            return
        self.training = True
        if self.chunk_batches == 0:
            self.chunk_started = self.w.now
        j = self.w.cfg.jitter
        dt = self.ms / 1000.0 * self.w.rng.uniform(1 - j, 1 + j)
        self.w.at(self.w.now + dt, self._batch_done, dt)

    def _batch_done(self, dt: float) -> None:
        self.training = False
        if not self.alive:
            return
        epoch, off, size = self.plans[0]
        n = min(self.w.cfg.batch_size, size)
        self.step += 1
        self.chunk_batches += 1
        self.chunk_samples += n
        self.w.to_core(BatchDone, rank=self.rank, batch_ms=dt * 1000, data_ms=0.0, step_count=self.step,
                       loss=1.0, samples=n, epoch=epoch, offset=off)  # fmt: skip
        if size - n > 0:
            self.plans[0] = [epoch, off + n, size - n]
        else:
            self.plans.pop(0)
            if not self.plans or self.plans[0][0] != epoch:
                self._chunk_done(epoch)
        if self._fault():
            return
        self._maybe_train()

    def _chunk_done(self, epoch: int) -> None:
        ms = (self.w.now - self.chunk_started) * 1000
        self.w.to_core(ChunkDone, rank=self.rank, epoch=epoch, chunk_seq=self.step, batches=self.chunk_batches,
                       samples=self.chunk_samples, avg_loss=1.0, epoch_ms=ms, share_complete_ms=ms,
                       compute_only_ms=ms)  # fmt: skip
        self.chunk_batches = self.chunk_samples = 0

    def _fault(self) -> bool:
        cfg = self.w.cfg
        if cfg.fail_at.get(self.rank) == self.step:
            self.alive = False
            self.w.at(self.w.now + cfg.report_delay_s, self.w.feed, RankExitReported, dict(rank=self.rank, code=-9))
            self.w.reducer_drop(self.rank)
            return True
        if cfg.hang_at.get(self.rank) == self.step:
            self.alive = False
            self.silent = True
            self.w.reducer_drop(self.rank)
            return True
        return False

    def heartbeat(self) -> None:
        if self.alive:
            self.w.to_core(HeartbeatSeen, rank=self.rank, step_count=self.step)
            self.w.at(self.w.now + self.w.cfg.heartbeat_s, self.heartbeat)


class _World:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.now = 0.0
        self._q: list = []
        self._seq = 0
        n = len(cfg.ms_per_batch)
        core_cfg = CoreConfig(world_size=n, batch_size=cfg.batch_size, num_epochs=cfg.epochs, seed=cfg.seed,
                              policy=cfg.policy, total_samples=cfg.total_samples,
                              heartbeat_interval_s=cfg.heartbeat_s, liveness_timeout_s=cfg.liveness_timeout_s,
                              **cfg.core_overrides)  # fmt: skip
        self.state = initial_state(core_cfg)
        self.ranks = [SimRank(self, r, ms) for r, ms in enumerate(cfg.ms_per_batch)]
        self.events: list = []
        self.commands = 0
        self.finished: Optional[RunFinished] = None
        self.round: Optional[dict] = None
        self.notices: list[Notice] = []

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn, args))

    def delay(self) -> float:
        return self.cfg.latency_s * self.rng.uniform(0.5, 1.5)

    def to_core(self, cls, **kw) -> None:
        rank = self.ranks[kw["rank"]]
        if rank.silent:
            return
        self.at(self.now + self.delay(), self.feed, cls, kw)

    def feed(self, cls, kw: dict) -> None:
        ev = cls(now=self.now, **kw)
        self.events.append(ev)
        self.state, cmds = step(self.state, ev)
        self.commands += len(cmds)
        for c in cmds:
            self._execute(c)

    def _execute(self, c) -> None:
        if isinstance(c, Send):
            self.at(self.now + self.delay(), self.ranks[c.rank].on_control, c.control)
        elif isinstance(c, OpenRound):
            self.round = {"cycle": c.cycle, "expected": set(c.ranks), "got": {}}
        elif isinstance(c, ForgetRank):
            self.reducer_drop(c.rank)
        elif isinstance(c, Notice):
            self.notices.append(c)
        elif isinstance(c, RunFinished):
            self.finished = c

    # -- the simulated reducer ------------------------------------------------------------
    def reducer_contribute(self, rank: int, cycle: int, step_count: int) -> None:
        self.at(self.now + self.delay(), self._arrive, rank, cycle, step_count)

    def _arrive(self, rank: int, cycle: int, step_count: int) -> None:
        rd = self.round
        if rd is None or rd["cycle"] != cycle or rank not in rd["expected"]:
            return
        rd["got"][rank] = step_count
        self._maybe_reduce()

    def reducer_drop(self, rank: int) -> None:
        if self.round is not None:
            self.round["expected"].discard(rank)
            self.round["got"].pop(rank, None)
            self._maybe_reduce()

    def _maybe_reduce(self) -> None:
        rd = self.round
        if rd is None or not rd["expected"].issubset(rd["got"]):
            return
        self.round = None
        done = self.now + self.cfg.reduce_s_per_rank * max(1, len(rd["got"]))
        for rank, step_count in sorted(rd["got"].items()):
            self.at(done + self.delay(), self.ranks[rank].on_consensus, rd["cycle"], step_count)

    # -- run ----------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.finished is None:
            self.feed(Tick, {})
            self.at(self.now + self.cfg.tick_s, self._tick)

    def run(self) -> Result:
        for r in self.ranks:
            self.at(self.delay(), self.feed, RankHello,
                    dict(route=(b"sim%d" % r.rank,), rank=r.rank, world_size=len(self.ranks),
                         model_sig=b"\x01" * 32, dataset_len=self.cfg.total_samples, incarnation=r.rank + 1))  # fmt: skip
            self.at(self.cfg.heartbeat_s, r.heartbeat)
        self.at(self.cfg.tick_s, self._tick)
        while self._q and self.finished is None:
            t, _, fn, args = heapq.heappop(self._q)
            if t > self.cfg.max_virtual_s:
                break
            self.now = max(self.now, t)
            fn(*args)
        solo = sum(self.cfg.batch_size * 1000.0 / ms for ms in self.cfg.ms_per_batch)
        return Result(self.finished, self.now, self.events, self.commands, self.state, solo)


def simulate(cfg: SimConfig) -> Result:
    """Run one simulated training job to completion (or ``max_virtual_s``)."""
    return _World(cfg).run()
