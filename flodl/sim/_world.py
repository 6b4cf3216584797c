"""A seeded, virtual-time world that drives the real ``flodl.core``.

Theory of operation
-------------------
Everything that could be nondeterministic is owned here: one ``random.Random(seed)``
draws every jitter, delay and (optional) fault; a heap of ``(time, seq, action)``
orders everything; the clock only moves by jumping to the next action. The core is
the real one — ``step(state, event)`` — and so is each rank's: ``SimRank``
(``flodl.sim._rank``) drives the real rank machine (``flodl.rank.RankMachine``, the one
``flodl_worker.rank`` drives with torch), so plans, throttle, credit, the folded step and
the resync report are the real logic on both ends (``docs/protocol.md``):

* a plan is trained batch by batch; each batch takes ``ms_per_batch * (1 ± jitter)`` of
  virtual time and is reported (``BatchDone``) after a network delay;
* ``RequestParams`` snapshots and contributes to the simulated reducer (weights only, no
  tensors); when every expected rank contributed (or died), each contributor gets the
  consensus after a delay and acks it (``SyncAcked``);
* every link (core -> rank, rank -> core) is FIFO, as one ZeroMQ connection is.

Coordinator restarts: ``crash_at`` lists journal lengths at which the coordinator dies
right after journaling and stepping that event (its commands never leave). Every frame
in flight either way is lost, and so is the reducer's open round; frames the ranks and
agents send while it is down are queued and delivered after the restart. After
``restart_after_s`` the core is rebuilt as the service does it, ``replay(config,
journal)``, checked equal to the state it had, fed ``CoordinatorRestarted``, and gets a
new incarnation: the rank machines notice it on its first frame and send their resync
report. ``Result.restarts`` / ``Result.lost_frames`` count what happened.

Faults are data: ``fail_at={rank: step}`` kills a rank after that many steps (the
agent reports the exit after ``report_delay_s``); ``hang_at={rank: step}`` silences it
(only the core's liveness timeout can notice). ``hello_at={rank: t}`` starts a rank
late (``inf``: never) -- after the world formed, it joins the running world -- and
``respawn_after_s`` starts a rank killed by ``fail_at`` again (a new process). A joiner
is seeded with the simulated reducer's latest consensus; ``Result.violations`` lists any
joiner that trained before its seed arrived, and any snapshot taken for a step the rank
had not reported yet (a round frame that outran its batches: the reducer refuses it). A run is reproducible from its seed;
``Result.events`` is the exact event list, paste-able into a regression test.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from flodl.core import (
    CoordinatorRestarted,
    CoreConfig,
    ForgetRank,
    Notice,
    OpenRound,
    Reply,
    RunFinished,
    SeedJoiner,
    Send,
    Tick,
    initial_state,
    replay,
    step,
)

from ._rank import INCLUDED, SimRank

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
    # Elastic membership: a rank's first hello at this virtual time (default 0; inf:
    # never -- a host that never comes). The core's min_ranks goes in core_overrides.
    hello_at: dict[int, float] = field(default_factory=dict)
    # A rank killed by fail_at comes back this long after (its agent's --max-restarts): a
    # new process, a new incarnation, the same rank id, admitted into the running world.
    respawn_after_s: Optional[float] = None
    hang_at: dict[int, int] = field(default_factory=dict)
    report_delay_s: float = 0.01
    max_virtual_s: float = 36_000.0
    core_overrides: dict[str, Any] = field(default_factory=dict)
    crash_at: tuple[int, ...] = ()  # journal lengths at which the coordinator dies
    restart_after_s: float = 0.5  # down this long (well within liveness_timeout_s)
    check_replay: bool = True  # a restart asserts replay(journal) == the state it had


@dataclass
class Result:
    finished: Optional[RunFinished]
    virtual_s: float
    events: list
    commands: int
    state: Any

    solo_samples_per_s: float = 0.0  # what the ranks could do alone, summed
    restarts: int = 0  # coordinator restarts that happened
    lost_frames: int = 0  # frames lost in flight to or from a dying coordinator
    violations: list = field(default_factory=list)  # what the simulator saw go wrong (see the module doc)
    respawns: int = 0  # rank processes started again (respawn_after_s)

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
        self._by_route = {r.route: r for r in self.ranks}  # a Reply's addressee, without a walk
        self.events: list = []  # the journal
        self.commands = 0
        self.finished: Optional[RunFinished] = None
        self.round: Optional[dict] = None
        self.notices: list[Notice] = []
        # Links are FIFO: the time the last frame on (direction, rank) arrives.
        self._up: dict[int, float] = {}
        self._down: dict[int, float] = {}
        # Coordinator restarts: a generation per coordinator process; frames carry the
        # one they were sent in, and a frame of a dead process is lost.
        self.incarnation = 1
        self.gen = 0
        self.down = False
        self.backlog: list = []  # (cls, kw) sent while the coordinator was down
        self._crashes = sorted(cfg.crash_at)
        self.restarts = 0
        self.lost_frames = 0
        # The reducer's latest consensus (its cycle), what a joiner is seeded with; None
        # before the first round and after a coordinator restart (a new reducer).
        self.consensus_cycle: Optional[int] = None
        self.pending_seeds: list[int] = []
        self.violations: list[str] = []
        self.respawns = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn, args))

    def delay(self) -> float:
        return self.cfg.latency_s * self.rng.uniform(0.5, 1.5)

    # -- links ------------------------------------------------------------------------

    def to_core(self, cls, kw: dict) -> None:
        """A rank's frame to the coordinator (FIFO per rank)."""
        rank = kw["rank"]
        if self.ranks[rank].silent:
            return
        t = max(self.now + self.delay(), self._up.get(rank, 0.0))
        self._up[rank] = t
        self.at(t, self._arrive_core, self.gen, cls, kw)

    def agent_report(self, cls, kw: dict) -> None:
        """The agent's report of a rank's exit (its own connection)."""
        self.at(self.now + self.cfg.report_delay_s, self._arrive_core, self.gen, cls, kw)

    def _arrive_core(self, gen: int, cls, kw: dict) -> None:
        if gen != self.gen:
            self.lost_frames += 1  # in flight when the coordinator died
        elif self.down:
            self.backlog.append((cls, kw))  # queued by the DEALER until it reconnects
        else:
            self.feed(cls, kw)

    def _to_rank(self, rank: int, fn: Callable, *args) -> None:
        """A coordinator frame to a rank, sent now (FIFO per rank)."""
        t = max(self.now + self.delay(), self._down.get(rank, 0.0))
        self._down[rank] = t
        self.at(t, self._arrive_rank, self.gen, fn, args)

    def _arrive_rank(self, gen: int, fn: Callable, args: tuple) -> None:
        if gen != self.gen:
            self.lost_frames += 1
            return
        fn(*args)

    # -- the coordinator ----------------------------------------------------------------

    def feed(self, cls, kw: dict) -> None:
        ev = cls(now=self.now, **kw)
        self.events.append(ev)
        self.state, cmds = step(self.state, ev)
        self.commands += len(cmds)
        if self._crashes and len(self.events) >= self._crashes[0]:
            self._crashes.pop(0)
            # Not after the event that ends the run: a finished run has nothing to restart
            # (recovery refuses it), and its summary is the one thing the test reads.
            if not any(isinstance(c, RunFinished) for c in cmds):
                self._crash()
                return  # journaled and stepped; its commands die with the process
        for c in cmds:
            self._execute(c)

    def _execute(self, c) -> None:
        if isinstance(c, Send):
            r = self.ranks[c.rank]
            self._to_rank(c.rank, r.on_control, c.control, self.incarnation)
        elif isinstance(c, Reply):
            r = self._by_route.get(c.route)
            if r is not None:
                self._to_rank(r.rank, r.on_hello_ack, c.ack, self.incarnation)
        elif isinstance(c, OpenRound):
            # "missing": expected minus got, kept as they change (a subset test per
            # contribution made a round of N ranks O(N^2)).
            self.round = {"cycle": c.cycle, "expected": set(c.ranks), "got": {}, "missing": set(c.ranks)}
        elif isinstance(c, ForgetRank):
            self.reducer_drop(c.rank)
        elif isinstance(c, SeedJoiner):
            if self.consensus_cycle is None:
                self.pending_seeds.append(c.rank)  # the next consensus seeds it
            else:
                self._seed(c.rank)
        elif isinstance(c, Notice):
            self.notices.append(c)
        elif isinstance(c, RunFinished):
            self.finished = c

    def _seed(self, rank: int) -> None:
        r = self.ranks[rank]
        self._to_rank(rank, r.on_seed, self.consensus_cycle, self.incarnation)

    def respawn(self, rank: int) -> None:
        """The agent starts the failed rank's process again: a new machine and incarnation."""
        old = self.ranks[rank]
        new = SimRank(self, rank, old.ms, generation=old.generation + 1)
        self.ranks[rank] = new
        del self._by_route[old.route]  # the old process's route reaches nobody any more
        self._by_route[new.route] = new
        self.respawns += 1
        new.hello()
        self.at(self.now + self.cfg.heartbeat_s, new.heartbeat)

    def _crash(self) -> None:
        self.down = True
        self.gen += 1
        self.round = None  # the reducer's open round dies with the process
        self.consensus_cycle = None  # ... and so does its latest consensus
        self.at(self.now + self.cfg.restart_after_s, self._restart)

    def _restart(self) -> None:
        """What ``flodl_coordinator.recovery`` does: replay the journal, restart the core."""
        rebuilt = replay(self.state.config, self.events)
        if self.cfg.check_replay and rebuilt != self.state:
            raise AssertionError(f"replay of {len(self.events)} journaled events differs from the state it had")
        self.state = rebuilt
        self.incarnation += 1
        self.down = False
        self.restarts += 1
        self.feed(CoordinatorRestarted, dict(incarnation=self.incarnation))
        backlog, self.backlog = self.backlog, []
        for cls, kw in backlog:
            if self.down:  # crashed again while catching up: the rest is lost
                self.lost_frames += 1
            else:
                self.feed(cls, kw)

    # -- the simulated reducer ------------------------------------------------------------
    def reducer_contribute(self, rank: int, cycle: int, weight: float) -> None:
        t = max(self.now + self.delay(), self._up.get(rank, 0.0))
        self._up[rank] = t
        self.at(t, self._arrive, self.gen, rank, cycle, weight)

    def _arrive(self, gen: int, rank: int, cycle: int, weight: float) -> None:
        rd = self.round
        if gen != self.gen or self.down:
            self.lost_frames += 1
            return
        if rd is None or rd["cycle"] != cycle or rank not in rd["expected"]:
            return
        rd["got"][rank] = weight
        rd["missing"].discard(rank)
        self._maybe_reduce()

    def reducer_drop(self, rank: int) -> None:
        if self.round is not None:
            self.round["expected"].discard(rank)
            self.round["got"].pop(rank, None)
            self.round["missing"].discard(rank)
            self._maybe_reduce()

    def _maybe_reduce(self) -> None:
        rd = self.round
        if rd is None or rd["missing"]:
            return
        self.round = None
        done = self.now + self.cfg.reduce_s_per_rank * max(1, len(rd["got"]))
        arrays = INCLUDED if sum(rd["got"].values()) > 0 else None  # total weight 0: keep local
        if arrays is not None:
            self.consensus_cycle = rd["cycle"]
            pending, self.pending_seeds = self.pending_seeds, []
            for rank in pending:
                self._seed(rank)
        # Sent once reduced: a frame sent to a rank meanwhile (a chunk, an extension) goes
        # ahead of it. (Its place on the link was taken at the reduce's start before, so
        # every command of a 1,024-rank reduce -- 0.5 s at 0.5 ms a contribution -- waited
        # behind a consensus not sent yet.)
        self.at(done, self._send_consensus, self.gen, rd["cycle"], arrays, self.incarnation, sorted(rd["got"]))

    def _send_consensus(self, gen: int, cycle: int, arrays: Any, incarnation: int, ranks: list[int]) -> None:
        if gen != self.gen:
            self.lost_frames += len(ranks)  # the coordinator died while reducing
            return
        for rank in ranks:
            self._to_rank(rank, self.ranks[rank].on_consensus, cycle, arrays, incarnation)

    # -- run ----------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.finished is None:
            if not self.down:
                self.feed(Tick, {})
            self.at(self.now + self.cfg.tick_s, self._tick)

    def run(self) -> Result:
        for r in self.ranks:
            t = self.cfg.hello_at.get(r.rank, 0.0)
            if t == float("inf"):
                continue  # never comes
            self.at(t, r.hello)
            self.at(t + self.cfg.heartbeat_s, r.heartbeat)
        self.at(self.cfg.tick_s, self._tick)
        while self._q and self.finished is None:
            t, _, fn, args = heapq.heappop(self._q)
            if t > self.cfg.max_virtual_s:
                break
            self.now = max(self.now, t)
            fn(*args)
        solo = sum(self.cfg.batch_size * 1000.0 / ms for ms in self.cfg.ms_per_batch)
        return Result(self.finished, self.now, self.events, self.commands, self.state, solo,
                      restarts=self.restarts, lost_frames=self.lost_frames, violations=self.violations,
                      respawns=self.respawns)  # fmt: skip


def simulate(cfg: SimConfig) -> Result:
    """Run one simulated training job to completion (or ``max_virtual_s``)."""
    return _World(cfg).run()
