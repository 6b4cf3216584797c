"""flodl_worker.collective: the rank's half of the collective data plane.

Theory of operation
-------------------
With ``RunSpec.plane = PLANE_COLLECTIVE`` the ranks average by all-reducing their
weighted parameters with ``torch.distributed`` (gloo on CPU tensors, NCCL on GPU
tensors). The coordinator never sees a tensor: it says *when* (``RequestParams{cycle}``,
exactly as on the bus) and *with whom* (``Rendezvous``, ``flodl.core._collective``).
``CollectiveAverager`` offers ``BusAverager``'s interface and reuses its snapshot, apply
and ack logic (``BusAverager.apply``, driven by the rank machine's ``ApplyConsensus``);
only the transport differs.

Generations. Every re-formation of the group is a new *generation*, announced in two
steps: ``Rendezvous{generation, store_addr=""}`` (to every member; the member with
``new_rank`` 0 is the store host: it starts -- or reuses -- a
``TCPStore(port=0, is_master=True, wait_for_workers=False)`` and answers
``Timing.store_ready{generation, addr}``), then ``Rendezvous{generation, store_addr}``:
every member builds a *new* process-group object on ``PrefixStore("flodl/g<gen>",
store)``, in a background thread (the constructor blocks until every member joined; the
rank keeps training and heartbeating meanwhile). No global default group is used, so
an abandoned generation never needs ``destroy_process_group`` while work is pending.

A ``RequestParams`` belongs to the latest generation announced before it (the core
announces a generation before any request in it, and one peer's frames arrive in
order). On it the rank snapshots exactly like the bus (n = steps since the last applied
average, w = n**gamma, a deep f32 copy), and, once its generation's group is formed,
launches an *asynchronous* all-reduce (SUM) of one flat f32 buffer
``[w*theta..., m*buffers..., w, m]`` (``m`` = the mover mass, 1 if the rank stepped:
the f32 buffers are an equal-weight mean over the ranks that moved,
``flodl_worker.buffers``) and goes back to training. With NCCL and a model on the GPU
the buffer is copied to the device once (one flat transfer) and reduced there. ``wait`` (called by the rank's pump instead of a plain socket
poll) watches the socket and a wake-up fd that the all-reduce's completion callback
writes, so a finished reduce is handled at once even while the rank is blocked waiting
for a plan or an ``Update``. On completion: W = the summed weights; consensus = sum / W;
handed to the machine (``rank.consensus_ready``), applied and acked exactly as a bus
consensus (theta <- consensus +
(theta - snapshot); EASGD blend under Async; buffers = their sum / M, overwritten).
W = 0 (nobody stepped): keep local.

Failure. A failed or abandoned all-reduce is a round this rank's work is not in: it
keeps its parameters and credit and acks the cycle with its last folded step (commits
nothing new; the round completes; a dead peer's uncommitted samples go back to the
survivors through the coordinator's ledger, coverage stays exactly once). It happens when

* gloo raises: a peer's connections closed (kill -9) or the timeout passed (a hung
  peer): the group is *broken*; the rank reports ``Timing.collective_failed{generation,
  cycle}`` and the coordinator re-forms the same members as a new generation (usually
  it has already heard of the death from the agent, and that report is then stale);
* a newer generation is announced while the reduce is pending: the rank abandons it.

An abandoned group cannot be destroyed while its work is pending (gloo's destructor
joins its threads: it would block until the timeout; ``abort``/``shutdown`` do not
cancel a gloo op), so it is parked until its work completes (fails at the timeout)
and, at exit, deliberately leaked so the process ends promptly. NCCL groups are
``abort()``-ed when abandoned (untested here: no GPU).

Known race (rare): around a death, some survivors may complete the all-reduce with
the dead rank's contribution inside while others fail it. Coverage is unaffected (the
dead rank's batches are never committed: it never acks) but those survivors' weights
then hold work that is retrained by whoever gets those samples back, and a survivor
that failed keeps its credit and contributes its window again next round. The next
round brings every survivor back to one consensus.

Coordinator restart. The restarted coordinator abandoned the open round and re-forms
the group as a new generation (``flodl.core._collective``). The rank's resync
(``flodl_worker.resync``) calls ``settle`` before handling the new incarnation's first
frame: a reduce that already completed is applied and acked (the ack is stale for the
new coordinator; the resync's ``folded_step`` carries it); then the machine's
``AbandonRounds`` (``abandon``) drops every request and reduce still pending *without*
an ack (its round is gone, like a
bus snapshot; the credit stays) and its group's work is parked. The generation the
coordinator announces next then retires the old group as usual.

Joining a running world (issue 12). A ``Rendezvous`` may name ranks joining in its
generation (``seed_ranks``): once that group forms, its *first* collective, before any
all-reduce, is a broadcast from ``new_rank`` 0 (an ACTIVE member: the coordinator never
makes a joiner the store host) of one flat f32 buffer ``[theta..., buffers...]`` copied
from its live tensors at that moment (``FlatStaging.gather``; every other member
receives into a buffer of the same size). Gloo matches collectives by order, so every
member issues it first, and no ``RequestParams`` comes before the joiner is a member (the
coordinator holds the rounds). A joiner named there that has not trained yet
(``accepts_seed``) loads it -- parameters and f32 buffers; its optimizer state stays the
fresh one, as on the bus -- and the machine answers ``Timing.seeded``; every other member
drops it. A failed broadcast is ``collective_failed{seeding=true}`` (the coordinator
re-forms; a joiner that keeps failing it is dropped); a broadcast pending when a newer
generation is announced is parked like an all-reduce. ``stats`` keeps its bytes and time.

A formation that fails is reported the same way (``cycle`` 0); the coordinator then
tries another store host, and ends the run once none works (``flodl.core._collective``)
rather than letting it train on without ever averaging.

Failpoint (tests only): ``FLODL_FAULT=exit_in_collective:CYCLE[@RANK]`` SIGKILLs the
rank as it launches the all-reduce of ``CYCLE``, before its contribution leaves: its peers
are blocked in that reduce, which cannot complete.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import zmq

from flodl.wire import pb

from flodl.rank import SeedApplied, TakeSnapshot

from .averaging import BusAverager
from .buffers import mover_mass

__all__ = ["CollectiveAverager", "BACKENDS", "STORE_PREFIX", "new_group"]

log = logging.getLogger("flodl.rank")

BACKENDS = ("gloo", "nccl")
STORE_PREFIX = "flodl/g"  # the coordinator's _collective.STORE_PREFIX
DEFAULT_TIMEOUT_S = 60.0  # a Rendezvous without timeout_s (the coordinator's default)


def new_group(backend: str, store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A fresh process-group backend object (not registered as torch's default group)."""
    import torch.distributed as dist

    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":  # untested here (no GPU); the build must have NCCL
        cls = getattr(dist, "ProcessGroupNCCL", None)
        if cls is None:
            raise RuntimeError("backend nccl: this torch build has no NCCL (use gloo, or a CUDA build)")
        opts = cls.Options()
        opts._timeout = timeout
        return cls(store, rank, size, opts)
    raise ValueError(f"unknown collective backend {backend!r} (one of {BACKENDS})")


