"""Resource limits of every process that receives from the network (no numpy, no zmq).

Two layers, each bounding what one peer can make a receiver hold:

- ``max_message_bytes`` (coordinator setting; worker side ``FLODL_MAX_MESSAGE_BYTES``, or
  ``--max-message-bytes`` for the agent and relay): ZeroMQ's ``MAXMSGSIZE`` on every socket
  that receives from another process (coordinator ROUTER, relay frontend and backend, rank
  DEALER; the agent, which only ever gets small control frames, uses
  ``MAX_ENVELOPE_BYTES``). libzmq applies it to each *part* of a multipart message (checked
  with libzmq 4.3.5), and a tensor travels as one part, so the limit is the largest single
  tensor on the wire: the default, 2 GiB, holds an f32 embedding of 128k x 4096. A peer
  that sends a bigger part is disconnected by libzmq before the bytes are buffered.
  0 = no limit.
- ``MAX_ENVELOPE_BYTES``: the protobuf envelope part. Tensors never travel in it, so even a
  round header describing 65536 tensors is under 2 MiB; a bigger envelope is refused
  (``flodl.wire.Oversized``) before it is parsed, so it can never reach a journal.
"""

from __future__ import annotations

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MIN_MAX_MESSAGE_BYTES",
    "ENV_MAX_MESSAGE_BYTES",
    "zmq_maxmsgsize",
    "parse_max_message_bytes",
    "max_message_bytes_problem",
]

MAX_ENVELOPE_BYTES = 4 << 20
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30
# Below this even a legitimate envelope (MAX_ENVELOPE_BYTES) could be cut off.
MIN_MAX_MESSAGE_BYTES = MAX_ENVELOPE_BYTES
ENV_MAX_MESSAGE_BYTES = "FLODL_MAX_MESSAGE_BYTES"


def zmq_maxmsgsize(max_message_bytes: int) -> int:
    """The ``zmq.MAXMSGSIZE`` value for a ``max_message_bytes`` setting (0 = no limit = -1)."""
    return max_message_bytes if max_message_bytes > 0 else -1


def parse_max_message_bytes(text: str, name: str = ENV_MAX_MESSAGE_BYTES) -> int:
    """``text`` as a ``max_message_bytes`` value; ValueError naming ``name`` if it is not one."""
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer (bytes; 0 = no limit)") from None
    why = max_message_bytes_problem(n)
    if why:
        raise ValueError(f"{name}={n} {why}")
    return n


def max_message_bytes_problem(n: int) -> str:
    """Why ``n`` is not a usable ``max_message_bytes``, or ''."""
    if n != 0 and n < MIN_MAX_MESSAGE_BYTES:
        return f"must be 0 (no limit) or >= {MIN_MAX_MESSAGE_BYTES} (the largest envelope)"
    return ""
