"""Protobuf's wire format, by hand, for the few places that write it in pieces: the
envelope around a body serialised once (``Endpoint.frames``), a broadcast's shared body
behind each message's own ``command_id``, a round's ``Update`` (``flodl.core``). What
they write is checked against protobuf's own serialisation (tests/unit/wire)."""

from __future__ import annotations

__all__ = ["varint", "tag", "VARINT", "LEN"]

VARINT, LEN = 0, 2  # the wire types used here


def varint(n: int) -> bytes:
    """A non-negative integer as a base-128 varint (a uint64 field's; protobuf refuses a
    negative one too)."""
    if n < 0x80:
        if n < 0:
            raise ValueError(f"a varint here is unsigned: {n}")
        return _SMALL[n]
    if n < 0x4000:  # two or three bytes: the first 2 million sequence numbers, most body lengths
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    if n >> 64:
        raise ValueError(f"a varint here is at most 64 bits: {n}")  # protobuf refuses it too, not wraps it
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A field's key: its number and wire type."""
    return varint((number << 3) | wire_type)


_SMALL = [bytes((i,)) for i in range(0x80)]
