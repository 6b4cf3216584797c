"""flodl_worker.rank: the torch-native rank runtime.

Theory of operation
-------------------
A rank is one process, one thread and one DEALER socket (docs/protocol.md, "Rank life
cycle"). Nothing here runs in the background: the main loop trains a batch, then drains
whatever the coordinator sent without blocking, and only ever *blocks* (waiting for a
plan, throttled at a barrier) inside ``_wait_until``, which polls the socket with a
timeout so that heartbeats and the liveness check run on every pass — silence is
exactly when they are needed.

1. hello -> hello_ack. The model signature (sha256 over parameter names, shapes and
   dtypes) goes in the hello, but the seed that initialises the weights comes back in
   the ack's RunSpec. So the model is built twice: once under ``manual_seed(0)`` as a
   probe for the signature (then dropped), and again under ``manual_seed(spec.seed)``
   after admission, so every rank starts bit-identical. Afterwards the torch RNG is
   re-seeded per rank (``seed + 1 + rank``) so that dropout & co. differ across ranks.
2. A plan (``StartEpoch`` or ``Update.next_plan``) is a range of positions of the epoch
   permutation ``flodl.shuffle.epoch_permutation(seed, epoch, total_samples)``. Plans are
   queued FIFO. ``ExtendPartition`` appends a segment to the plan in training (same
   epoch) or queues a new one. Batches never straddle two segments, so each
   ``timing.batch`` covers exactly ``[offset, offset + samples)``.
3. ``RequestParams{cycle}``: deep-copy the parameters (the "pre" snapshot), n = steps
   since the last applied average, weight = n**gamma (0 when n <= 0: the idle guard),
   send ``round`` with params x weight (elided when the weight is 0).
4. Consensus ``round{cycle}``: weight > 0 -> parameters <- consensus + (parameters -
   snapshot): the round overlaps training (Cadence hands out the next window with the
   ``RequestParams``), so the k steps taken since the snapshot are kept on top of the
   consensus; k = 0 is the plain overwrite (EASGD blend under the Async policy when
   easgd_alpha > 0). Subtract the snapshot's n from the steps since average (steps
   taken during the round keep their credit). Weight 0 -> keep local parameters *and*
   the credit (my work was not folded in). Either way answer ``timing.sync_ack{cycle,
   step_count at snapshot, divergence (snapshot vs consensus), pre_norm, post_norm}``.
5. ``Throttle`` stops training until ``Update`` (or Shutdown); everything else is still
   serviced, and an exhausted plan still reports its ``metrics`` while throttled.
6. ``Checkpoint{version, path, cycle}`` for this rank: save model + optimizer state to
   ``path`` atomically (``flodl_worker.checkpoint``) and answer ``checkpoint_result{version,
   sha256}``. ``cycle`` names the weights: 0 = what the rank holds now; c = the consensus
   of cycle c -- saved right after applying it (armed when the command comes first), at
   once if the rank applied it and has not stepped since, else an error answer (the
   coordinator fails over). A ``RunSpec.resume_from`` is loaded right after the model and
   optimizer are built, before the first step; a file that does not load exits 2.
7. ``Shutdown``/``ShutdownWithSave`` -> ``timing.exiting{sha256 of the f32 params,
   steps}``, exit 0. ``Exiting`` is never sent on an error exit.

Exit codes: 0 clean shutdown; 1 failure (the coordinator went silent or unreachable,
the user's code raised); 2 configuration error or refused at hello.

A bad frame from the coordinator is dropped, counted under its reason and logged once
per reason; it never crashes the rank.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sys
import time
import traceback
import warnings
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn

import numpy as np
import torch
import zmq

from flodl.shuffle import epoch_permutation
from flodl.wire import (
    Endpoint,
    RouteMismatch,
    SeqTracker,
    WireError,
    decode,
    pack_round,
    pb,
    split_routing,
    unpack_round,
)

from ._env import EnvError, RankEnv
from .checkpoint import CheckpointLoadError, load_model_file, save_model_file

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


class _Shutdown(Exception):
    """The coordinator said Shutdown/ShutdownWithSave: leave the loop cleanly."""


class _Refused(Exception):
    """hello_ack refused us, or the RunSpec cannot work with this rank: exit 2."""


class _Abort(Exception):
    """The rank cannot go on (coordinator silent/unreachable): exit 1, no Exiting."""


# ---------------------------------------------------------------------------------------
# Helpers with no state (public: tests and other tools compute the same values)
# ---------------------------------------------------------------------------------------


def model_signature(model: torch.nn.Module) -> bytes:
    """sha256 over ``name shape dtype`` of every parameter, in ``named_parameters`` order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}\n".encode())
    return h.digest()