def _default_store_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _leak(*objs: Any) -> None:
    """Never destroy ``objs``: their destructors would block on pending collective work."""
    for o in objs:
        if o is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))


@dataclass
class _Forming:
    """One background group construction; the thread fills it in, then sets ``done``."""

    generation: int
    started: float
    group: Any = None
    error: str = ""
    done: bool = False


@dataclass
class _Generation:
    number: int
    rank: int  # dense rank in this generation
    size: int
    backend: str
    timeout: timedelta
    store_addr: str = ""
    forming: _Forming | None = None
    group: Any = None  # formed backend
    broken: str = ""  # why the group failed ("" = usable)
    seed_ranks: tuple = ()  # global ranks joining in this generation: the group's first op seeds them
    seed_cycle: int = 0


@dataclass
class _Op:
    cycle: int
    generation: int
    work: Any
    future: Any  # work.get_future(): done (and its callbacks run) before work.is_completed()
    buf: torch.Tensor
    group: Any
    launched: float

    def done(self) -> bool:
        return self.future.done()


@dataclass
class _Seed:
    """The broadcast that seeds a generation's joiners (``load``: this rank is one)."""

    generation: int
    cycle: int
    load: bool
    work: Any
    future: Any
    buf: torch.Tensor
    group: Any
    launched: float

    def done(self) -> bool:
        return self.future.done()


