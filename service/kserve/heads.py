"""The bounds of a v2 inference request's head, and the JSON head walked against them on its
bytes (`read_json`): every count a caller controls (inputs, outputs, a shape's dimensions, a
map's entries, a tensor's `data` numbers against its shape) is counted before Python objects
are made of it, so that a head of one huge list or map costs its bytes and is refused, not
built into objects eight to twenty-four times its size first. gRPC's message is counted on
its wire against the same bounds (`grpc_wire`)."""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable
from typing import NoReturn

from zen_mla import InvalidInputError, WireFormatError
from zen_mla.wire import MAX_DIM, viewable

__all__ = [
    "MAX_DIMS",
    "MAX_PARAMETERS",
    "MAX_STRING",
    "MAX_TENSORS",
    "SMALL_HEAD",
    "check_count",
    "check_shape",
    "read_json",
]

#: a shape's dimensions at most (the model's tensors have 3 or 1)
MAX_DIMS = 8
#: entries of one parameters map (or JSON object) at most (the protocol names 6 for a request,
#: 4 for a tensor)
MAX_PARAMETERS = 32
#: inputs, and outputs, of one request at most (the model has 5 inputs and 2 outputs)
MAX_TENSORS = 8
#: bytes of one JSON string at most (ids, names, datatypes, region names)
MAX_STRING = 4096
#: a JSON head of at most this many bytes is parsed without the walk: json.loads makes at most
#: about 1.5 MiB of objects of it (24 bytes a byte, for `{},` repeated), and the walk costs some
#: ten times json.loads on a head of a few hundred bytes
SMALL_HEAD = 64 << 10
#: lists and objects in a JSON head besides tensors' `data`, and how deep, at most (a request
#: has about 20, 4 deep: the request, its inputs, an input, its shape)
MAX_CONTAINERS = 64
MAX_DEPTH = 4

_SPACE = re.compile(rb"[ \t\n\r]*")
_STRING = re.compile(rb'"[^"\\\x00-\x1f]*(?:\\[^\x00-\x1f][^"\\\x00-\x1f]*)*"')
#: numbers and the commas between them (one regex match for a list of millions)
_NUMBERS = re.compile(rb"-?[0-9](?:[-+.0-9eE, \t\n\r]*[0-9])?")
_LITERAL = re.compile(rb"true|false|null|NaN|-?Infinity")
#: a tensor's `data`: numbers in lists, flat or nested (json.loads judges the syntax after)
_DATA_RUN = re.compile(rb"[-+.0-9eEINafinty,\[\] \t\n\r]*")
_DATA = re.compile(rb"\[[-+.0-9eEINafinty,\[\] \t\n\r]*\]")
_EMPTY = re.compile(rb"\[[ \t\n\r]*\]")


def check_shape(name: str, shape: object) -> tuple[int, ...]:
    """`shape` as dims: a list of whole numbers 0 <= d < MAX_DIM of fewer than MAX_DIM elements
    (InvalidInputError naming `name`.shape)."""
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape) and viewable(shape)):
        raise InvalidInputError(
            f"{name}.shape",
            "a list of whole numbers 0 <= d < 2^48, of fewer than 2^48 elements (a 0 dim "
            "counted as 1)",
            repr(shape)[:60],
        )
    return tuple(shape)


def check_count(where: str, datatype: str, shape: tuple[int, ...], count: int) -> None:
    """`count` values given for a tensor of `shape` (InvalidInputError naming `where`)."""
    expected = math.prod(shape)
    if count != expected:
        raise InvalidInputError(where, f"{expected} numbers ({datatype} {list(shape)})", str(count))


def _is_count(d: object) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_DIM


def read_json(raw: bytes) -> bytes:
    """`raw`, a v2 head (a JSON object), walked without building it: WireFormatError where it
    cannot be walked, InvalidInputError naming the field past a bound. Returns what json.loads
    may then parse: `raw`, or `raw` with its non-ASCII strings written as ASCII escapes (a
    head with one astral character would otherwise decode to a string of 4 bytes a byte)."""
    walk = _Walk(raw)
    walk.document()
    if not walk.foreign:
        return raw
    parts: list[bytes] = []
    at = 0
    for start, end in walk.foreign:
        parts += [raw[at:start], json.dumps(walk.text(start, end)).encode()]
        at = end
    parts.append(raw[at:])
    return b"".join(parts)


