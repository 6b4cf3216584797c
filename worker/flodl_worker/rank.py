"""flodl_worker.rank: the torch-native rank runtime.

Theory of operation
-------------------
A rank is one process, one thread and one DEALER socket (docs/protocol.md, "Rank life
cycle"). Nothing here runs in the background: the main loop trains a batch, then drains
whatever the coordinator sent without blocking, and only ever *blocks* (waiting for a
plan, throttled at a barrier) inside ``_wait_until``, which polls the socket with a
timeout so that heartbeats and the liveness check run on every pass — silence is
exactly when they are needed.

What the rank *decides* (plans, throttle, credit and folded step, checkpoint arming,
the resync report) is the sans-IO rank machine's, ``flodl.rank.RankMachine``, the same
one the simulator drives: this module decodes frames into its events (``IncarnationSeen``,
``ControlReceived``, ``ConsensusReady``, ``BatchTrained``), asks it what to train next
(``next_action``) and carries out its commands with torch and the socket
(``flodl_worker.shell``).

1. hello -> hello_ack. The model signature (sha256 over parameter names, shapes and
   dtypes) goes in the hello, but the seed that initialises the weights comes back in
   the ack's RunSpec. So the model is built twice: once under ``manual_seed(0)`` as a
   probe for the signature (then dropped), and again under ``manual_seed(spec.seed)``
   after admission, so every rank starts bit-identical. Afterwards the torch RNG is
   re-seeded per rank (``seed + 1 + rank``) so that dropout & co. differ across ranks.
2. Plans (the machine's): ``StartEpoch``/``Update.next_plan`` queue a range of
   positions of the epoch permutation, FIFO; ``ExtendPartition`` appends a segment.
3. Averaging (``flodl_worker.averaging``): ``RequestParams{cycle}`` snapshots and sends
   the weighted parameters and f32 buffers (``flodl_worker.buffers``); the consensus
   ``round{cycle}`` is applied and acked. On the
   collective plane (``RunSpec.plane``) ``flodl_worker.collective`` all-reduces instead,
   in the process group the ``Rendezvous`` commands form; the pump also wakes on a
   finished all-reduce.
4. ``Throttle`` stops training until ``Update`` (or Shutdown); everything else is still
   serviced, and an exhausted plan still reports its ``metrics`` while throttled.
5. ``Checkpoint`` for this rank (``flodl_worker.checkpoint_duty``). A
   ``RunSpec.resume_from`` is loaded right after the model and optimizer are built,
   before the first step; a file that does not load exits 2.
6. ``ExecuteEval`` for this rank runs ``eval_fn`` and answers ``eval_result`` (the final
   one with ``save_model_path`` also writes the evaluated model there: ``output``);
   ``EpochAggregated`` runs ``epoch_fn`` on the rank ``SetEpochCallbackRole`` named and
   answers ``epoch_fn_elapsed``.
7. ``Shutdown``/``ShutdownWithSave`` -> ``timing.exiting{sha256 of the f32 params and
   f32 buffers, steps}``, exit 0. ``Exiting`` is never sent on an error exit.
8. A frame of another coordinator incarnation (the coordinator restarted on its
   journal): ``timing.resync`` first, with what the new process may have lost
   (``flodl_worker.resync``); training goes on.
9. Time accounting (``flodl.rank.TimeAccount``): from the runtime's import on, every
   second goes to one cause -- start-up until the first step; training (calibration
   for the first window of cadence/async, before any consensus); the machine's
   averaging, checkpoint and eval commands while they run; waits are barrier, or
   recovery after a DeclareDead, a re-formed group or a restart, until the next
   consensus. The totals ride on every heartbeat and on Exiting (``time_account``); a
   timing frame sent once a heartbeat is due (a batch report) is that heartbeat.

Around each step: the batch of the machine's ``TrainBatch`` comes from
``flodl_worker.loader`` (inline, or worker processes prefetching along the plans), is
moved to the rank's device (``flodl_worker.device``: the model is built there), and the
LR schedule, if any, is set from the run's progress (``flodl_worker.run_progress``).

Exit codes: 0 clean shutdown; 1 failure (the coordinator went silent or unreachable,
the user's code raised); 2 configuration error or refused at hello.

A bad frame from the coordinator is dropped, counted under its reason and logged once
per reason; it never crashes the rank.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
import traceback
from dataclasses import replace
from collections import Counter
from typing import Any, Callable, Mapping, NoReturn

import numpy as np
import torch
import zmq

from flodl.fsutil import describe_write_error
from flodl.limits import zmq_maxmsgsize
from flodl.procutil import exit_now
from flodl.rank import (
    WAIT_PLAN,
    WAIT_THROTTLE,
    Admitted,
    ApplyConsensus,
    BatchTrained,
    ControlReceived,
    Drop,
    Exit,
    HeartbeatDue,
    IncarnationSeen,
    RankMachine,
    RunEpochFn,
    RunEval,
    SaveCheckpoint,
    SendMetrics,
    TakeSnapshot,
    TimeAccount,
    TrainBatch,
)
from flodl.shuffle import epoch_permutation
from flodl.wire import (
    Endpoint,
    RouteMismatch,
    SeqTracker,
    WireError,
    decode,
    pb,
    split_routing,
)

from ._env import EnvError, RankEnv
from .averaging import BusAverager
from .buffers import averaged_buffers
from .collective import CollectiveAverager
from .checkpoint import CheckpointLoadError, load_model_file
from .checkpoint_duty import CheckpointDuty
from .device import DeviceError, choose_device, to_device
from .loader import BatchLoader
from .output import save_output_model
from .params import gamma_mass, model_signature, param_digest
from .run_progress import Progress, ProgressClock
from .run_world import set_world_size
from .shell import MachineShell

__all__ = [
    "run_rank",
    "rank_main",
    "model_signature",
    "param_digest",
    "gamma_mass",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_CONFIG",
]

log = logging.getLogger("flodl.rank")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2

# Bounded linger: the last frames (Exiting, a final sync_ack) get this long to leave on
# close; a vanished coordinator can never hold the process open for longer.
LINGER_MS = 2_000
# Outbound queue bound, in messages. A rank sends one timing frame per step (~100 B) and
# one round per cycle; 10k is minutes of backlog. When it is full for the whole send
# timeout the coordinator is not reading: that is a failure, not a reason to hang.
SNDHWM = 10_000
RCVHWM = 10_000
# Used when the RunSpec leaves them 0 (proto3 cannot tell "unset" from 0): the
# coordinator's own defaults.
DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_LIVENESS_S = 10.0
# Frames handled per pump before training (or the timers) get the thread back: a
# flooding peer slows a rank down, it cannot starve it.
DRAIN_BATCH = 256
# An unanswered hello is sent again this often: a coordinator restarted from its journal
# may have lost it (a hello from the same process is answered again, not refused).
HELLO_RESEND_S = 5.0
HELLO_WARN_S = 5.0  # no answer this long: say what is probably wrong (and keep trying)
HELLO_REWARN_S = 30.0
# The rank's wall time is accounted from here (flodl.rank.TimeAccount): importing the
# runtime is the first thing a rank script does, so its dataset and model set-up count
# as start-up.
_STARTED = time.monotonic()


# Commands whose time is not training: charged to their cause while they run.
_CAUSE_OF = {
    TakeSnapshot: "averaging",
    ApplyConsensus: "averaging",
    SaveCheckpoint: "checkpoint",
    RunEval: "eval",
    RunEpochFn: "eval",
}


class _Shutdown(Exception):
    """The coordinator said Shutdown/ShutdownWithSave: leave the loop cleanly."""


class _Refused(Exception):
    """hello_ack refused us, or the RunSpec cannot work with this rank: exit 2."""


class _Abort(Exception):
    """The rank cannot go on (coordinator silent/unreachable): exit 1, no Exiting."""


# ---------------------------------------------------------------------------------------
# The runtime
# ---------------------------------------------------------------------------------------


class _Rank(MachineShell):
    def __init__(
        self, cfg: RankEnv, model_fn, optimizer_fn, step_fn, dataset, eval_fn, task: str, epoch_fn=None, *,
        lr_schedule=None, device="auto", num_workers: int = 0, prefetch: int | None = None,
    ):  # fmt: skip
        try:
            self.device = choose_device(device, cfg.local_rank)
        except DeviceError as e:
            raise _Refused(str(e)) from None
        if num_workers < 0 or (prefetch is not None and prefetch < 1):
            raise _Refused(f"num_workers={num_workers} must be >= 0 and prefetch={prefetch} >= 1")
        self.num_workers, self.prefetch = num_workers, prefetch
        self.loader: BatchLoader | None = None  # started once admitted (the permutation's seed)
        self.cfg = cfg
        self.model_fn, self.optimizer_fn, self.step_fn = model_fn, optimizer_fn, step_fn
        self.dataset, self.eval_fn, self.task = dataset, eval_fn, task
        self.epoch_fn = epoch_fn
        self.epoch_role: int | None = None  # SetEpochCallbackRole: who runs epoch_fn
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        # Options before connect. A random identity per process: a restarted rank is a
        # new peer to the ROUTERs, never confused with its previous life.
        who = b"%d" % cfg.rank if cfg.pinned else b"u%d" % cfg.local_rank  # (cosmetic: routes are opaque)
        self.sock.setsockopt(zmq.IDENTITY, b"rank-%s-%s" % (who, secrets.token_hex(8).encode()))  # unguessable: ROUTER_HANDOVER
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.MAXMSGSIZE, zmq_maxmsgsize(cfg.max_message_bytes))  # per part (flodl.limits)
        self.sock.setsockopt(zmq.SNDTIMEO, int(DEFAULT_LIVENESS_S * 1000))
        if cfg.curve is not None:  # dialing the coordinator directly, over CURVE
            cfg.curve.apply(self.sock)
        try:
            self.sock.connect(cfg.connect)
        except zmq.ZMQError as e:
            self.sock.close(0)
            self.ctx.term()
            raise _Refused(f"cannot dial FLODL_CONNECT={cfg.connect!r}: {e}") from None
        # Unpinned: frames name rank 0 until the ack gives the slot (``_take_slot``).
        self.ep = Endpoint(
            cfg.session, pb.Sender.KIND_RANK, rank=max(cfg.rank, 0), host=cfg.host, incarnation=secrets.randbits(63)
        )
        self.seq = SeqTracker()
        self.drops: Counter = Counter()
        self.spec: pb.RunSpec | None = None
        self._hello_deadline = float("inf")  # set by hello(); a deferred ack moves it
        self._deferred_reason = ""
        self._hello_resent = False  # the answer came to a repeated hello (flodl.rank.Admitted)
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.params: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []  # the f32 buffers rounds average (flodl_worker.buffers)
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self.liveness_s = DEFAULT_LIVENESS_S
        self.last_heard = time.monotonic()
        self.next_heartbeat = 0.0
        self.m = RankMachine(max(cfg.rank, 0))  # what the rank decides (flodl.rank)
        # Where the wall time goes, by cause; reported on heartbeats and on Exiting.
        self.account = TimeAccount(min(_STARTED, time.monotonic()))
        self._trained = False  # a first batch trained: waits are barriers, no longer start-up
        self._consensus_seen = False  # a consensus applied: training is no longer calibration
        self._recovering = False  # a death or a restart was heard: waits are recovery until the next consensus
        self.averager = BusAverager(self)
        self.collective: CollectiveAverager | None = None  # the averager too, on the collective plane
        self.checkpoints = CheckpointDuty(self)
        # epoch -> permutation, the last two (a prefetch reaches into the next epoch).
        self.perms: dict[int, np.ndarray] = {}
        self.trace = None
        self.lr_trace = None  # every LR the schedule set (tests audit that ranks end alike)
        self.clock = ProgressClock(self.m, lambda: self.optimizer, lr_schedule, None)
        if cfg.pinned:
            self._open_traces()

    def _open_traces(self) -> None:
        """The trace files, named by rank (an unpinned rank opens them once admitted)."""
        cfg = self.cfg
        if cfg.trace_dir:
            os.makedirs(cfg.trace_dir, exist_ok=True)
            self.trace = open(os.path.join(cfg.trace_dir, f"rank{cfg.rank}.trace"), "a", encoding="ascii")
            if self.clock.schedule is not None:
                self.lr_trace = open(os.path.join(cfg.trace_dir, f"rank{cfg.rank}.lr"), "a", encoding="ascii")
                self.clock.trace = self.lr_trace

    def _take_slot(self, rank: int, world: int) -> None:
        """An unpinned rank is the slot its ack names: every later frame says so."""
        if not 0 <= rank < world:
            raise _Refused(f"the coordinator gave this rank slot {rank}, outside its world of {world}")
        self.cfg = replace(self.cfg, rank=rank)
        self.m.rank = rank
        self.ep.sender.rank = rank
        self.ep.session = self.ep.session  # (re-serialises the envelope's fixed fields)
        self._open_traces()
        log.info("admitted as rank %d (FLODL_RANK unset: the slot the coordinator gave it)", rank)

    @property
    def local_step(self) -> int:
        return self.m.local_step

    # -- sending ------------------------------------------------------------------------

    def _send(self, body_field: str, body, blobs=()) -> None:
        if body_field == "metrics" and body.batches:  # a report too (protocol 1.3): maybe the heartbeat
            account = self._beat_account()
            if account is not None:
                body.time_account.CopyFrom(account)
        try:
            self.sock.send_multipart(self.ep.frames(body_field, body, blobs), copy=not blobs)
        except zmq.Again:
            raise _Abort(
                f"cannot queue a frame to the coordinator at {self.cfg.connect} for "
                f"{self.liveness_s:g}s (its queue is full: it is not reading)"
            ) from None

    def _timing(self, **event) -> None:
        """A timing frame; once a heartbeat is due, this frame is it: the time account
        rides on it and the next heartbeat is an interval away. A rank that reports its
        batches sends no heartbeat frames of its own (every frame is liveness to the
        coordinator): at 1,024 ranks those were a tenth of the frames it handled."""
        account = self._beat_account()
        if account is not None and "time_account" not in event:
            event["time_account"] = account
        self._send("timing", pb.Timing(rank=self.cfg.rank, **event))

    def _beat_account(self) -> "pb.TimeAccount | None":
        """Once a heartbeat is due, the report going out is it: the time account to put on
        it, and the next heartbeat an interval away; None while none is due."""
        now = time.monotonic()
        if self.spec is None or now < self.next_heartbeat:
            return None
        self.next_heartbeat = now + self.heartbeat_s
        return self.account.to_pb(now)

    # -- receiving ----------------------------------------------------------------------

    def _drop(self, reason: str, detail: str) -> None:
        self.drops[reason] += 1
        if self.drops[reason] == 1:
            log.warning("dropped a frame from the coordinator (%s): %s; later ones are only counted", reason, detail)

    def _pump(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for traffic, then handle what is queued (bounded)."""
        # Collective plane: the averager's wait also wakes on a finished all-reduce.
        ready = self.collective.wait(timeout_ms) if self.collective is not None else self.sock.poll(timeout_ms, zmq.POLLIN)
        if not ready:
            return
        for _ in range(DRAIN_BATCH):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                _route, payload = split_routing(frames)
                d = decode(payload, session=self.cfg.session)
                if d.envelope.sender.kind != pb.Sender.KIND_COORDINATOR:
                    raise RouteMismatch(f"sender kind {d.envelope.sender.kind} is not the coordinator")
                self.seq.check(d.envelope)
            except WireError as e:
                self._drop(e.reason, e.detail)
                continue
            inc = d.envelope.sender.incarnation
            if self.m.is_restart(inc):
                self.averager.settle()  # a reduce that completed counts in the report
                self._recovering = self._trained  # waits until the next consensus are the restart's cost
            # A restarted coordinator: the resync report goes first (or a stale frame is dropped).
            seen = self.feed(IncarnationSeen(incarnation=inc, hello_ack=d.envelope.HasField("hello_ack")))
            if any(type(c) is Drop for c in seen):
                continue
            self.last_heard = time.monotonic()
            self._dispatch(d.envelope, d.blobs)

    def _wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Block (servicing every message, heartbeating) until ``done()``.

        The coordinator counts as silent from the later of the last frame heard and the
        start of this wait, so a long stretch of training (during which it may rightly
        say nothing) is never mistaken for silence.
        """
        started = time.monotonic()
        while not done():
            now = time.monotonic()
            self.account.enter(self._wait_cause(), now)  # (a death heard meanwhile: recovery from then on)
            self._heartbeat_if_due(now)
            deadline = max(self.last_heard, started) + self.liveness_s
            if now >= deadline:
                raise _Abort(
                    f"heard nothing from the coordinator at {self.cfg.connect} for "
                    f"{self.liveness_s:g}s while {what} (liveness_timeout_s); giving up"
                )
            timeout = min(self.next_heartbeat, deadline) - now
            self._pump(max(1, int(timeout * 1000) + 1))

    def _heartbeat_if_due(self, now: float) -> None:
        """A heartbeat, unless a timing frame went out since one was due (``_timing``); the
        batches the machine holds unreported go instead, if any (``HeartbeatDue``)."""
        if self.spec is not None and now >= self.next_heartbeat:
            self.execute(self.m.handle(HeartbeatDue()))  # its batches held unreported, or a heartbeat (_timing)

    # -- time accounting (flodl.rank.TimeAccount) ---------------------------------------

    def _wait_cause(self) -> str:
        if not self._trained:
            return "startup"
        return "recovery" if self._recovering else "barrier"

    def _train_cause(self) -> str:
        calibrating = self.spec is not None and self.spec.policy in (pb.POLICY_CADENCE, pb.POLICY_ASYNC)
        return "calibration" if calibrating and not self._consensus_seen else "training"

    def execute(self, cmds: list) -> None:
        """The machine's commands, each charged to its cause (averaging, checkpoint, eval)."""
        for c in cmds:
            cause = _CAUSE_OF.get(type(c))
            if cause is None:
                super().execute([c])
                continue
            self.account.during(cause, time.monotonic())
            try:
                super().execute([c])
            finally:
                self.account.leave(time.monotonic())
            if type(c) is ApplyConsensus:
                self._consensus_seen, self._recovering = True, False

    # -- admission ----------------------------------------------------------------------

    def hello(self) -> None:
        set_world_size(self.cfg.world_size)  # FLODL_WORLD_SIZE: the probe's optimizer_fn may ask (run_world)
        torch.manual_seed(0)
        probe = self.model_fn()
        sig = model_signature(probe)
        # Building an optimizer once on the probe checks optimizer_fn before we ask to
        # join, and pays torch's lazy imports (torch.optim pulls in torch._dynamo: ~1.5 s)
        # now rather than between admission and the first step.
        self.optimizer_fn(probe)
        del probe
        unpinned = {} if self.cfg.pinned else {"unpinned_slot": self.cfg.local_rank}  # the core picks the slot
        hello = pb.RankHello(
            rank=max(self.cfg.rank, 0),
            **unpinned,
            world_size=self.cfg.world_size,
            model_sig=sig,
            dataset_len=len(self.dataset),
            host=self.cfg.host,
            pid=os.getpid(),
            task=self.task,
            agent_token=self.cfg.agent_token,  # vouches for the agent that launched us (agents)
            restart_count=self.cfg.restart_count,  # the coordinator's join record names the restart
        )
        self._send("hello", hello)
        self._hello_deadline = time.monotonic() + self.cfg.hello_timeout_s
        self._deferred_reason = ""
        resend = time.monotonic() + HELLO_RESEND_S
        start = time.monotonic()
        warn = start + HELLO_WARN_S
        while self.spec is None:
            now = time.monotonic()
            if now >= resend:  # a coordinator that restarted may have lost it (idempotent)
                self._send("hello", hello)
                self._hello_resent = True
                resend = now + HELLO_RESEND_S
            deadline = self._hello_deadline  # a deferred answer moves it
            left = min(deadline, resend, warn) - now
            if deadline <= now:
                raise _Abort(
                    f"no hello_ack from the coordinator at {self.cfg.coordinator_name} within "
                    f"{self.cfg.hello_timeout_s:g}s (FLODL_HELLO_TIMEOUT_S): is it running, and are "
                    f"its address and the session ({self.cfg.session!r}) right?"
                )
            if now >= warn and not self._deferred_reason:  # say it early, keep trying
                log.warning(
                    "no answer yet from the coordinator at %s after %.0fs: is it running there, and is %r its "
                    "session? still trying (giving up after %gs)",
                    self.cfg.coordinator_name, now - start, self.cfg.session, self.cfg.hello_timeout_s,
                )
                warn = now + HELLO_REWARN_S
            self._pump(max(1, int(left * 1000)))

    def _on_hello_ack(self, ack: pb.HelloAck) -> None:
        if self.spec is not None:
            self._drop("duplicate_hello_ack", "a second hello_ack after admission")
            return
        if not ack.accepted and ack.deferred:
            # The coordinator is there and will decide once the world forms (cohort
            # conflict): say why once, keep resending, and do not time the hello out.
            if ack.reason != self._deferred_reason:
                log.warning("admission deferred by the coordinator: %s", ack.reason)
                self._deferred_reason = ack.reason
            self._hello_deadline = time.monotonic() + self.cfg.hello_timeout_s
            return
        if not ack.accepted:
            raise _Refused(f"the coordinator refused this rank: {ack.reason or '(no reason given)'}")
        spec = ack.run
        if spec.batch_size < 1:
            raise _Refused(f"RunSpec.batch_size={spec.batch_size} must be >= 1")
        if spec.total_samples > len(self.dataset):
            raise _Refused(
                f"RunSpec.total_samples={spec.total_samples} exceeds this rank's dataset of {len(self.dataset)}"
            )
        if not self.cfg.pinned:
            self._take_slot(ack.rank, spec.world_size)
        self.spec = spec
        self.heartbeat_s = spec.heartbeat_interval_s if spec.heartbeat_interval_s > 0 else DEFAULT_HEARTBEAT_S
        self.liveness_s = spec.liveness_timeout_s if spec.liveness_timeout_s > 0 else DEFAULT_LIVENESS_S
        self.sock.setsockopt(zmq.SNDTIMEO, int(self.liveness_s * 1000))
        set_world_size(max(int(spec.world_size), 1))  # the coordinator's, for the real optimizer_fn
        global_step = self.build()  # now, so that frames queued behind the ack see a built model
        self.loader = BatchLoader(
            self.dataset, self._samples, self.m.upcoming,
            num_workers=self.num_workers, prefetch=self.prefetch, seed=spec.seed + 1 + self.cfg.rank,
        )  # fmt: skip
        self.loader.start()  # before any background thread (the collective's) exists: workers fork
        if spec.plane == pb.PLANE_COLLECTIVE:
            self.averager = self.collective = CollectiveAverager(self)
        self.feed(Admitted(spec=spec, global_step=global_step, hello_resent=self._hello_resent))
        self.clock.tick()  # the schedule's LR at the run's progress (0, or a resume's global step)
        log.info(
            "admitted: world %d, %d samples, batch %d, %d epochs, seed %d, gamma %g",
            spec.world_size, spec.total_samples, spec.batch_size, spec.num_epochs, spec.seed, spec.gamma,
        )

    def build(self) -> int:
        """Build model and optimizer (and load the resume checkpoint); its global step."""
        assert self.spec is not None
        global_step = 0
        torch.manual_seed(self.spec.seed)
        self.model = self.model_fn().to(self.device)  # before the optimizer: it holds these tensors
        self.optimizer = self.optimizer_fn(self.model)
        if self.spec.resume_from:
            try:
                info = load_model_file(self.spec.resume_from, self.model, self.optimizer)
            except CheckpointLoadError as e:
                raise _Refused(f"cannot resume: {e}") from None
            global_step = int(info.get("global_step", 0))
            log.info("resumed model and optimizer from %s (checkpoint v%s)", self.spec.resume_from, info.get("version"))
        self.params = list(self.model.parameters())
        self.buffers = averaged_buffers(self.model)
        self.model.train()
        # Identical weights everywhere, distinct random streams (dropout...) per rank.
        torch.manual_seed((self.spec.seed + 1 + self.cfg.rank) % (1 << 63))
        return global_step

    # -- dispatch -----------------------------------------------------------------------

    def _dispatch(self, env: pb.Envelope, blobs: list) -> None:
        kind = env.WhichOneof("body")
        if kind == "hello_ack":
            self._on_hello_ack(env.hello_ack)
        elif self.spec is None:
            self._drop("before_admission", f"{kind} before hello_ack")
        elif kind == "control":
            which = env.control.WhichOneof("cmd")
            rdv = env.control.rendezvous
            # A re-formation after a death (not one that adds a joiner: growth, not recovery).
            regrouped = which == "rendezvous" and rdv.generation > 1 and not rdv.seed_ranks
            if self._trained and (which == "declare_dead" or regrouped):
                self._recovering = True  # a rank died: what the survivors wait from now is its cost
            self.feed(ControlReceived(control=env.control))
            if which == "set_global_step" or (which == "update" and env.control.update.HasField("global_step")):
                self.clock.tick()  # the run's progress moved: the schedule follows it
        elif kind == "round" and env.round.seed:
            if self.collective is None:
                self.averager.on_seed(env.round, blobs)  # joining a running world: start from the consensus
            else:
                self._drop("unexpected_seed", "a seed consensus on the collective plane")
        elif kind == "round":
            # Acked first (the round finishes without waiting for the disk); an armed
            # checkpoint is saved before the next step: the file holds exactly this consensus.
            self.averager.on_consensus(env.round, blobs)
        else:
            self._drop("unexpected_body", f"a {kind} body is not for a rank")

    def _exit(self, c: Exit) -> None:
        raise _Shutdown(c.reason)

    # -- eval ---------------------------------------------------------------------------

    def _run_epoch_fn(self, m: pb.EpochMetrics) -> None:
        """The elected rank's epoch callback; its cost goes back as ``epoch_fn_elapsed`` so
        the coordinator can shorten this rank's next window by as much (callback slack)."""
        t0 = time.perf_counter()
        try:
            self.epoch_fn(self.model, int(m.epoch), {"avg_loss": m.avg_loss, "epoch_ms": m.epoch_ms})
        except Exception as e:  # the user's callback must never take the rank down
            log.warning("epoch_fn raised on epoch %d: %s: %s", m.epoch, type(e).__name__, e)
        finally:
            self.model.train()
        elapsed = (time.perf_counter() - t0) * 1e3
        self._timing(epoch_fn_elapsed=pb.Timing.EpochFnElapsed(epoch=m.epoch, elapsed_ms=elapsed))

    def _run_eval(self, m) -> None:
        t0 = time.perf_counter()
        metric, error = float("nan"), None
        if self.eval_fn is None:
            error = "this rank has no eval_fn"
        else:
            self.model.eval()
            try:
                with torch.no_grad():
                    metric = float(self.eval_fn(self.model))
            except Exception as e:  # the user's eval must never take the rank down
                error = f"{type(e).__name__}: {e}"
                log.warning("eval_fn raised: %s", error)
            finally:
                self.model.train()
        res = pb.Timing.EvalResult(
            schedule_id=m.schedule_id,
            epoch=m.epoch,
            metric=metric,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
            final=m.final,
        )
        if error is not None:
            res.error = error
        if m.save_model_path:  # the final eval: the model just measured is the run's output
            self._save_output_model(m.save_model_path, res)
        self._timing(eval_result=res)

    def _save_output_model(self, path: str, res: pb.Timing.EvalResult) -> None:
        """Write the output model (``flodl_worker.output``); the answer names its sha256 or why not."""
        try:
            res.model_sha256 = save_output_model(path, self.model)
            log.info("output model written to %s", path)
        except Exception as e:  # a full disk, permissions: the coordinator reports it, the rank lives
            res.model_error = describe_write_error(e, path, "output model")
            log.warning("output model not written: %s", res.model_error)

    # -- training -----------------------------------------------------------------------

    def _samples(self, epoch: int, offset: int, count: int) -> np.ndarray:
        perm = self.perms.get(epoch)
        if perm is None:
            perm = self.perms[epoch] = epoch_permutation(self.spec.seed, epoch, self.spec.total_samples)
            for old in sorted(self.perms)[:-2]:
                del self.perms[old]
        return perm[offset : offset + count]

    def _lr(self) -> float:
        groups = getattr(self.optimizer, "param_groups", None)
        try:
            return float(groups[0].get("lr", 0.0)) if groups else 0.0
        except (TypeError, ValueError):
            return 0.0

    def _train(self, b: TrainBatch) -> None:
        """One optimizer step on the batch the machine handed out, reported to it."""
        t0 = time.perf_counter()
        ids = self._samples(b.epoch, b.offset, b.count)
        batch = to_device(self.loader.get(b.epoch, b.offset, b.count), self.device)
        t1 = time.perf_counter()  # data_ms: waiting for the batch (inline: loading it)
        self.clock.tick()
        loss = self.step_fn(self.model, self.optimizer, batch)
        if self.cfg.emulated_ms > 0:
            time.sleep(self.cfg.emulated_ms / 1e3)  # emulated device speed (FLODL_SLOWDOWN)
        t2 = time.perf_counter()
        loss_f = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        if self.trace is not None:
            self.trace.write("".join(f"{b.epoch} {int(i)}\n" for i in ids))
            self.trace.flush()
        self.feed(
            BatchTrained(
                epoch=b.epoch, offset=b.offset, samples=b.count, batch_ms=(t2 - t1) * 1e3, data_ms=(t1 - t0) * 1e3,
                loss=loss_f, lr=self._lr(),
            )
        )  # fmt: skip

    def run(self) -> None:
        self.hello()
        self.next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            self._pump(0)  # drain control between steps, never blocking
            self._heartbeat_if_due(time.monotonic())
            act = self.m.next_action(time.perf_counter())
            if act is WAIT_PLAN:
                self._wait_until(self.m.has_plan, "waiting for a plan")
            elif act is WAIT_THROTTLE:
                self._wait_until(lambda: not self.m.throttled, "throttled")
            elif type(act) is SendMetrics:  # even while throttled: reporting is not training
                self.execute([act])
            else:
                self._trained = True
                self.account.enter(self._train_cause(), time.monotonic())
                self._train(act)

    def say_exiting(self) -> None:
        digest = param_digest(self.params + self.buffers)  # the f32 buffers are averaged too
        self._timing(exiting=pb.Timing.Exiting(param_digest=digest, steps=self.m.local_step),
                     time_account=self.account.to_pb(time.monotonic()))

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
        for f in (self.trace, self.lr_trace):
            if f is not None:
                f.close()
        if self.collective is not None:
            self.collective.close()
        self.sock.close()  # LINGER_MS bounds the flush of what is still queued
        self.ctx.term()


