"""Admission's counters (no server): a body already read takes no upload slot."""

from __future__ import annotations

import pytest

from service.admission import Admission
from service.settings import Settings
from zen_mla import QueueFullError


def test_a_body_read_already_holds_no_upload_slot_and_charges_its_bytes():
    a = Admission(
        Settings(max_uploads=1, max_queue=1, max_body_bytes=1000, max_inflight_bytes=1000)
    )
    reading = a.admit(10)  # the one upload slot, taken
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
