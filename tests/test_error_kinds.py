"""Errors say which rule they broke (format.md §8): every exception the core raises carries its
`kind` (the core's `ErrorKind` by name) and the values that kind holds (`details`), so an
orchestrator tells a gap from an overlap from an unplaceable format without reading messages.
"""

from __future__ import annotations

import pickle
import typing

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import routed_experts as rx


def payload(values: list[int], start: int = 0, layers: int = 1) -> rx.RoutedExperts:
    array = np.array(values, dtype=np.int64).reshape(-1, layers, 2)
    return rx.RoutedExperts.from_array(array, start=start)


def raised(call: typing.Callable[[], object]) -> rx.RoutedExpertsError:
    with pytest.raises(rx.RoutedExpertsError) as info:
        call()
    return info.value


def test_each_kind_carries_its_values_and_its_class() -> None:
    cases: list[tuple[typing.Callable[[], object], type, str, dict[str, object]]] = [
        (lambda: rx.merge(payload([1, 2, 3, 4]), payload([5, 6], start=4)),
         rx.MergeError, "gap", {"stop": 2, "start": 4}),
        (lambda: rx.merge(payload([1, 2]), payload([1, 2, 3, 4], start=1, layers=2)),
         rx.MergeError, "shape", {"first": (1, 2), "second": (2, 2)}),
        (lambda: payload([1, 9, 3, 4], start=10).validate(num_experts=8),
         rx.PayloadError, "id", {"position": 10, "layer": 0}),
        (lambda: payload([1, 2, 0, 0]).validate(),
         rx.PayloadError, "rows_lost", {}),
        (lambda: rx.decode(payload([1, 2] * 32).to_json(), max_bytes=63),
         rx.PayloadError, "too_large", {"bytes": 64, "limit": 63}),
        (lambda: rx.decode(b'"~~~~"'), rx.PayloadError, "unplaced", {}),
        (lambda: rx.shard(np.zeros((6, 1, 2), np.int32), [0, 6], cp_size=2),
         rx.PayloadError, "unpadded", {"rows": 6, "multiple": 4}),
        (lambda: rx.from_response(b'{"usage":{"prompt_tokens":1,"prompt_tokens":2}}'),
         rx.PayloadError, "json", {"expected": "each key once in an object"}),
        (lambda: rx.decode(b"{}", start=-1), rx.PayloadError, "field", {"field": "start"}),
        (lambda: rx.from_response(b"{}"), rx.PayloadError, "not_response", {}),
    ]
    for call, cls, kind, details in cases:
        e = raised(call)
        assert type(e) is cls and e.kind == kind, (kind, repr(e))
        assert kind in rx._core._ERROR_KINDS
        for name, value in details.items():
            assert e.details[name] == value, (kind, dict(e.details))
    # The limit passed is raised by the Python knob, which the message names.
    e = raised(lambda: rx.decode(payload([1, 2] * 32).to_json(), max_bytes=63))
    assert "set_max_bytes" in str(e)


def test_a_turn_that_disagrees_with_the_held_rows_is_an_overlap_at_its_place() -> None:
    t = rx.Trajectory()
    t.append(payload([1, 2, 3, 4]))
    e = raised(lambda: t.append(payload([3, 5], start=1), overlap="check"))
    assert (type(e), e.kind, dict(e.details)) == (rx.MergeError, "overlap",
                                                   {"position": 1, "layer": 0})


def test_a_half_without_routing_is_named() -> None:
    routed = b'{"choices":[{"index":0,"routed_experts":' + payload([1, 2]).to_json() + b"}]}"
    bare = b'{"choices":[{"index":0,"text":"x"}]}'
    e = raised(lambda: rx.merge_response(routed, bare, require_routing=True))
    assert (e.kind, dict(e.details)) == ("missing_routing", {"half": "decode"})


def test_the_kind_survives_pickling_and_python_raised_errors_have_none() -> None:
    e = raised(lambda: rx.merge(payload([1, 2]), payload([5, 6], start=3)))
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.kind, dict(back.details)) == (rx.MergeError, "gap",
                                                           {"stop": 1, "start": 3})
    own = rx.PayloadError("raised in Python")
    assert own.kind is None and dict(own.details) == {}
    with pytest.raises(TypeError):
        own.details["x"] = 1  # type: ignore[index]  # the shared default cannot be changed


@given(st.integers(0, 50), st.integers(1, 20), st.integers(1, 20))
def test_a_gaps_details_are_where_the_rows_stop_and_start(start: int, rows: int, gap: int) -> None:
    first = payload([1, 2] * rows, start=start)
    later = payload([3, 4], start=start + rows + gap)
    e = raised(lambda: rx.merge(first, later))
    assert e.kind == "gap" and dict(e.details) == {"stop": start + rows,
                                                   "start": start + rows + gap}


@given(st.integers(0, 30), st.integers(2, 12), st.data())
def test_an_overlaps_details_are_the_first_differing_place(start: int, rows: int,
                                                           data: st.DataObject) -> None:
    values = list(range(2 * rows))
    t = rx.Trajectory()
    t.append(payload(values, start=start))
    at = data.draw(st.integers(1, rows - 1))
    changed = values[2 * at:]
    changed[0] = 10_000
    e = raised(lambda: t.append(payload(changed, start=start + at), overlap="check"))
    assert e.kind == "overlap" and dict(e.details) == {"position": start + at, "layer": 0}
