"""flodl.wire: the protocol as data.

Generated protobuf types (``pb``), multipart framing with version/session/sequence
checks, and tensor frames for the bus data plane. No sockets here: callers hand us
lists of frames and get lists of frames back.
"""

from . import flodl_pb2 as pb
from ._protowire import LEN, VARINT, tag, varint
from ._codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DELIMITER,
    MAX_BLOBS,
    MAX_ENVELOPE_BYTES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    MIN_RANK_MINOR,
    Decoded,
    Endpoint,
    SeqTracker,
    decode,
    sender_key,
    split_routing,
)
from ._errors import (
    BadTensor,
    MalformedFrame,
    OutOfSequence,
    Oversized,
    RouteMismatch,
    VersionMismatch,
    WireError,
    WrongSession,
)
from ._tensors import bf16_to_f32, f32_to_bf16, pack_round, split_buffers, unpack_round

__all__ = [
    "tag",
    "varint",
    "VARINT",
    "LEN",
    "pb",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "MIN_RANK_MINOR",
    "DELIMITER",
    "MAX_BLOBS",
    "MAX_ENVELOPE_BYTES",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Decoded",
    "Endpoint",
    "SeqTracker",
    "decode",
    "sender_key",
    "split_routing",
    "WireError",
    "MalformedFrame",
    "VersionMismatch",
    "WrongSession",
    "OutOfSequence",
    "RouteMismatch",
    "BadTensor",
    "Oversized",
    "pack_round",
    "unpack_round",
    "split_buffers",
    "f32_to_bf16",
    "bf16_to_f32",
]