class _Walk:
    """One pass over a JSON head's bytes: containers opened and members counted as they come,
    a run of numbers taken by one regex match, a tensor's `data` counted (not walked) and held
    to its shape once the tensor's object ends."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.at = 3 if raw.startswith(codecs.BOM_UTF8) else 0
        self.containers = 0
        self.ascii = raw.isascii()
        self.foreign: list[tuple[int, int]] = []  # the non-ASCII strings' (start, end)

    def fail(self, what: str) -> NoReturn:
        raise WireFormatError("inference header", "a JSON object", f"{what} at byte {self.at}")

    def next(self) -> int:
        """The next byte past whitespace (-1 at the end)."""
        if self.at < len(self.raw) and self.raw[self.at] > 0x20:
            return self.raw[self.at]
        self.at = _SPACE.match(self.raw, self.at).end()  # type: ignore[union-attr]
        return self.raw[self.at] if self.at < len(self.raw) else -1

    def text(self, start: int, end: int) -> str:
        token = self.raw[start + 1 : end - 1]
        if token.isascii() and b"\\" not in token:
            return token.decode()
        try:
            value = json.loads(self.raw[start:end])
        except ValueError:
            value = None
        if not isinstance(value, str):
            self.fail("a broken string")
        return value

    def loads(self, span: tuple[int, int] | None) -> object:
        """A small value walked before (a shape, a datatype) as json.loads makes it; None where
        it is none or json.loads refuses it."""
        try:
            return None if span is None else json.loads(self.raw[span[0] : span[1]])
        except (ValueError, RecursionError):
            return None

    def string(self, where: str) -> tuple[int, int]:
        found = _STRING.match(self.raw, self.at)
        if found is None:
            self.fail("a broken string")
        start, end = found.span()
        if end - start - 2 > MAX_STRING:
            raise InvalidInputError(
                where, f"a string of at most {MAX_STRING} bytes", f"{end - start - 2} bytes"
            )
        if not self.ascii and not self.raw[start:end].isascii():
            self.foreign.append((start, end))
        self.at = end
        return start, end

    def open(self, where: str, depth: int) -> None:
        self.containers += 1
        if depth > MAX_DEPTH:
            raise InvalidInputError(
                where, f"lists and objects nested at most {MAX_DEPTH} deep in the request", "deeper"
            )
        if self.containers > MAX_CONTAINERS:
            raise InvalidInputError(
                where, f"at most {MAX_CONTAINERS} lists and objects in the request", "more"
            )
        self.at += 1

    def document(self) -> None:
        if self.next() != ord("{"):
            self.fail("no object")
        self.object("request", 1, self.request_member)
        if self.next() != -1:
            self.fail("more after the object")

    def value(self, where: str, depth: int) -> None:
        c = self.next()
        if c == ord("{"):
            self.object(where, depth, lambda key, d: self.value(f"{where}.{key}", d))
        elif c == ord("["):
            self.array(where, depth, MAX_PARAMETERS, "entries", self.value)
        elif c == ord('"'):
            self.string(where)
        else:
            found = _NUMBERS.match(self.raw, self.at) or _LITERAL.match(self.raw, self.at)
            if found is None:
                self.fail("no JSON value")
            self.at = found.end()

    def array(
        self, where: str, depth: int, most: int, what: str, item: Callable[[str, int], None]
    ) -> None:
        """A list of at most `most` members (`what`), each walked by `item`."""
        self.open(where, depth)
        members = 0
        if self.next() == ord("]"):
            self.at += 1
            return
        while True:
            run = _NUMBERS.match(self.raw, self.at)
            if run is not None:
                members += self.raw.count(b",", run.start(), run.end()) + 1
                self.at = run.end()
            else:
                item(f"{where}[{members}]", depth + 1)
                members += 1
            end = self.next()
            if members > most:
                got = str(members) if end == ord("]") else f"{members} or more"
                raise InvalidInputError(where, f"at most {most} {what}", got)
            if end == ord("]"):
                self.at += 1
                return
            if end != ord(","):
                self.fail("no ',' or ']' in a list")
            self.at += 1
            self.next()

    def object(
        self, where: str, depth: int, member: Callable[[str, int], None]
    ) -> dict[str, tuple[int, int]]:
        """An object of at most MAX_PARAMETERS members, each value walked by `member`; returns
        where each name's value lies."""
        self.open(where, depth)
        spans: dict[str, tuple[int, int]] = {}  # a name given twice: the last, as json.loads
        members = 0
        if self.next() == ord("}"):
            self.at += 1
            return spans
        while True:
            if self.next() != ord('"'):
                self.fail("no name in an object")
            key = self.text(*self.string(where))
            members += 1
            if members > MAX_PARAMETERS:
                raise InvalidInputError(where, f"at most {MAX_PARAMETERS} entries", "more")
            if self.next() != ord(":"):
                self.fail("no ':' after a name")
            self.at += 1
            start = self.next() and self.at
            member(key, depth + 1)
            spans[key] = (start, self.at)
            end = self.next()
            if end == ord("}"):
                self.at += 1
                return spans
            if end != ord(","):
                self.fail("no ',' or '}' in an object")
            self.at += 1

    # -- the request's own shape -------------------------------------------------------------

    def request_member(self, key: str, depth: int) -> None:
        if key in ("inputs", "outputs") and self.next() == ord("["):
            self.array(key, depth, MAX_TENSORS, "tensors", self.tensor)
        else:
            self.value(key, depth)

    def tensor(self, where: str, depth: int) -> None:
        """An input or a requested output: named by its `name` once that came; its `data`
        counted and held to its `shape`."""
        if self.next() != ord("{"):
            self.value(where, depth)
            return
        label = where
        data: list[tuple[int, int]] = []  # json.loads builds each, though it keeps the last

        def member(key: str, d: int) -> None:
            nonlocal label
            if key == "name" and self.next() == ord('"'):
                name = self.text(*self.string(f"{label}.name"))
                if name.isprintable() and len(name) <= 64:
                    label = name
            elif key == "shape" and self.next() == ord("["):
                self.array(f"{label}.shape", d, MAX_DIMS, "dimensions", self.value)
            elif key == "data" and self.next() == ord("["):
                found = _DATA.match(self.raw, self.at)
                if found is None or self.raw.count(b"[", *found.span()) != self.raw.count(
                    b"]", *found.span()
                ):
                    if _DATA_RUN.match(self.raw, self.at).end() == len(self.raw):  # type: ignore[union-attr]
                        self.fail("a list cut off")
                    raise InvalidInputError(
                        f"{label}.data", "a list of numbers (flat or nested)", "other values"
                    )
                data.append(found.span())
                self.at = found.end()
            else:
                self.value(f"{label}.{key}", d)

        spans = self.object(where, depth, member)
        for start, end in data:
            self.data(label, spans, start, end)

    def data(self, label: str, spans: dict[str, tuple[int, int]], start: int, end: int) -> None:
        """A tensor's `data` (raw[start:end]): no more lists than nesting by its shape makes,
        and as many numbers as its shape holds."""
        shape, datatype = self.loads(spans.get("shape")), self.loads(spans.get("datatype"))
        dims = check_shape(label, shape)
        kind = datatype if isinstance(datatype, str) else "?"
        nested = 1 + sum(math.prod(dims[: i + 1]) for i in range(len(dims) - 1))
        lists = self.raw.count(b"[", start, end)
        if lists > nested:
            raise InvalidInputError(
                f"{label}.data",
                f"numbers in at most {nested} lists ({kind} {list(dims)}: flat, or nested by "
                "the shape)",
                f"{lists} lists",
            )
        commas = self.raw.count(b",", start, end)
        empty = len(_EMPTY.findall(self.raw, start, end))
        check_count(f"{label}.data", kind, dims, commas + 1 - empty)