def _who(cfg: RankEnv) -> str:
    """'rank 3', or for a rank not admitted yet that names none: 'rank ? (local 1)'."""
    return f"rank {cfg.rank}" if cfg.pinned else f"rank ? (local {cfg.local_rank})"


def _setup_logging(rank: int | str) -> None:
    if not logging.getLogger().handlers and not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"%(levelname)s flodl.rank[{rank}]: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def rank_main(
    model_fn: Callable[[], torch.nn.Module],
    optimizer_fn: Callable[[torch.nn.Module], Any],
    step_fn: Callable[[torch.nn.Module, Any, Any], Any],
    train_dataset,
    *,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
    epoch_fn: Callable[[torch.nn.Module, int, dict], Any] | None = None,
    task: str = "",
    lr_schedule: Callable[[Progress], float] | None = None,
    device: str | torch.device = "auto",
    num_workers: int = 0,
    prefetch: int | None = None,
    env: Mapping[str, str] = os.environ,
) -> int:
    """Run one rank to the end and return its exit code (see ``run_rank``)."""
    try:
        cfg = RankEnv.from_environ(env)
    except EnvError as e:
        print(f"flodl rank: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    _setup_logging(cfg.rank if cfg.pinned else f"?{cfg.local_rank}")
    r: _Rank | None = None
    try:
        r = _Rank(
            cfg, model_fn, optimizer_fn, step_fn, train_dataset, eval_fn, task, epoch_fn,
            lr_schedule=lr_schedule, device=device, num_workers=num_workers, prefetch=prefetch,
        )  # fmt: skip
        r.run()
    except _Shutdown as s:
        r.say_exiting()
        log.info("%s after %d steps: exiting cleanly", s.args[0], r.local_step)
        return EXIT_OK
    except _Refused as e:
        print(f"flodl {_who(r.cfg if r else cfg)}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except _Abort as e:
        print(f"flodl {_who(r.cfg if r else cfg)}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception:
        # The user's model/step code failed: no Exiting (reference hazard 7), exit 1.
        print(f"flodl {_who(r.cfg if r else cfg)}: training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if r is not None:
            if r.drops:
                log.info("frames dropped from the coordinator: %s", dict(r.drops))
            r.close()
    return EXIT_FAILED  # unreachable: run() only leaves by an exception


def run_rank(
    model_fn: Callable[[], torch.nn.Module],
    optimizer_fn: Callable[[torch.nn.Module], Any],
    step_fn: Callable[[torch.nn.Module, Any, Any], Any],
    train_dataset,
    *,
    eval_fn: Callable[[torch.nn.Module], float] | None = None,
    epoch_fn: Callable[[torch.nn.Module, int, dict], Any] | None = None,
    task: str = "",
    lr_schedule: Callable[[Progress], float] | None = None,
    device: str | torch.device = "auto",
    num_workers: int = 0,
    prefetch: int | None = None,
    env: Mapping[str, str] = os.environ,
) -> NoReturn:
    """Be one rank of a flodl run, then end the process (``SystemExit``).

    - ``model_fn()`` builds the model; it is called under ``torch.manual_seed`` (twice:
      a signature probe, then the real one seeded from the RunSpec).
    - ``optimizer_fn(model)`` builds its optimizer; ``flodl_worker.world_size()`` is
      known there, for an LR that depends on it (Adam under averaging: ``lr * sqrt(K)``,
      ``flodl_worker.run_world``).
    - ``step_fn(model, optimizer, batch)`` does one full optimizer step (zero_grad,
      forward, backward, step) and returns the loss (tensor or float). ``batch`` is
      ``[t[idx] for t in train_dataset.tensors]`` for a TensorDataset-like dataset,
      else ``default_collate`` of its items.
    - ``eval_fn(model) -> float`` (optional) evaluates held-out data; it runs under
      ``model.eval()`` and ``torch.no_grad()``; an exception is reported, not fatal.
    - ``epoch_fn(model, epoch, metrics)`` (optional) runs on the one rank the coordinator
      elects for epoch callbacks (``epoch_callback_policy``: fastest, or rank:N), right
      after each epoch is aggregated; ``metrics`` has ``avg_loss`` and ``epoch_ms``. Its
      time is reported and the coordinator gives that rank a shorter next window so the
      others do not wait (callback slack). An exception is logged, not fatal.
    - ``train_dataset`` needs ``__len__`` and either ``.tensors`` or ``__getitem__`` (a
      map-style ``Dataset``; per-sample transforms run in ``__getitem__``).
    - ``lr_schedule(progress) -> lr`` (optional) sets every parameter group's LR before
      each step and whenever the coordinator's progress arrives (after each averaging
      round). ``progress`` is a ``flodl_worker.Progress``: the run's ``global_step``,
      ``samples`` committed, ``total_samples``, ``epoch`` (fractional) and ``fraction``
      in [0, 1], the run's, not this rank's (``flodl_worker.progress``): a schedule of
      ``fraction`` ends at the same LR on every rank. Each step's LR is reported to the
      coordinator (``Timing.Batch.lr``, its LR meta-controller's input).
      ``flodl_worker.progress()`` returns the same value anywhere inside the rank.
    - ``device``: ``"auto"`` (default: ``cuda:FLODL_LOCAL_RANK`` when CUDA is visible,
      else the CPU), ``"cpu"``, ``"cuda[:N]"`` or a ``torch.device``. The model is
      built, moved there, then handed to ``optimizer_fn``; every batch is moved there
      before ``step_fn``; ``eval_fn``/``epoch_fn`` get the model on it (move held-out
      data to ``next(model.parameters()).device``).
    - ``num_workers`` (default 0: inline) worker processes load batches: they run
      ``train_dataset[i]`` and collate, ``prefetch`` batches ahead (default 2 per
      worker) along the plans the coordinator gave (``flodl_worker.loader``); for a
      map-style dataset with costly items (a TensorDataset indexes fastest inline). The
      time a step waits for its batch is reported as ``data_ms``.

    Identity and emulation come from ``env`` (see ``flodl_worker._env``). Exit codes:
    0 clean shutdown, 1 failure, 2 configuration error or refused admission.

    The process ends as soon as its last frame has left (``close``: the socket's
    linger) and the user's ``atexit`` handlers ran, without the interpreter's teardown
    of torch's modules (``flodl.procutil.exit_now``).
    """
    exit_now(
        rank_main(
            model_fn, optimizer_fn, step_fn, train_dataset, eval_fn=eval_fn, epoch_fn=epoch_fn, task=task,
            lr_schedule=lr_schedule, device=device, num_workers=num_workers, prefetch=prefetch, env=env,
        )
    )
