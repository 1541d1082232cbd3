"""Protobuf's wire format written by hand, for messages no generated class would write (counts
past every limit, truncated or mistyped fields): varints, field keys, length-delimited fields."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """`n` (>= 0) as a base-128 varint."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def key(number: int, wire: int) -> bytes:
    """A field's key: its number and wire type."""
    return varint(number << 3 | wire)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return key(number, 2) + varint(len(payload)) + payload
