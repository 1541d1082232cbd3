"""Admission's counters (no server): a body already read takes no upload slot, a small one
none either; each client's share of slots, queue places and bytes; who may be displaced."""

from __future__ import annotations

import asyncio

import pytest

from service.admission import SMALL_BODY, Admission
from service.settings import Settings
from zen_mla import QueueFullError
from zen_mla.caller import Caller


def test_a_body_read_already_holds_no_upload_slot_and_charges_its_bytes():
    a = Admission(
        Settings(max_uploads=1, max_queue=1, max_body_bytes=1000, max_inflight_bytes=1000)
    )
    reading = a.admit(SMALL_BODY + 1)  # the one upload slot, taken (a small body takes none)
    read = a.admit_read(600)  # a socket frame: admitted all the same, its bytes charged
    assert (a.uploads, a.inflight, a.inflight_bytes) == (1, 2, 600)
    with pytest.raises(QueueFullError, match="budget"):
        a.admit_read(500)
    assert (a.inflight, a.inflight_bytes) == (2, 600)  # nothing held by the refusal
    read.enqueue()
    with pytest.raises(QueueFullError, match="queued"):
        a.admit_read(1)
    read.close()
    reading.close()
    assert (a.uploads, a.inflight, a.queued, a.inflight_bytes) == (0, 0, 0, 0)


A, B, C = Caller.of("10.0.0.1"), Caller.of("10.0.0.2"), Caller.of(1000)


def _settings(**kw) -> Settings:
    base = {"max_uploads": 4, "max_queue": 4, "max_body_bytes": 1 << 20}
    return Settings(**(base | {"max_inflight_bytes": 1 << 22} | kw))


def test_a_client_alone_takes_every_place_and_another_still_gets_its_share():
    a = Admission(_settings())
    flood = [a.admit_read(10, A) for _ in range(4)]
    for t in flood:
        t.enqueue()
    with pytest.raises(QueueFullError, match="4 of them this caller's"):
        a.admit_read(10, A)  # alone it had them all; no more past the cap
    mine = [a.admit_read(10, B) for _ in range(2)]  # its share of 4 between two: 2
    for t in mine:
        t.enqueue()
    with pytest.raises(QueueFullError):
        a.admit_read(10, B)
    assert (a.queued, a.places.held[A], a.places.held[B]) == (6, 4, 2)
    flood.pop().close()  # the flood's places come back; it may not refill past the cap
    with pytest.raises(QueueFullError):
        a.admit_read(10, A)
    third = a.admit_read(10, C)  # a third client: its share is 4 // 3 = 1
    third.enqueue()
    with pytest.raises(QueueFullError):
        a.admit_read(10, C)
    for t in [*flood, *mine, third]:
        t.close()
    assert (a.queued, a.inflight, a.inflight_bytes, dict(a.places.held)) == (0, 0, 0, {})


def test_the_share_exemptions_stay_within_the_ceiling():
    """Past the cap, places go only to clients holding none, one each, up to the cap plus
    the connection cap."""
    a = Admission(_settings(max_queue=8, max_connections=8))
    held = []
    for client in [A] * 8 + [Caller.of(f"10.1.0.{i}") for i in range(40)]:
        try:
            t = a.admit_read(1, client)
            t.enqueue()
            held.append(t)
        except QueueFullError:
            pass
    assert a.queued == 16
    assert a.places.held[A] == 8


def test_a_small_body_holds_no_upload_slot():
    a = Admission(_settings(max_uploads=1))
    big = a.admit(1 << 20, A)
    with pytest.raises(QueueFullError, match="being read"):
        a.admit(1 << 20, A)
    small = a.admit(1024, A)  # a few KiB: never waits for a slot
    assert a.uploads == 1
    for t in (big, small):
        t.close()


def test_an_upload_keeping_the_minimum_rate_is_never_displaced(monkeypatch):
    a = Admission(_settings(max_uploads=2, min_body_rate=1e6, body_grace_s=1.0))
    now = [100.0]
    monkeypatch.setattr("service.admission.time.monotonic", lambda: now[0])
    keeping_up, behind = a.admit(1 << 20, A), a.admit(1 << 20, A)
    now[0] += 0.5
    with pytest.raises(QueueFullError):  # nothing read yet, but in its grace: not judged
        a.admit(1 << 20, A)
    now[0] += 1.5
    keeping_up.got = int(1.5e6 * 2)  # 1.5 MB/s: above the minimum
    behind.got = int(0.5e6 * 2)  # 0.5 MB/s: fallen behind it
    newcomer = a.admit(1 << 20, A)  # takes the slot of the one behind, past its grace
    assert behind.displaced and not keeping_up.displaced
    behind.close()
    with pytest.raises(QueueFullError):  # every upload left keeps up: none is cut off
        a.admit(1 << 20, A)
    assert not keeping_up.displaced
    for t in (keeping_up, newcomer):
        t.close()
    assert (a.uploads, a.inflight) == (0, 0)