def _f32(p: torch.Tensor) -> np.ndarray:
    """A detached little-endian f32 view/copy of ``p`` on the CPU (may share memory)."""
    return p.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().astype("<f4", copy=False)


def param_digest(params) -> bytes:
    """sha256 of the concatenated little-endian f32 bytes of ``params``, in order."""
    h = hashlib.sha256()
    for p in params:
        h.update(_f32(p).tobytes())
    return h.digest()


def gamma_mass(n: int, gamma: float) -> float:
    """Contribution mass n**gamma with the idle guard: 0 when n <= 0 (never 0**0 = 1)."""
    if n <= 0:
        return 0.0
    return float(n) if gamma == 1.0 else float(n) ** gamma


def _norm(arrays) -> float:
    total = 0.0
    for a in arrays:
        v = a.ravel().astype(np.float64)
        total += float(np.dot(v, v))
    return float(np.sqrt(total))


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    # Consensus arrays view read-only ZeroMQ frames; torch warns on wrapping them even
    # though we only ever read (copy_ into the parameter).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


# ---------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Chunk:
    """One plan: an epoch and the position segments still to train, plus its metrics."""

    epoch: int
    seq: int
    segments: deque = field(default_factory=deque)  # [offset, size] lists, in order
    started: float = 0.0
    batches: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0

    def exhausted(self) -> bool:
        while self.segments and self.segments[0][1] == 0:
            self.segments.popleft()
        return not self.segments

    def take(self, batch_size: int) -> tuple[int, int] | None:
        """Next batch as (offset, count) inside one segment, or None when exhausted."""
        if self.exhausted():
            return None
        seg = self.segments[0]
        count = min(batch_size, seg[1])
        offset = seg[0]
        seg[0] += count
        seg[1] -= count
        return offset, count


@dataclass(frozen=True, slots=True)
class _Snapshot:
    n: int  # steps since the last applied average, at the snapshot
    step_count: int  # local step counter at the snapshot
    pre: list  # deep-copied f32 parameters (for the divergence triple)
    weight: float


# ---------------------------------------------------------------------------------------
# The runtime
# ---------------------------------------------------------------------------------------