@dataclass
class _Stats:
    reduced: int = 0  # all-reduces completed and applied
    failed: int = 0  # raised (peer gone, timeout)
    abandoned: int = 0  # superseded by a newer generation while pending
    skipped: int = 0  # requests acked without a reduce (stale or broken generation)
    formed: int = 0
    reduce_s: float = 0.0  # launch -> completion seen, summed over applied reduces
    form_s: list = field(default_factory=list)
    seed_broadcasts: int = 0  # seed broadcasts completed (sent, relayed or loaded)
    seed_bytes: int = 0  # their f32 payload, summed
    seed_s: list = field(default_factory=list)  # launch -> completion seen, each
    seeded: bool = False  # this rank loaded a seed broadcast


class CollectiveAverager(BusAverager):
    """``BusAverager``'s interface over torch.distributed all-reduces.

    ``rank`` is the owning shell (``flodl_worker.rank._Rank`` or a test double with
    ``cfg``, ``spec``, ``params``, ``m``, ``sock``, ``consensus_ready``, ``_timing`` and
    ``_drop``).
    """

    def __init__(self, rank) -> None:
        super().__init__(rank)
        self.gen: _Generation | None = None
        self.requests: deque[tuple[int, int]] = deque()  # (cycle, generation) not launched yet
        self.ops: deque[_Op] = deque()  # launched, in launch order
        self.parked: list[Any] = []  # abandoned ops (_Op, _Seed) with work still pending
        self.seed: _Seed | None = None  # the current generation's seed broadcast, pending
        self.store = None  # the TCPStore this rank hosts (once it was a store host)
        self.store_addr = ""
        self.stats = _Stats()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.poller = zmq.Poller()
        self.poller.register(rank.sock, zmq.POLLIN)
        self.poller.register(self._wake_r.fileno(), zmq.POLLIN)

    # -- the rank's pump ------------------------------------------------------------------

    def wait(self, timeout_ms: int) -> bool:
        """Progress, then wait up to ``timeout_ms`` for the socket or a finished
        collective; True when the socket has frames to read."""
        self.progress()
        events = dict(self.poller.poll(max(0, timeout_ms)))
        if self._wake_r.fileno() in events:
            self._drain_wake()
            self.progress()
        return self.rank.sock in events

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(256):
                pass
        except OSError:
            pass

    # -- control ------------------------------------------------------------------------

    def on_rendezvous(self, m: pb.Control.Rendezvous) -> None:
        r = self.rank
        cur = self.gen.number if self.gen is not None else 0
        if m.generation < cur or m.generation == 0:
            log.debug("stale rendezvous for generation %d (current %d)", m.generation, cur)
            return
        if m.generation > cur:
            backend = m.backend or "gloo"
            if backend not in BACKENDS or m.new_world_size < 1 or m.new_rank >= m.new_world_size:
                r._drop("bad_rendezvous", f"rendezvous {m.generation}: backend {backend!r}, rank {m.new_rank} of {m.new_world_size}")
                return
            self.progress()  # what already finished in the old generation counts
            self._retire(f"generation {m.generation} announced")
            timeout = timedelta(seconds=m.timeout_s if m.timeout_s > 0 else DEFAULT_TIMEOUT_S)
            self.gen = _Generation(m.generation, m.new_rank, m.new_world_size, backend, timeout,
                                   seed_ranks=tuple(m.seed_ranks), seed_cycle=m.seed_cycle)  # fmt: skip
            log.info("collective generation %d: rank %d of %d (%s)", m.generation, m.new_rank, m.new_world_size, backend)
            self.progress()  # requests of older generations are answered now
        gen = self.gen
        if not m.store_addr:
            if gen.rank == 0:
                self._serve_store(gen)
            return
        if gen.store_addr or gen.broken:
            return  # a duplicate
        gen.store_addr = m.store_addr
        self._start_forming(gen)

    def take(self, cmd: TakeSnapshot) -> None:
        """``TakeSnapshot``: the snapshot, bound to the latest generation announced."""
        self._snapshot(cmd)
        self.requests.append((cmd.cycle, self.gen.number if self.gen is not None else 0))
        self.progress()

    def on_consensus(self, header: pb.RoundHeader, blobs: list) -> None:
        self.rank._drop("unexpected_round", f"a bus round (cycle {header.cycle}) on the collective plane")

    # -- progress -----------------------------------------------------------------------

    def progress(self) -> None:
        """Non-blocking: finish a formation, launch what can go, apply what completed."""
        gen = self.gen
        if gen is not None and gen.forming is not None and gen.forming.done:
            self._formed(gen)
        if self.seed is not None and self.seed.done():
            seed, self.seed = self.seed, None
            self._seeded(seed)
        while self.requests:
            cycle, g = self.requests[0]
            if gen is None or g < gen.number or gen.broken:
                self.requests.popleft()
                self.stats.skipped += 1
                why = "its generation was replaced" if gen is not None and g < gen.number else "no usable group"
                log.info("cycle %d: %s; keeping local parameters", cycle, why)
                self._skip(cycle)
            elif gen.group is not None:
                self.requests.popleft()
                self._launch(cycle, gen)
            else:
                break  # the group is still forming: launch when it is
        while self.ops and self.ops[0].done():
            self._completed(self.ops.popleft())
        if self.parked:
            self.parked = [op for op in self.parked if not op.done()]

    def _skip(self, cycle: int) -> None:
        self.rank.consensus_ready(cycle, None)

    def _launch(self, cycle: int, gen: _Generation) -> None:
        snap = self.snapshots[cycle]
        buf = _flatten(snap.flat, self.staging.offsets[len(snap.pre)], snap.weight)
        live = self.staging.tensors
        if gen.backend == "nccl" and live and live[0].is_cuda:
            # The snapshot's values (the launch may come steps after it, once the group
            # formed), reduced on the GPU: one flat host-to-device copy.
            buf = buf.to(live[0].device)
        if self.rank.cfg.fault_exit_cycle == cycle:  # FLODL_FAULT failpoint (tests)
            # At the launch, before its contribution can leave: killed once it had gone, a
            # reduce its peers were already waiting in could complete with it (a suite run
            # saw the survivors' reduce of that cycle succeed), and nothing failed.
            log.warning("FLODL_FAULT: killing this rank inside the all-reduce of cycle %d", cycle)
            os.kill(os.getpid(), signal.SIGKILL)
        work = gen.group.allreduce([buf])
        future = work.get_future()
        self.ops.append(_Op(cycle, gen.number, work, future, buf, gen.group, time.perf_counter()))
        # Wakes ``wait`` (the future is done by then). The callback runs on gloo's worker
        # thread and must hold nothing but the socket: were it to drop the last reference
        # to this averager there, the group's destructor would join its own thread.
        future.add_done_callback(_waker(self._wake_w))

    def _completed(self, op: _Op) -> None:
        snap = self.snapshots[op.cycle]
        try:
            op.future.value()  # done: raises at once if the reduce failed
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError & co.
            reason = _one_line(e)
            self.stats.failed += 1
            log.warning("cycle %d: all-reduce failed in generation %d: %s; keeping local parameters", op.cycle, op.generation, reason)
            self.rank.consensus_ready(op.cycle, None)
            self._broken(op.generation, op.cycle, reason)
            return
        self.stats.reduced += 1
        self.stats.reduce_s += time.perf_counter() - op.launched
        out = op.buf.detach().to("cpu").numpy()
        total = float(out[-2])
        arrays = _unflatten(out, self.staging, len(snap.pre)) if total > 0 else None
        self.rank.consensus_ready(op.cycle, arrays)

    def _launch_seed(self, gen: _Generation) -> None:
        """The formed group's first collective: the seed broadcast from ``new_rank`` 0."""
        import torch.distributed as dist

        if gen.rank == 0:
            buf = torch.from_numpy(self.staging.gather())  # the live parameters and buffers, now
        else:
            buf = torch.empty(self.staging.total, dtype=torch.float32)
        live = self.staging.tensors
        if gen.backend == "nccl" and live and live[0].is_cuda:
            buf = buf.to(live[0].device)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        work = gen.group.broadcast([buf], opts)
        future = work.get_future()
        load = self.rank.cfg.rank in gen.seed_ranks
        self.seed = _Seed(gen.number, gen.seed_cycle, load, work, future, buf, gen.group, time.perf_counter())
        future.add_done_callback(_waker(self._wake_w))
        log.info("generation %d: seed broadcast for joiner(s) %s launched (%d bytes, %s)", gen.number,
                 list(gen.seed_ranks), buf.numel() * 4, "loading it" if load else "from here" if gen.rank == 0 else "relaying")  # fmt: skip

    def _seeded(self, seed: _Seed) -> None:
        try:
            seed.future.value()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError & co.
            reason = _one_line(e)
            log.warning("generation %d: the seed broadcast failed: %s", seed.generation, reason)
            self._broken(seed.generation, 0, reason, seeding=True)
            return
        took = time.perf_counter() - seed.launched
        s = self.stats
        s.seed_broadcasts += 1
        s.seed_bytes += seed.buf.numel() * 4
        s.seed_s.append(round(took, 4))
        r = self.rank
        if not seed.load:
            return
        if not r.m.accepts_seed():  # seeded by an earlier generation and training since
            log.info("generation %d: seed broadcast dropped: this rank already trains", seed.generation)
            return
        views = self.staging.views(seed.buf.detach().to("cpu").numpy())
        n = len(r.params)
        self.load_seed(views[:n], views[n:])
        s.seeded = True
        log.info("joined the running world: parameters and buffers from the generation %d broadcast in %.3fs (%d bytes)",
                 seed.generation, took, seed.buf.numel() * 4)  # fmt: skip
        r.feed(SeedApplied(cycle=seed.cycle))

    def _broken(self, generation: int, cycle: int, reason: str, seeding: bool = False) -> None:
        """The group of ``generation`` failed here: stop using it; the coordinator re-forms."""
        gen = self.gen
        if gen is None or gen.number != generation or gen.broken:
            return  # an older generation (already replaced), or already reported
        gen.broken = reason
        for op in list(self.ops):  # the rest of this group's work cannot be trusted either
            if op.generation == generation:
                self.ops.remove(op)
                self._park(op)
        if self.seed is not None and self.seed.generation == generation:
            seed, self.seed = self.seed, None
            if not seed.done():
                self.parked.append(seed)
        failed = pb.CollectiveFailed(generation=generation, cycle=cycle, reason=reason, seeding=seeding)
        self.rank._timing(collective_failed=failed)
        self.progress()  # queued requests of this generation: acked without a reduce

    def _park(self, op: _Op) -> None:
        """Abandon ``op``: ack its cycle without a reduce; keep its group alive until done."""
        self.stats.abandoned += 1
        self.rank.consensus_ready(op.cycle, None)
        if not op.done():
            self.parked.append(op)
            if self.gen is not None and self.gen.backend == "nccl":
                _abort(op.group)

    def _retire(self, why: str) -> None:
        """A newer generation was announced: abandon everything of the current one."""
        for op in list(self.ops):
            self.ops.remove(op)
            log.info("cycle %d: all-reduce abandoned (%s); keeping local parameters", op.cycle, why)
            self._park(op)
        if self.seed is not None:  # its generation is gone: the next one seeds again
            seed, self.seed = self.seed, None
            log.info("generation %d: seed broadcast abandoned (%s)", seed.generation, why)
            if not seed.done():
                self.parked.append(seed)
        # A formation still running finishes (or fails) in its thread; its result is dropped.

    def settle(self) -> None:
        """Before a coordinator restart is handled: apply the reduces that completed."""
        while self.ops and self.ops[0].done():
            self._completed(self.ops.popleft())

    def on_coordinator_restart(self) -> int:
        """``settle``, then ``abandon`` every pending cycle; returns how many were dropped."""
        self.settle()
        dropped = len(self.snapshots)
        self.abandon(tuple(self.snapshots))
        return dropped

    def abandon(self, cycles) -> None:
        """The coordinator restarted (see the module doc): drop every pending request and
        reduce without an ack (the machine names the snapshots it dropped: all of them)."""
        for op in list(self.ops):
            self.ops.remove(op)
            self.stats.abandoned += 1
            log.info("cycle %d: all-reduce abandoned (the coordinator restarted); keeping local parameters", op.cycle)
            if not op.done():
                self.parked.append(op)
                if self.gen is not None and self.gen.backend == "nccl":
                    _abort(op.group)
        self.stats.skipped += len(self.requests)
        self.requests.clear()
        self.snapshots.clear()

    # -- formation ----------------------------------------------------------------------

    def _serve_store(self, gen: _Generation) -> None:
        try:
            if self.store is None:
                from torch.distributed import TCPStore

                host = self.rank.cfg.store_host or _default_store_host()
                self.store = TCPStore(host, 0, None, True, gen.timeout, wait_for_workers=False)
                self.store_addr = f"{host}:{self.store.port}"
                log.info("hosting the collective store at %s", self.store_addr)
        except Exception as e:  # noqa: BLE001 - a port/bind problem: the group cannot form here
            self._broken(gen.number, 0, f"cannot start the store: {_one_line(e)}")
            return
        self.rank._timing(store_ready=pb.StoreReady(generation=gen.number, addr=self.store_addr))

    def _start_forming(self, gen: _Generation) -> None:
        f = _Forming(generation=gen.number, started=time.perf_counter())
        gen.forming = f
        own = self.store if gen.store_addr == self.store_addr else None
        args = (f, gen.store_addr, own, gen.backend, gen.rank, gen.size, gen.timeout, _waker(self._wake_w))
        threading.Thread(target=_form, args=args, name=f"flodl-group-g{gen.number}", daemon=True).start()

    def _formed(self, gen: _Generation) -> None:
        f, gen.forming = gen.forming, None
        if f.error:
            log.warning(
                "collective generation %d did not form at %s: %s (check FLODL_STORE_HOST, GLOO_SOCKET_IFNAME "
                "and that every rank can reach the others)", gen.number, gen.store_addr, f.error,
            )
            self._broken(gen.number, 0, f"formation: {f.error}")
            return
        gen.group = f.group
        took = time.perf_counter() - f.started
        self.stats.formed += 1
        self.stats.form_s.append(round(took, 4))
        log.info("collective generation %d formed (rank %d of %d) in %.3fs", gen.number, gen.rank, gen.size, took)
        if gen.seed_ranks:  # before any all-reduce: gloo pairs collectives by order
            self._launch_seed(gen)

    # -- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what can be released; leak groups whose work is still pending."""
        s = self.stats
        log.info(
            "collective: %d reduce(s) in %.3fs, %d failed, %d abandoned, %d skipped, %d group(s) formed %s, "
            "%d seed broadcast(s) %s (%d bytes)",
            s.reduced, s.reduce_s, s.failed, s.abandoned, s.skipped, s.formed, s.form_s,
            s.seed_broadcasts, s.seed_s, s.seed_bytes,
        )
        pending = [op for op in list(self.ops) + self.parked + [self.seed] if op is not None and not op.done()]
        for op in pending:
            _leak(op.group, op.work, op.future, op.buf)
        if pending and self.gen is not None:
            _leak(self.gen.group)
        self.ops.clear()
        self.parked.clear()
        self.seed = None
        self.poller.unregister(self._wake_r.fileno())
        self._wake_r.close()
        self._wake_w.close()


