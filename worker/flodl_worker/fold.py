"""The relay's fold: its host's ranks' round frames summed into one frame upstream.

Theory of operation
-------------------
Pure state, no sockets: the relay loop (``relay``) hands it the coordinator's
``RelayMsg`` and every message a rank sends, and sends what it returns.

* ``FoldOpen{cycle, ranks, identities}`` (coordinator): expect one params ``round`` of
  ``cycle`` from each of these ranks, each from its own frontend routing id. The
  coordinator sends it before the ranks' ``RequestParams`` on the same FIFO pipe, so
  no rank of the fold can answer before the relay knows the fold.
* ``offer(message)`` (a rank): when no fold is open, or the sender's routing id is not
  one the fold still waits for, the message is *not looked at* -- the relay forwards it
  as it came; control traffic pays one dict lookup. Otherwise the envelope (~100 bytes)
  is parsed; a ``round`` of the fold's cycle from the rank that id belongs to is *kept*
  (the raw frames, nothing decoded yet), anything else is forwarded.
* Per-rank parts are kept until the expected set is complete, so that a ``FoldDrop``
  (the coordinator saw the rank die) removes exactly that rank's part and the rest then
  flushes: a death mid-fold never blocks the round.
* Flush: parts in rank order, decoded with ``unpack_round`` (f32 or bf16 on the wire),
  summed in f32 (each part already carries params x w, then its f32 buffers x its mover
  mass); one frame with weight = sum w, ``buffer_weight`` = sum of the mover masses
  and ``contributing_ranks`` = the ranks folded, in the parts' wire dtype (bf16 stays
  bf16: the sum is rounded once more on the way up, accumulation is still f32). A
  part that does not decode, or has a negative or non-finite weight, is found when it
  arrives and forwarded raw at once, in its rank's order (the coordinator refuses it
  with the reason and counts it; sent later, behind that rank's next frames, it would
  be dropped as out of sequence and its round would never finish); it is not in the fold.
* A fold superseded by a newer ``FoldOpen`` is discarded: the coordinator abandoned that
  round. ``release`` (shutdown) hands back the raw messages of a fold in progress:
  forwarded untouched they are still valid individual contributions.

Fan-out (the downstream twin): the coordinator sends the consensus of a cycle whose
fold this relay carried ONCE, to the relay's own route, with ``RoundHeader.deliver_to``
naming the ranks to hand it to. ``from_coordinator`` maps those ranks to the frontend
ids of the latest ``FoldOpen`` (same cycle only: a consensus arrives before the next
``FoldOpen`` on the FIFO pipe) and the relay sends the very same frames to each id
(zero-copy; ``deliver_to`` is left in place, ranks ignore it). A rank it does not know,
or a consensus of another cycle, is logged and not delivered.

Zero-weight parts (a rank that did no work: elided tensors) add nothing but are named
in ``contributing_ranks``, like the coordinator's own reducer does.
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from google.protobuf.message import DecodeError

from flodl.wire import BadTensor, Endpoint, WireError, decode, pack_round, pb, unpack_round

__all__ = ["Folder"]

log = logging.getLogger("flodl.relay.fold")

Message = list  # [routing id, b"", envelope, blob...] as received on the frontend


@dataclass
class _Part:
    header: pb.RoundHeader
    message: Message
    arrays: Optional[list[np.ndarray]] = None  # decoded on arrival (f32: views of the frames)


@dataclass
class _Fold:
    cycle: int
    want: dict[bytes, int]  # routing id -> rank, for the parts not in yet
    parts: dict[int, _Part] = field(default_factory=dict)
    shapes: Optional[tuple] = None


def _shapes(header: pb.RoundHeader) -> tuple:
    """The schema a fold's parts must share: tensor shapes, and how many are buffers."""
    return tuple(tuple(m.shape) for m in header.tensors), header.buffer_tensors