class _Rank:
    def __init__(self, cfg: RankEnv, model_fn, optimizer_fn, step_fn, dataset, eval_fn, task: str):
        self.cfg = cfg
        self.model_fn, self.optimizer_fn, self.step_fn = model_fn, optimizer_fn, step_fn
        self.dataset, self.eval_fn, self.task = dataset, eval_fn, task
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        # Options before connect. A random identity per process: a restarted rank is a
        # new peer to the ROUTERs, never confused with its previous life.
        self.sock.setsockopt(zmq.IDENTITY, b"rank-%d-%s" % (cfg.rank, secrets.token_hex(4).encode()))
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self.sock.setsockopt(zmq.SNDTIMEO, int(DEFAULT_LIVENESS_S * 1000))
        try:
            self.sock.connect(cfg.connect)
        except zmq.ZMQError as e:
            self.sock.close(0)
            self.ctx.term()
            raise _Refused(f"cannot dial FLODL_CONNECT={cfg.connect!r}: {e}") from None
        self.ep = Endpoint(
            cfg.session, pb.Sender.KIND_RANK, rank=cfg.rank, host=cfg.host, incarnation=secrets.randbits(63)
        )
        self.seq = SeqTracker()
        self.drops: Counter = Counter()
        self.spec: pb.RunSpec | None = None
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.params: list[torch.Tensor] = []
        self.heartbeat_s = DEFAULT_HEARTBEAT_S
        self.liveness_s = DEFAULT_LIVENESS_S
        self.last_heard = time.monotonic()
        self.next_heartbeat = 0.0
        # Training state.
        self.local_step = 0
        self.steps_since_avg = 0
        self.global_step = 0
        self.throttled = False
        self.plans: deque[_Chunk] = deque()
        self.current: _Chunk | None = None
        self.chunk_seq = 0
        self.snapshots: dict[int, _Snapshot] = {}
        # Checkpoints: the last consensus applied, the step count right after it, and
        # saves armed for a consensus still to come (cycle -> Checkpoint command).
        self.applied_cycle = 0
        self.applied_at_step = 0
        self.armed: dict[int, pb.Control.Checkpoint] = {}
        self.perm: tuple[int, np.ndarray] | None = None  # (epoch, permutation) cache
        self.trace = None
        if cfg.trace_dir:
            os.makedirs(cfg.trace_dir, exist_ok=True)
            self.trace = open(os.path.join(cfg.trace_dir, f"rank{cfg.rank}.trace"), "a", encoding="ascii")

    # -- sending ------------------------------------------------------------------------

    def _send(self, body_field: str, body, blobs=()) -> None:
        try:
            self.sock.send_multipart(self.ep.frames(body_field, body, blobs), copy=not blobs)
        except zmq.Again:
            raise _Abort(
                f"cannot queue a frame to the coordinator at {self.cfg.connect} for "
                f"{self.liveness_s:g}s (its queue is full: it is not reading)"
            ) from None

    def _timing(self, **event) -> None:
        self._send("timing", pb.Timing(rank=self.cfg.rank, **event))

    # -- receiving ----------------------------------------------------------------------

    def _drop(self, reason: str, detail: str) -> None:
        self.drops[reason] += 1
        if self.drops[reason] == 1:
            log.warning("dropped a frame from the coordinator (%s): %s; later ones are only counted", reason, detail)

    def _pump(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for traffic, then handle what is queued (bounded)."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
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
        if self.spec is not None and now >= self.next_heartbeat:
            self._timing(heartbeat=pb.Timing.Heartbeat(step_count=self.local_step))
            self.next_heartbeat = now + self.heartbeat_s

    # -- admission ----------------------------------------------------------------------

    def hello(self) -> None:
        torch.manual_seed(0)
        probe = self.model_fn()
        sig = model_signature(probe)
        # Building an optimizer once on the probe checks optimizer_fn before we ask to
        # join, and pays torch's lazy imports (torch.optim pulls in torch._dynamo: ~1.5 s)
        # now rather than between admission and the first step.
        self.optimizer_fn(probe)
        del probe
        self._send(
            "hello",
            pb.RankHello(
                rank=self.cfg.rank,
                world_size=self.cfg.world_size,
                model_sig=sig,
                dataset_len=len(self.dataset),
                host=self.cfg.host,
                pid=os.getpid(),
                task=self.task,
            ),
        )
        deadline = time.monotonic() + self.cfg.hello_timeout_s
        while self.spec is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Abort(
                    f"no hello_ack from the coordinator at {self.cfg.connect} within "
                    f"{self.cfg.hello_timeout_s:g}s (FLODL_HELLO_TIMEOUT_S): is it running, and are "
                    f"FLODL_CONNECT and FLODL_SESSION ({self.cfg.session!r}) right?"
                )
            self._pump(max(1, int(left * 1000)))

    def _on_hello_ack(self, ack: pb.HelloAck) -> None:
        if self.spec is not None:
            self._drop("duplicate_hello_ack", "a second hello_ack after admission")
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
        self.spec = spec
        self.heartbeat_s = spec.heartbeat_interval_s if spec.heartbeat_interval_s > 0 else DEFAULT_HEARTBEAT_S
        self.liveness_s = spec.liveness_timeout_s if spec.liveness_timeout_s > 0 else DEFAULT_LIVENESS_S
        self.sock.setsockopt(zmq.SNDTIMEO, int(self.liveness_s * 1000))
        self.build()  # now, so that frames queued behind the ack see a built model
        log.info(
            "admitted: world %d, %d samples, batch %d, %d epochs, seed %d, gamma %g",
            spec.world_size, spec.total_samples, spec.batch_size, spec.num_epochs, spec.seed, spec.gamma,
        )

    def build(self) -> None:
        assert self.spec is not None
        torch.manual_seed(self.spec.seed)
        self.model = self.model_fn()
        self.optimizer = self.optimizer_fn(self.model)
        if self.spec.resume_from:
            try:
                info = load_model_file(self.spec.resume_from, self.model, self.optimizer)
            except CheckpointLoadError as e:
                raise _Refused(f"cannot resume: {e}") from None
            self.global_step = int(info.get("global_step", 0))
            log.info("resumed model and optimizer from %s (checkpoint v%s)", self.spec.resume_from, info.get("version"))
        self.params = list(self.model.parameters())
        self.model.train()
        # Identical weights everywhere, distinct random streams (dropout...) per rank.
        torch.manual_seed((self.spec.seed + 1 + self.cfg.rank) % (1 << 63))

    # -- dispatch -----------------------------------------------------------------------

    def _dispatch(self, env: pb.Envelope, blobs: list) -> None:
        kind = env.WhichOneof("body")
        if kind == "hello_ack":
            self._on_hello_ack(env.hello_ack)
        elif self.spec is None:
            self._drop("before_admission", f"{kind} before hello_ack")
        elif kind == "control":
            self._on_control(env.control)
        elif kind == "round":
            self._on_consensus(env.round, blobs)
        else:
            self._drop("unexpected_body", f"a {kind} body is not for a rank")

    def _on_control(self, c: pb.Control) -> None:
        which = c.WhichOneof("cmd")
        if which == "request_params":
            self._on_request_params(c.request_params.cycle)
        elif which == "start_epoch":
            self._queue_plan(c.start_epoch.plan, "StartEpoch")
        elif which == "update":
            if c.update.HasField("next_plan"):
                self._queue_plan(c.update.next_plan, "Update.next_plan")
            self.throttled = False
        elif which == "throttle":
            self.throttled = True
        elif which == "extend_partition":
            self._extend(c.extend_partition)
        elif which == "execute_eval":
            if c.execute_eval.target_rank == self.cfg.rank:
                self._run_eval(c.execute_eval)
        elif which == "set_global_step":
            self.global_step = c.set_global_step.global_step
        elif which == "checkpoint":
            if c.checkpoint.target_rank == self.cfg.rank:
                self._on_checkpoint(c.checkpoint)
        elif which in ("shutdown", "shutdown_with_save"):
            raise _Shutdown(which)
        elif which in (
            "coord_heartbeat", "epoch_aggregated", "set_epoch_callback_role", "declare_dead",
            "eval_broadcast", "stage_advisory", "save_consensus_model", "arm_consensus_eval",
        ):
            pass  # informational for a bus-plane rank; hearing it already reset liveness
        elif which is None:
            self._drop("malformed", "control with no command")
        else:  # sync_now, rendezvous: the collective plane, not implemented here
            self._drop("unsupported_control", f"{which} (collective plane) is not supported by this rank")

    def _queue_plan(self, plan: pb.EpochPlan, source: str) -> None:
        self._add_chunk(plan.epoch, plan.partition_offset, plan.partition_size, source)

    def _add_chunk(self, epoch: int, offset: int, size: int, source: str) -> None:
        assert self.spec is not None
        if offset + size > self.spec.total_samples:
            self._drop("bad_plan", f"{source} [{offset}, {offset + size}) exceeds {self.spec.total_samples} samples")
            return
        if self.plans:
            # Reference hazard 11: two outstanding plans usually mean a coordinator bug.
            # Keep both (dropping one would strand its samples), but say so.
            log.warning("%s arrived while another plan is still queued; keeping both (FIFO)", source)
        self.chunk_seq += 1
        self.plans.append(_Chunk(epoch=int(epoch), seq=self.chunk_seq, segments=deque([[int(offset), int(size)]])))

    def _extend(self, m) -> None:
        cur = self.current
        if cur is not None and cur.epoch == m.epoch:
            if m.partition_offset + m.partition_size > self.spec.total_samples:
                self._drop("bad_plan", "ExtendPartition beyond the epoch")
                return
            cur.segments.append([int(m.partition_offset), int(m.partition_size)])
        else:
            # No plan in training (or another epoch): the extension is a chunk of its own.
            self._add_chunk(m.epoch, m.partition_offset, m.partition_size, "ExtendPartition")

    # -- averaging ----------------------------------------------------------------------

    def _on_request_params(self, cycle: int) -> None:
        n = self.steps_since_avg
        w = gamma_mass(n, self.spec.gamma)
        pre = [_f32(p).copy() for p in self.params]  # deep copy: never a torn/aliased view
        scaled = [a * np.float32(w) for a in pre] if w > 0 else pre
        header, blobs = pack_round(scaled, cycle=cycle, weight=w, bf16=self.spec.bf16_wire)
        self.snapshots[cycle] = _Snapshot(n=n, step_count=self.local_step, pre=pre, weight=w)
        self._send("round", header, blobs)

    def _on_consensus(self, header: pb.RoundHeader, blobs: list) -> None:
        snap = self.snapshots.get(header.cycle)
        if snap is None:
            self._drop("unknown_cycle", f"consensus for cycle {header.cycle}, which this rank never snapshotted")
            return
        if header.phase != pb.ROUND_PHASE_PARAMS or header.kind != pb.ROUND_KIND_MODEL:
            self._drop("unsupported_round", f"round phase {header.phase} kind {header.kind}")
            return
        try:
            arrays = unpack_round(header, blobs)
        except WireError as e:
            self._drop(e.reason, e.detail)
            return
        if len(arrays) != len(self.params) or any(
            tuple(a.shape) != tuple(p.shape) for a, p in zip(arrays, self.params)
        ):
            self._drop("bad_tensor", f"consensus for cycle {header.cycle} does not match the model's schema")
            return
        del self.snapshots[header.cycle]
        post = snap.pre  # weight 0: the consensus is our own snapshot (keep local)
        if header.weight > 0:
            alpha = self.spec.easgd_alpha
            blend = self.spec.policy == pb.POLICY_ASYNC and 0.0 < alpha < 1.0
            # The round overlaps training: k steps may have run since the snapshot. Apply
            # delta-preserving, theta <- consensus + (theta - snapshot), so they are kept
            # (the next round folds them); k = 0 is the plain overwrite, bit for bit.
            moved = self.local_step != snap.step_count
            consensus = []
            with torch.no_grad():
                for p, a, pre in zip(self.params, arrays, snap.pre):
                    t = _as_tensor(a).to(device=p.device, dtype=p.dtype)
                    if blend:
                        p.lerp_(t, alpha)  # EASGD: p + alpha * (avg - p)
                        continue
                    delta = _f32(p) - pre if moved else None
                    p.copy_(t)
                    if delta is not None:
                        p.add_(_as_tensor(delta).to(device=p.device, dtype=p.dtype))
                    consensus.append(_f32(t))
            # Divergence is snapshot vs consensus, as without overlap (not vs theta now).
            post = [_f32(p) for p in self.params] if blend else consensus
            # Steps taken while the round was in flight keep their credit (hazard 13).
            self.steps_since_avg = max(0, self.steps_since_avg - snap.n)
        post_norm = _norm(post)
        diff = _norm([b - a for a, b in zip(snap.pre, post)])
        self._timing(
            sync_ack=pb.Timing.SyncAck(
                cycle=header.cycle,
                step_count=snap.step_count,
                divergence=diff / post_norm if post_norm > 1e-10 else 0.0,
                pre_norm=_norm(snap.pre),
                post_norm=post_norm,
            )
        )
        # Acked first (the round finishes without waiting for the disk), saved before the
        # next step: the file holds exactly this consensus.
        self.applied_cycle, self.applied_at_step = header.cycle, self.local_step
        self._after_consensus(header.cycle)

    # -- checkpoints --------------------------------------------------------------------

    def _on_checkpoint(self, m: pb.Control.Checkpoint) -> None:
        if not m.path:
            self._checkpoint_failed(m, "no path in the Checkpoint command (the coordinator has no checkpoint_dir)")
        elif m.cycle == 0:
            self._save_checkpoint(m)
        elif m.cycle > self.applied_cycle:
            armed = pb.Control.Checkpoint()
            armed.CopyFrom(m)
            self.armed[m.cycle] = armed  # saved right after that consensus is applied
        elif m.cycle == self.applied_cycle and self.local_step == self.applied_at_step:
            self._save_checkpoint(m)
        else:
            moved = self.local_step - self.applied_at_step
            self._checkpoint_failed(
                m,
                f"the consensus of cycle {m.cycle} is no longer held (last applied cycle "
                f"{self.applied_cycle}, {moved} step(s) since)",
            )

    def _after_consensus(self, cycle: int) -> None:
        for c in sorted(k for k in self.armed if k <= cycle):
            m = self.armed.pop(c)
            if c == cycle:
                self._save_checkpoint(m)
            else:
                self._checkpoint_failed(m, f"the consensus of cycle {c} never reached this rank")

    def _save_checkpoint(self, m: pb.Control.Checkpoint) -> None:
        t0 = time.perf_counter()
        try:
            digest = save_model_file(
                m.path, self.model, self.optimizer, version=m.version, cycle=m.cycle, rank=self.cfg.rank,
                global_step=self.global_step, local_step=self.local_step,
            )  # fmt: skip
        except Exception as e:  # disk full, permissions, a user state_dict that raises
            self._checkpoint_failed(m, f"{type(e).__name__}: {e}", t0)
            return
        elapsed = (time.perf_counter() - t0) * 1e3
        log.info("checkpoint v%d saved to %s in %.0f ms", m.version, m.path, elapsed)
        self._timing(
            checkpoint_result=pb.Timing.CheckpointResult(
                version=m.version, elapsed_ms=elapsed, sha256=digest, cycle=m.cycle
            )
        )

    def _checkpoint_failed(self, m: pb.Control.Checkpoint, error: str, t0: float | None = None) -> None:
        log.warning("checkpoint v%d not saved: %s", m.version, error)
        elapsed = (time.perf_counter() - t0) * 1e3 if t0 is not None else 0.0
        self._timing(
            checkpoint_result=pb.Timing.CheckpointResult(
                version=m.version, elapsed_ms=elapsed, error=error, cycle=m.cycle
            )
        )

    # -- eval ---------------------------------------------------------------------------

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
        self._timing(eval_result=res)

    # -- training -----------------------------------------------------------------------

    def _samples(self, epoch: int, offset: int, count: int) -> np.ndarray:
        if self.perm is None or self.perm[0] != epoch:
            self.perm = (epoch, epoch_permutation(self.spec.seed, epoch, self.spec.total_samples))
        return self.perm[1][offset : offset + count]

    def _gather(self, ids: np.ndarray):
        tensors = getattr(self.dataset, "tensors", None)
        if tensors is not None:
            idx = torch.from_numpy(ids)
            return [t[idx] for t in tensors]
        from torch.utils.data import default_collate

        return default_collate([self.dataset[int(i)] for i in ids])

    def _lr(self) -> float:
        groups = getattr(self.optimizer, "param_groups", None)
        try:
            return float(groups[0].get("lr", 0.0)) if groups else 0.0
        except (TypeError, ValueError):
            return 0.0

    def train_chunk(self, chunk: _Chunk) -> None:
        bs = self.spec.batch_size
        chunk.started = time.perf_counter()
        while True:
            self._pump(0)  # drain control between steps, never blocking
            self._heartbeat_if_due(time.monotonic())
            if chunk.exhausted():
                return  # metrics go out even while throttled: reporting is not training
            if self.throttled:
                self._wait_until(lambda: not self.throttled, "throttled")
                continue
            offset, count = chunk.take(bs)
            t0 = time.perf_counter()
            ids = self._samples(chunk.epoch, offset, count)
            batch = self._gather(ids)
            t1 = time.perf_counter()
            loss = self.step_fn(self.model, self.optimizer, batch)
            if self.cfg.emulated_ms > 0:
                time.sleep(self.cfg.emulated_ms / 1e3)  # emulated device speed (FLODL_SLOWDOWN)
            t2 = time.perf_counter()
            loss_f = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
            self.local_step += 1
            self.steps_since_avg += 1
            data_ms, batch_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            chunk.batches += 1
            chunk.samples += count
            chunk.loss_sum += loss_f
            chunk.compute_ms += batch_ms
            chunk.data_ms += data_ms
            if self.trace is not None:
                self.trace.write("".join(f"{chunk.epoch} {int(i)}\n" for i in ids))
                self.trace.flush()
            self._timing(
                batch=pb.Timing.Batch(
                    batch_ms=batch_ms,
                    data_ms=data_ms,
                    step_count=self.local_step,
                    batch_loss=loss_f,
                    lr=self._lr(),
                    samples=count,
                    epoch=chunk.epoch,
                    offset=offset,
                )
            )

    def send_metrics(self, chunk: _Chunk) -> None:
        elapsed = (time.perf_counter() - chunk.started) * 1e3
        self._send(
            "metrics",
            pb.Metrics(
                rank=self.cfg.rank,
                epoch=chunk.epoch,
                chunk_seq=chunk.seq,
                avg_loss=chunk.loss_sum / chunk.batches if chunk.batches else 0.0,
                batches_processed=chunk.batches,
                samples_processed=chunk.samples,
                epoch_ms=elapsed,
                compute_only_ms=chunk.compute_ms,
                data_starve_ms=chunk.data_ms,
                share_complete_ms=chunk.compute_ms + chunk.data_ms,
            ),
        )

    def run(self) -> None:
        self.hello()
        self.next_heartbeat = time.monotonic() + self.heartbeat_s
        while True:
            self._wait_until(lambda: bool(self.plans), "waiting for a plan")
            self.current = self.plans.popleft()
            self.train_chunk(self.current)
            chunk, self.current = self.current, None
            self.send_metrics(chunk)

    def say_exiting(self) -> None:
        self._timing(exiting=pb.Timing.Exiting(param_digest=param_digest(self.params), steps=self.local_step))

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        self.sock.close()  # LINGER_MS bounds the flush of what is still queued
        self.ctx.term()


def _setup_logging(rank: int) -> None:
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
    task: str = "",
    env: Mapping[str, str] = os.environ,
) -> int:
    """Run one rank to the end and return its exit code (see ``run_rank``)."""
    try:
        cfg = RankEnv.from_environ(env)
    except EnvError as e:
        print(f"flodl rank: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    _setup_logging(cfg.rank)
    r: _Rank | None = None
    try:
        r = _Rank(cfg, model_fn, optimizer_fn, step_fn, train_dataset, eval_fn, task)
        r.run()
    except _Shutdown as s:
        r.say_exiting()
        log.info("%s after %d steps: exiting cleanly", s.args[0], r.local_step)
        return EXIT_OK
    except _Refused as e:
        print(f"flodl rank {cfg.rank}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except _Abort as e:
        print(f"flodl rank {cfg.rank}: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except Exception:
        # The user's model/step code failed: no Exiting (reference hazard 7), exit 1.
        print(f"flodl rank {cfg.rank}: training failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
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
    task: str = "",
    env: Mapping[str, str] = os.environ,
) -> NoReturn:
    """Be one rank of a flodl run, then end the process (``SystemExit``).

    - ``model_fn()`` builds the model; it is called under ``torch.manual_seed`` (twice:
      a signature probe, then the real one seeded from the RunSpec).
    - ``optimizer_fn(model)`` builds its optimizer.
    - ``step_fn(model, optimizer, batch)`` does one full optimizer step (zero_grad,
      forward, backward, step) and returns the loss (tensor or float). ``batch`` is
      ``[t[idx] for t in train_dataset.tensors]`` for a TensorDataset-like dataset,
      else ``default_collate`` of its items.
    - ``eval_fn(model) -> float`` (optional) evaluates held-out data; it runs under
      ``model.eval()`` and ``torch.no_grad()``; an exception is reported, not fatal.
    - ``train_dataset`` needs ``__len__`` and either ``.tensors`` or ``__getitem__``.

    Identity and emulation come from ``env`` (see ``flodl_worker._env``). Exit codes:
    0 clean shutdown, 1 failure, 2 configuration error or refused admission.
    """
    raise SystemExit(
        rank_main(model_fn, optimizer_fn, step_fn, train_dataset, eval_fn=eval_fn, task=task, env=env)
    )