def test_another_clients_upload_is_let_in_within_its_share():
    a = Admission(_settings(max_uploads=4))
    flood = [a.admit(1 << 20, A) for _ in range(4)]
    with pytest.raises(QueueFullError):
        a.admit(1 << 20, A)
    other = a.admit(1 << 20, B)  # no upload of A's fell behind: B's share lets it in
    assert a.uploads == 5
    for t in [*flood, other]:
        t.close()


def test_an_upload_whose_read_timed_out_already_is_displaced_without_error():
    """Its timer expired (the read ends at its next turn, giving its slot back): displacing it
    must not reschedule the expired timer (a RuntimeError, answered 500 to the newcomer, seen on
    a 16-core Intel host), and the newcomer is let in."""

    async def main() -> None:
        a = Admission(_settings(max_uploads=1, min_body_rate=1e6, body_grace_s=0.0))
        dying = a.admit(1 << 20, A)
        timers: list[asyncio.Timeout] = []

        async def read() -> None:
            async with asyncio.timeout(0) as timer:
                timers.append(timer)
                await asyncio.sleep(10)

        with pytest.raises(TimeoutError):
            await read()
        dying.timer = timers[0]
        assert dying.timer.expired()
        dying.started -= 1.0  # past its grace, nothing read
        newcomer = a.admit(1 << 20, A)  # no RuntimeError
        assert dying.displaced
        for t in (dying, newcomer):
            t.close()

    asyncio.run(main())


def test_a_client_holding_nothing_gets_a_place_however_many_others_hold_some():
    """Clients holding a place each of a queue of 4: another, holding nothing, still gets one
    (its share, 4 // 9, is 0) up to the ceiling (the cap and 4 connections); one holding a
    place already gets no second."""
    a = Admission(_settings(max_queue=4, max_connections=4))
    held = []
    for i in range(8):
        t = a.admit_read(1, Caller.of(f"10.2.0.{i}"))
        t.enqueue()
        held.append(t)
    assert a.queued == 8  # the cap, then one each for those holding none, to the ceiling
    with pytest.raises(QueueFullError):  # at the ceiling: no more, whoever asks
        a.admit_read(1, Caller.of("10.2.0.99"))
    held.pop().close()
    newcomer = a.admit_read(1, Caller.of("10.2.0.99"))
    newcomer.enqueue()
    with pytest.raises(QueueFullError):
        a.admit_read(1, Caller.of("10.2.0.99"))  # it holds one, over the cap: its share is 0
    for t in [*held, newcomer]:
        t.close()


def test_byte_shares_never_add_up_past_twice_the_budget():
    """Fifteen clients join one after another, each taking what it may while fewer hold any:
    the bytes held never pass twice the budget (each share is judged against the clients
    holding now, not when it was taken)."""
    a = Admission(_settings(max_inflight_bytes=256 << 20, max_body_bytes=1 << 20))
    tickets = []
    for i in range(15):
        t = a.admit_read(0, Caller.of(f"10.3.0.{i}"))
        tickets.append(t)
        while True:
            try:
                t.charge(8 << 20)
            except QueueFullError:
                break
        assert a.inflight_bytes <= 2 * (256 << 20)
    assert a.inflight_bytes <= 2 * (256 << 20)
    assert all(t.charged > 0 for t in tickets), "every client got some bytes"
    for t in tickets:
        t.close()
    assert a.inflight_bytes == 0


def test_the_bytes_of_each_kind_go_back_when_their_part_is_done():
    """A request's kernel bytes go back when its work is done, its body's when its buffers
    are, and its answer's only when the answer's charge is closed, after the ticket."""

    async def main() -> None:
        a = Admission(_settings())
        t = a.admit_read(1000, A)
        t.charge(300, "kernel")
        t.charge(200, "answer")
        assert dict(a.held_bytes) == {"body": 1000, "kernel": 300, "answer": 200}
        t.refund("kernel")
        t.refund("body")
        charge = t.keep("answer")
        t.close()
        assert (a.inflight, a.inflight_bytes, a.bytes.held[A]) == (0, 200, 200)
        charge.close_soon()  # as a finalizer in another thread would
        await asyncio.sleep(0)
        charge.close()  # once only
        assert (a.inflight_bytes, dict(a.bytes.held), a.held_bytes["answer"]) == (0, {}, 0)

    asyncio.run(main())
