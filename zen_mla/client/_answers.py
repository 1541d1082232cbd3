"""What the service answers, read and checked: the body up to what a request can need, the
results against the request, a problem+json as the exception the service raised, /health."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from .. import errors, wire
from ..attention import PrefillOutput
from ..attention.batch import check_out
from ..copying import copied, copy_into
from ..errors import BY_STATUS, InvalidInputError, OverloadedError, ProtocolError, ZenMLAError
from ..regions.connection import Layout
from ..wire import regions_json
from ..wire.dtypes import BY_SAFETENSORS, BY_TORCH
from ._memory import MIN_BYTES, AnswerMemory

__all__ = [
    "AnswerSpec",
    "Body",
    "Bytes",
    "PrefillOutput",
    "answered",
    "called",
    "decoded",
    "health_json",
    "problem",
]

MAX_PROBLEM_BYTES = 64 << 10  # of an error's body; the rest is not read

# an answer's bytes: a bytearray, or a view of an AnswerMemory buffer
Bytes = bytearray | memoryview


def _content_length(headers: httpx.Headers) -> int | None:
    values = set(headers.get_list("content-length"))
    if not values:
        return None
    text = values.pop()
    if values or not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise ProtocolError(f"Content-Length: expected a number of bytes, got {text!r:.40}")
    return int(text)


class Body:
    """An answer's bytes as they come, never more than `limit`: an answer announced or running
    past it is a ProtocolError before the rest is read; with `cut`, the rest is left unread.
    `check` runs before each chunk is kept (the call's deadline: a transport of the caller's own
    may wait on each read as long as it likes). With `memory`, an answer of `MIN_BYTES` or more
    lands in a buffer of it (its tensors are then views of that)."""

    def __init__(
        self,
        headers: httpx.Headers,
        limit: int,
        check: Callable[[], None],
        cut: bool,
        memory: AnswerMemory | None = None,
    ) -> None:
        self.length = _content_length(headers)
        self._limit, self._check, self._cut, self._pos = limit, check, cut, 0
        # False: nothing is to be read (a problem announced past its cap is not waited for)
        self.wanted = self.length is None or self.length <= limit
        if not self.wanted and not cut:
            raise ProtocolError(
                f"the service announced a {self.length}-byte answer; "
                f"this request's is at most {limit} bytes"
            )
        # where the length is known, the answer lands in one buffer of that size (the decoded
        # tensors are views of it)
        known = self.length if self.length is not None and not cut and self.wanted else 0
        self.buf: Bytes = (
            memory.take(known) if memory is not None and known >= MIN_BYTES else bytearray(known)
        )

    @classmethod
    def of(
        cls,
        status: int,
        headers: httpx.Headers,
        limit: int,
        check: Callable[[], None],
        memory: AnswerMemory | None = None,
    ) -> Body:
        """200: the answer, `limit` bytes at most (in `memory` where large); another status: its
        problem, cut short."""
        if status == 200:
            return cls(headers, limit, check, cut=False, memory=memory)
        return cls(headers, MAX_PROBLEM_BYTES, check, cut=True)

    @property
    def left(self) -> int:
        """Bytes still to come of an answer of known length (0 where the length is unknown)."""
        if self.length is None or self._cut or not self.wanted:
            return 0
        return self.length - self._pos

    def rest(self, most: int) -> memoryview:
        """Where the next bytes go, at most `most` of them (read straight into it, then
        `advance`)."""
        self._check()
        return memoryview(self.buf)[self._pos : self._pos + min(most, self.left)]

    def advance(self, n: int) -> None:
        self._pos += n

    def take(self, chunk: bytes) -> bool:
        """Keep `chunk`; False once no more is to be read."""
        self._check()
        end = self._pos + len(chunk)
        if end > self._limit:
            if self._cut:
                assert isinstance(self.buf, bytearray)
                self.buf += chunk[: self._limit - self._pos]
                return False
            raise ProtocolError(
                f"the service's answer runs past {self._limit} bytes, the most this request needs"
            )
        if self.length is not None and not self._cut:
            if end > self.length:
                raise ProtocolError(f"the answer runs past its Content-Length of {self.length}")
            self.buf[self._pos : end] = chunk
        else:
            assert isinstance(self.buf, bytearray)
            self.buf += chunk
        self._pos = end
        return True

    def whole(self) -> Bytes:
        if self.wanted and self.length is not None and not self._cut and self._pos != self.length:
            raise ProtocolError(f"the answer ended after {self._pos} of its {self.length} bytes")
        return self.buf


def _json_object(body: bytes | Bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body if isinstance(body, bytes | bytearray) else bytes(body))
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def problem(status: int, body: bytes | Bytes, headers: httpx.Headers) -> ZenMLAError:
    """The exception the service raised, from its problem+json and its Retry-After."""
    found = _json_object(body)
    if found is None:
        found = {"detail": bytes(body[:200]).decode("utf-8", "replace") or f"HTTP {status}"}
    return _raised(status, found, headers.get("retry-after"))


def _raised(status: int, found: Mapping[str, Any], retry_after: object) -> ZenMLAError:
    """The one translation of a problem (a problem+json's fields, or a region-socket call's
    error reply, which carries the same) to the exception the service raised (one table:
    `errors`), its fix hint and retry hint included."""
    name = str(found.get("type", "")).rpartition(":")[2]
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ZenMLAError)):
        cls = BY_STATUS.get(status, ZenMLAError)
    detail = str(found.get("detail") or found.get("error") or f"HTTP {status}")[:2000]
    if issubclass(cls, InvalidInputError):
        hint = found.get("hint")
        return cls(
            str(found.get("tensor") or "body"),
            str(found.get("expected") or "a valid request"),
            str(found.get("got") or detail),
            hint if isinstance(hint, str) else "",
        )
    if issubclass(cls, OverloadedError):
        retry = str(retry_after) if type(retry_after) in (int, str) else ""
        ok = retry.isascii() and retry.isdigit() and len(retry) <= 6
        return cls(detail, float(retry) if ok else None)
    return cls(detail)


@dataclass(frozen=True, slots=True)
class AnswerSpec:
    """What the answer to a request must hold, by name: (shape, dtype as safetensors names it).
    `out` [Tq, H, Dv] in v's dtype; `lse` [H, Tq] float32, only when asked. `into`: the
    caller's tensor that `out` is written to (`prefill(out=)`), else None."""

    want: dict[str, tuple[tuple[int, ...], str]]
    into: torch.Tensor | None = None

    @classmethod
    def of(
        cls, tensors: Mapping[str, torch.Tensor], return_lse: bool, out: torch.Tensor | None = None
    ) -> AnswerSpec:
        """InvalidInputError naming `out` when one is given that cannot hold the result."""
        q, v = tensors["q"], tensors["v"]
        tq, heads = int(q.shape[0]), int(q.shape[1])
        want: dict[str, tuple[tuple[int, ...], str]] = {
            "out": ((tq, heads, int(v.shape[2])), BY_TORCH[v.dtype].safetensors)
        }
        if return_lse:
            want["lse"] = ((heads, tq), "F32")
        if out is not None:
            check_out(out, q, v)
        return cls(want, out)

    @property
    def return_lse(self) -> bool:
        return "lse" in self.want

    @property
    def tensor_bytes(self) -> int:
        """The bytes of the answer's tensors."""
        return sum(math.prod(s) * BY_SAFETENSORS[d].torch.itemsize for s, d in self.want.values())

    @property
    def max_answer(self) -> int:
        """The most bytes a safetensors answer can take: the header cap and the tensors."""
        return 8 + wire.MAX_HEADER_BYTES + self.tensor_bytes

    def check(self, got: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
        if set(got) != set(self.want):
            raise ProtocolError(
                f"answer: expected tensors {sorted(self.want)}, got {sorted(got)[:5]}"
            )
        for name, (shape, dtype) in self.want.items():
            if got[name] != (shape, dtype):
                raise ProtocolError(
                    f"{name}: expected {dtype} {list(shape)}, got {got[name][1]} "
                    f"{list(got[name][0])}"
                )


def decoded(
    status: int,
    body: Bytes,
    headers: httpx.Headers,
    outputs: AnswerSpec,
    device: torch.device,
) -> PrefillOutput:
    """The results in a /prefill answer, checked against the request, on the caller's device."""
    if status != 200:
        raise problem(status, body, headers)
    try:
        # ValueError: torch.frombuffer of no bytes, and the decoder's errors (a ValueError each)
        raw = torch.frombuffer(body, dtype=torch.uint8)
        tensors, _meta = wire.decode(raw, wire.RESPONSE_TENSORS)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the answer is not a readable safetensors file: {exc}") from exc
    outputs.check({n: (tuple(t.shape), BY_TORCH[t.dtype].safetensors) for n, t in tensors.items()})
    if outputs.into is not None:
        out = copy_into(outputs.into, tensors["out"])
    else:
        out = tensors["out"].to(device)
    if outputs.return_lse:
        return out, tensors["lse"].to(device)
    return out


def answered(
    status: int,
    body: Bytes,
    headers: httpx.Headers,
    layout: Layout,
    outputs: AnswerSpec,
    device: torch.device,
    memory: AnswerMemory | None = None,
) -> PrefillOutput:
    """The results a region request's answer points at, checked against the request and copied
    out of the scratch region (which the next request reuses), on the caller's device (in
    `memory` where large and on the CPU); an `out` of the caller's that the service wrote where
    it lies is returned as it is."""
    if status != 200:
        raise problem(status, body, headers)
    try:
        answer = regions_json.decode(bytes(body), wire.RESPONSE_TENSORS)
    except ZenMLAError as exc:
        raise ProtocolError(f"the answer is not a readable region answer: {exc}") from exc
    outputs.check({n: (p.shape, p.dtype) for n, p in answer.places.items()})
    for name, place in answer.places.items():
        if place != layout.places[name]:
            raise ProtocolError(f"{name}: expected written at {layout.places[name]}, got {place}")
    if outputs.into is layout.out:  # the caller's own region: written there by the service
        out = layout.out
    elif outputs.into is not None:  # out of the region straight into the caller's tensor
        out = copy_into(outputs.into, layout.out)
    else:
        out = _copied(layout.out, device, memory)
    if layout.lse is None:
        return out
    return out, _copied(layout.lse, device, memory)


def _copied(t: torch.Tensor, device: torch.device, memory: AnswerMemory | None) -> torch.Tensor:
    if device.type != "cpu":
        return t.to(device, copy=True)
    if memory is None or t.nbytes < MIN_BYTES:
        return copied(t)
    return copy_into(torch.frombuffer(memory.take(t.nbytes), dtype=t.dtype).view(t.shape), t)


def health_json(status: int, body: Bytes) -> dict[str, Any]:
    health = _json_object(body)
    if health is None:
        raise ProtocolError(
            f"/health: expected a JSON object, got HTTP {status} with {bytes(body[:80])!r}"
        )
    return health


def called(
    reply: Mapping[str, Any],
    layout: Layout,
    outputs: AnswerSpec,
    device: torch.device,
    memory: AnswerMemory | None = None,
) -> PrefillOutput:
    """The results a region-socket call's reply points at, as `answered` reads an HTTP answer:
    `{"ok": true, "body": <the regions JSON answer>}`, or an error reply raised as its class."""
    if reply.get("ok") is not True:
        status = reply.get("status")
        code = status if type(status) is int else 500
        raise _raised(code, reply, reply.get("retry_after"))
    body = reply.get("body")
    if not isinstance(body, str):
        raise ProtocolError(f"the call's reply: expected a body, got {type(body).__name__}")
    return answered(200, bytearray(body.encode()), _NO_HEADERS, layout, outputs, device, memory)


_NO_HEADERS = httpx.Headers()