def _waker(sock: socket.socket):
    """A callable for other threads that wakes the rank's pump (holds only ``sock``)."""

    def wake(*_: Any) -> None:
        try:
            sock.send(b"x")
        except OSError:  # full (a wake-up is already pending) or closed at exit
            pass

    return wake


def _form(f: _Forming, addr: str, own: Any, backend: str, rank: int, size: int, timeout: timedelta, wake) -> None:
    """Formation thread: build the group of ``f.generation`` (blocks until all joined)."""
    try:
        from torch.distributed import PrefixStore, TCPStore

        if own is not None:
            store = own
        else:
            host, _, port = addr.rpartition(":")
            store = TCPStore(host.strip("[]"), int(port), None, False, timeout)
        f.group = new_group(backend, PrefixStore(f"{STORE_PREFIX}{f.generation}", store), rank, size, timeout)
    except BaseException as e:  # noqa: BLE001 - reported to the main thread
        f.error = _one_line(e)
    finally:
        f.done = True
        wake()


def _flatten(flat: np.ndarray, nparams: int, weight: float) -> torch.Tensor:
    """One f32 buffer ``[w * theta..., m * buffers..., w, m]`` from the snapshot's flat
    host copy (``nparams`` of its elements are parameters); zeros and 0, 0 when idle."""
    n = flat.size
    buf = np.empty(n + 2, dtype=np.float32)
    mover = mover_mass(weight)
    if weight > 0:
        np.multiply(flat[:nparams], np.float32(weight), out=buf[:nparams])
        buf[nparams:n] = flat[nparams:]  # x mover = 1
    else:
        buf[:n] = 0.0
    buf[n], buf[n + 1] = weight, mover
    return torch.from_numpy(buf)


def _unflatten(buf: np.ndarray, staging, nparams: int) -> list:
    """Divide the reduced sums once: parameters by the summed weight W, f32 buffers by
    the summed mover mass M (left out when M = 0: kept local); split into the layout."""
    total, movers = buf[-2], buf[-1]
    k = staging.offsets[nparams]
    flat = np.empty(buf.size - 2, dtype=np.float32)
    np.divide(buf[:k], total, out=flat[:k])
    views = staging.views(flat)
    if movers <= 0:
        return views[:nparams]
    np.divide(buf[k:-2], movers, out=flat[k:])
    return views


def _abort(group: Any) -> None:
    fn = getattr(group, "abort", None)
    if fn is not None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            log.warning("abort of an abandoned group failed: %s", _one_line(e))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
