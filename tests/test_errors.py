"""The one exception tree: every class has a status (or is the client's own), the table's
derived maps read back to it, and every error crosses the pool's process boundary as the class it
was raised as."""

from __future__ import annotations

import pickle
import re

import pytest

from zen_mla import errors
from zen_mla.errors import (
    BY_STATUS,
    ERROR_CODES,
    ERROR_STATUSES,
    STATUS,
    InvalidInputError,
    KernelError,
    QueueFullError,
    WorkTooLargeError,
    ZenMLAError,
    from_parts,
    parts_of,
)

CLIENT_SIDE = {errors.SharedMemoryUnavailableError, errors.ProtocolError}
TREE = [
    getattr(errors, n)
    for n in errors.__all__
    if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), ZenMLAError)
]


def test_every_class_has_a_status_and_the_docstring_draws_it():
    for cls in TREE:
        assert cls.__name__ in (errors.__doc__ or ""), f"{cls.__name__} missing from the tree"
        if cls not in CLIENT_SIDE and cls not in (ZenMLAError,):
            assert errors.status_of(_one(cls)) in STATUS.values(), cls
    for status, cls in BY_STATUS.items():
        assert errors.status_of(_one(cls)) == status


def test_by_status_reads_each_status_back_to_the_class_a_client_raises():
    raised = [row for row in ERROR_CODES if row.client_raises]
    assert sorted(row.http for row in raised) == list(ERROR_STATUSES)  # one class a status
    assert {row.http: row.error for row in raised} == BY_STATUS
    for status, cls in BY_STATUS.items():
        assert STATUS[cls] == status


def test_status_is_the_table_in_its_order():
    assert list(STATUS.items()) == [(row.error, row.http) for row in ERROR_CODES]
    for i, row in enumerate(ERROR_CODES):  # most specific first: no row hides a later one
        later = [r.error for r in ERROR_CODES[i + 1 :] if issubclass(r.error, row.error)]
        assert not later, f"{row.error.__name__} comes before its subclasses {later}"


def test_the_docstring_draws_each_class_with_its_status():
    drawn = dict(re.findall(r"─ (\w+Error)\b.*?\s(\d{3}|-)$", errors.__doc__ or "", re.M))
    for cls in TREE:
        if cls in STATUS:
            assert drawn.get(cls.__name__) == str(STATUS[cls]), cls
        else:  # a parent with no status of its own, or the client's own
            assert drawn.get(cls.__name__) in (None, "-"), cls
            assert (drawn.get(cls.__name__) == "-") == (cls in CLIENT_SIDE), cls


def _one(cls: type[ZenMLAError]) -> ZenMLAError:
    if issubclass(cls, InvalidInputError):
        return cls("q", "a thing", "another", "Do this")
    return cls("why")


@pytest.mark.parametrize("cls", TREE, ids=lambda c: c.__name__)
def test_an_error_crosses_a_process_boundary_as_its_class(cls):
    raised = _one(cls)
    parts = pickle.loads(pickle.dumps(parts_of(raised)))  # as the worker's pipe carries them
    again = from_parts(*parts)
    assert type(again) is cls and str(again) == str(raised)
    if isinstance(raised, InvalidInputError):
        assert isinstance(again, InvalidInputError)
        assert (again.name, again.expected, again.got, again.hint) == (
            raised.name,
            raised.expected,
            raised.got,
            raised.hint,
        )


def test_anything_else_is_not_ours():
    assert from_parts(*parts_of(RuntimeError("segfault-ish"))) is None
    assert from_parts("Exception", "x", ()) is None
    assert from_parts("status_of", "x", ()) is None  # a name of the module, not a class
    assert isinstance(_one(WorkTooLargeError), InvalidInputError)
    assert isinstance(_one(QueueFullError), ZenMLAError)
    assert KernelError in TREE