class Folder:
    def __init__(self, identity: str) -> None:
        # The folded frames are this relay's own: a sender key of their own (the relay's
        # unique identity, not the host name, so that two relays on one host never share
        # a sequence), and the session the coordinator's FoldOpen named.
        self.endpoint = Endpoint("", pb.Sender.KIND_RELAY, host=identity, incarnation=secrets.randbits(63))
        self._fold: Optional[_Fold] = None
        self.folds_sent = 0
        self.ranks_folded = 0
        self.parts_forwarded = 0  # parts that could not be folded and went up raw
        self.folds_discarded = 0
        # (cycle, rank -> frontend id) of the latest FoldOpen: where a fan-out goes.
        self._members: Optional[tuple[int, dict[int, bytes]]] = None
        self.fanouts = 0  # consensus frames received once and forwarded to several ranks
        self.fanout_copies = 0
        self._logged: set[str] = set()

    def _log_once(self, key: str, fmt: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(fmt, *args)

    @property
    def active(self) -> bool:
        """True while some rank's round is still awaited (only then is ``offer`` needed)."""
        return self._fold is not None and bool(self._fold.want)

    # -- coordinator -> relay -----------------------------------------------------------

    def on_coordinator(self, payload: list) -> list[Message]:
        """Apply a ``[envelope]`` the coordinator sent the relay; returns frames for upstream."""
        return self.from_coordinator(payload)[0]

    def from_coordinator(self, payload: list) -> tuple[list[Message], list[bytes]]:
        """Apply a ``[envelope, blobs...]`` the coordinator sent the relay's own route.

        Returns (frames for upstream, frontend ids to send ``payload`` to unchanged).
        """
        try:
            d = decode(payload, session=None)
        except WireError as e:
            self._log_once(e.reason, "dropped a frame from the coordinator: %s", e)
            return [], []
        env = d.envelope
        if env.sender.kind == pb.Sender.KIND_COORDINATOR and d.kind == "round":
            return [], self._fan_out(env.round)
        if env.sender.kind != pb.Sender.KIND_COORDINATOR or d.kind != "relay":
            self._log_once(f"unexpected:{d.kind}", "the coordinator sent the relay a %r frame: ignored", d.kind)
            return [], []
        msg = env.relay
        which = msg.WhichOneof("msg")
        if which == "fold_open":
            self.endpoint.session = env.session
            return self._open(msg.fold_open), []
        if which == "fold_drop":
            return self._drop(msg.fold_drop.cycle, msg.fold_drop.rank), []
        log.info("coordinator says %s: nothing to do", which)
        return [], []

    def _fan_out(self, h: pb.RoundHeader) -> list[bytes]:
        m = self._members
        if m is None or m[0] != h.cycle:
            log.warning("consensus of cycle %d to fan out to ranks %s, but the last fold was cycle %s: not delivered",
                        h.cycle, list(h.deliver_to), None if m is None else m[0])
            return []
        ids = []
        for r in h.deliver_to:
            i = m[1].get(r)
            if i is None:
                log.warning("cycle %d: consensus for rank %d, which this relay did not fold: not delivered", h.cycle, r)
            else:
                ids.append(i)
        self.fanouts += 1
        self.fanout_copies += len(ids)
        return ids

    def _open(self, m: pb.RelayMsg.FoldOpen) -> list[Message]:
        old = self._fold
        if old is not None and (old.want or old.parts):
            self.folds_discarded += 1
            log.warning("fold of cycle %d superseded by cycle %d: its %d part(s) discarded",
                        old.cycle, m.cycle, len(old.parts))
        self._fold = None
        if len(m.ranks) != len(m.identities) or len(set(m.identities)) != len(m.identities):
            log.warning("FoldOpen for cycle %d is malformed (ranks and identities disagree): not folding", m.cycle)
            return []
        self._members = (m.cycle, {int(r): bytes(i) for r, i in zip(m.ranks, m.identities)})
        if m.ranks:
            self._fold = _Fold(cycle=m.cycle, want={bytes(i): int(r) for r, i in zip(m.ranks, m.identities)})
        return []

    def _drop(self, cycle: int, rank: int) -> list[Message]:
        f = self._fold
        if f is None or f.cycle != cycle:
            return []  # that fold already left (the coordinator deals with the race)
        f.want = {i: r for i, r in f.want.items() if r != rank}
        f.parts.pop(rank, None)
        return self._maybe_flush()

    # -- rank -> relay ------------------------------------------------------------------

    def offer(self, message: Message) -> tuple[bool, list[Message]]:
        """(kept, upstream): ``kept`` False means forward ``message`` as it came."""
        f = self._fold
        if f is None or not f.want or len(message) < 3:
            return False, []
        identity = bytes(message[0])
        rank = f.want.get(identity)
        if rank is None or len(message[1]) != 0:
            return False, []
        env = pb.Envelope()
        try:
            env.ParseFromString(bytes(message[2]))
        except (DecodeError, ValueError, RuntimeError):
            return False, []
        if env.WhichOneof("body") != "round":
            return False, []
        h = env.round
        if (
            env.sender.kind != pb.Sender.KIND_RANK
            or env.sender.rank != rank
            or h.cycle != f.cycle
            or h.kind != pb.ROUND_KIND_MODEL
            or h.phase != pb.ROUND_PHASE_PARAMS
            or len(h.contributing_ranks) > 0
        ):
            return False, []
        shapes = _shapes(h)
        if env.blob_count != len(message) - 3 or (f.shapes is not None and shapes != f.shapes):
            # Broken or foreign-shaped: up it goes, raw, for the coordinator to refuse
            # with its reason; the fold stops waiting for it.
            log.warning("cycle %d: rank %d's round does not fit the fold; forwarded as is", f.cycle, rank)
            self.parts_forwarded += 1
            del f.want[identity]
            return False, self._maybe_flush()
        # Checked on arrival, not at the flush: a part refused later would go up behind
        # frames its rank sent after it, and the coordinator drops it as out of sequence
        # (the round then waits for it forever) instead of refusing it with its reason.
        arrays = None
        if not math.isfinite(h.weight) or h.weight < 0:
            return self._forward_raw(identity, f"weight {h.weight}")
        if h.weight > 0:
            try:
                arrays = unpack_round(h, message[3:])
            except BadTensor as e:
                return self._forward_raw(identity, f"does not decode: {e}")
            if any(m.dtype == pb.DTYPE_BF16 for m in h.tensors):
                arrays = None  # widened copies: decode again at the flush, not held twice
        f.shapes = f.shapes or shapes
        del f.want[identity]
        f.parts[rank] = _Part(h, message, arrays)
        return True, self._maybe_flush()

    def _forward_raw(self, identity: bytes, why: str) -> tuple[bool, list[Message]]:
        """A part the fold cannot carry goes up now, raw and in its rank's order, for the
        coordinator to refuse with its reason; the fold stops waiting for it."""
        f = self._fold
        assert f is not None
        log.warning("cycle %d: rank %d's round %s; forwarded as is", f.cycle, f.want[identity], why)
        self.parts_forwarded += 1
        del f.want[identity]
        return False, self._maybe_flush()

    def release(self) -> list[Message]:
        """Shutdown: the raw messages of a fold in progress (still valid on their own)."""
        f, self._fold = self._fold, None
        return [] if f is None else [f.parts[r].message for r in sorted(f.parts)]

    # -- flush --------------------------------------------------------------------------

    def _maybe_flush(self) -> list[Message]:
        f = self._fold
        if f is None or f.want:
            return []
        self._fold = None
        if not f.parts:
            return []
        out: list[Message] = []
        acc: Optional[list[np.ndarray]] = None
        ranks: list[int] = []
        weights: list[float] = []
        buffer_weights: list[float] = []
        bf16 = False
        for r in sorted(f.parts):
            part = f.parts[r]
            h = part.header
            bf16 = bf16 or any(m.dtype == pb.DTYPE_BF16 for m in h.tensors)
            if h.weight > 0:  # (checked on arrival: it decodes, its weight is finite)
                arrays = part.arrays if part.arrays is not None else unpack_round(h, part.message[3:])
                if acc is None:
                    acc = [a.copy() if not a.flags.writeable else a for a in arrays]
                else:
                    for s, a in zip(acc, arrays):
                        s += a
            ranks.append(r)
            weights.append(float(h.weight))
            buffer_weights.append(float(h.buffer_weight) if h.weight > 0 else 0.0)  # an idle part moved nothing
        if not ranks:
            return out
        total = math.fsum(weights)
        shapes, nbuf = f.shapes or ((), 0)
        if acc is None:  # every folded rank did no work: the schema alone, elided
            acc = [np.broadcast_to(np.float32(0), s) for s in shapes]
        header, blobs = pack_round(
            acc, cycle=f.cycle, weight=total, bf16=bf16, contributing_ranks=ranks,
            buffers=nbuf, buffer_weight=math.fsum(buffer_weights),
        )  # fmt: skip
        self.folds_sent += 1
        self.ranks_folded += len(ranks)
        header.relay_stats.CopyFrom(self.stats())  # the coordinator exports them (/metrics)
        out.append(self.endpoint.frames("round", header, blobs))
        return out

    def stats(self) -> pb.RelayStats:
        """This relay's counters so far, as they ride on each folded round upstream."""
        return pb.RelayStats(
            folds_sent=self.folds_sent, ranks_folded=self.ranks_folded, parts_forwarded=self.parts_forwarded,
            folds_discarded=self.folds_discarded, fanouts=self.fanouts, fanout_copies=self.fanout_copies,
        )
