"""The error contract for integer arguments: every public function and method that takes a
count, position or size refuses a negative, a huge and a non-integer value with a
`RoutedExpertsError` naming the argument (never `OverflowError` or a conversion's `TypeError`),
and takes numpy's integers as integers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routed_experts as rx

P = rx.RoutedExperts.from_array(np.arange(12).reshape(6, 1, 2) % 7)
BODY = b'{"choices":[{"index":0,"routed_experts":' + P.to_json() + b"}]}"


def trajectory() -> rx.Trajectory:
    t = rx.Trajectory()
    t.append(P)
    return t


# (name, argument, call with that argument set to v)
CALLS: list[tuple[str, str, Callable[[Any], Any]]] = [
    ("decode", "start", lambda v: rx.decode(P.to_json(), start=v)),
    ("decode", "num_layers", lambda v: rx.decode(P.to_json(), num_layers=v)),
    ("decode", "top_k", lambda v: rx.decode(P.to_json(), top_k=v)),
    ("decode", "max_bytes", lambda v: rx.decode(P.to_json(), max_bytes=v)),
    ("from_response", "choice", lambda v: rx.from_response(BODY, v)),
    ("from_response", "start", lambda v: rx.from_response(BODY, start=v)),
    ("from_response", "num_layers", lambda v: rx.from_response(BODY, num_layers=v)),
    ("from_response", "top_k", lambda v: rx.from_response(BODY, top_k=v)),
    ("from_response", "max_bytes", lambda v: rx.from_response(BODY, max_bytes=v)),
    ("merge_response", "start", lambda v: rx.merge_response(BODY, BODY, start=v)),
    ("merge_response", "decode_start", lambda v: rx.merge_response(BODY, BODY, decode_start=v)),
    ("merge_response", "num_layers", lambda v: rx.merge_response(BODY, BODY, num_layers=v)),
    ("merge_response", "top_k", lambda v: rx.merge_response(BODY, BODY, top_k=v)),
    ("merge_response", "max_bytes", lambda v: rx.merge_response(BODY, BODY, max_bytes=v)),
    ("from_json", "max_bytes", lambda v: rx.RoutedExperts.from_json(P.to_json(), max_bytes=v)),
    ("from_array", "start", lambda v: rx.RoutedExperts.from_array(P.array, start=v)),
    ("from_array", "num_experts", lambda v: rx.RoutedExperts.from_array(P.array, num_experts=v)),
    ("from_transport", "start", lambda v: rx.RoutedExperts.from_transport(P.to_transport(), v)),
    ("slice", "start", lambda v: P.slice(v, 2)),
    ("slice", "stop", lambda v: P.slice(0, v)),
    ("validate", "num_experts", lambda v: P.validate(num_experts=v)),
    ("validation_report", "num_experts", lambda v: P.validation_report(num_experts=v)),
    ("truncate", "stop", lambda v: trajectory().truncate(v)),
    ("to_training", "num_tokens", lambda v: trajectory().to_training(v)),
    ("to_training", "max_missing", lambda v: trajectory().to_training(8, "zero", v)),
    ("set_max_bytes", "n", lambda v: rx.set_max_bytes(v)),
    ("StreamMerger", "start", lambda v: rx._core.StreamMerger(BODY, start=v)),
    ("StreamMerger", "max_line_bytes", lambda v: rx._core.StreamMerger(BODY, max_line_bytes=v)),
    ("pack", "pad_to_multiple", lambda v: rx.pack([P], pad_to_multiple=v)),
    ("pack", "pad_each_to_multiple", lambda v: rx.pack([P], pad_each_to_multiple=v)),
    ("shard", "cp_size", lambda v: rx.shard(P.array, [0, 6], cp_size=v)),
    ("shard", "cp_rank", lambda v: rx.shard(P.array, [0, 6], cp_rank=v)),
    ("shard", "tp_size", lambda v: rx.shard(P.array, [0, 6], tp_size=v)),
    ("shard", "tp_rank", lambda v: rx.shard(P.array, [0, 6], tp_rank=v)),
    ("expert_load", "num_experts", lambda v: rx.expert_load(P, v)),
]


@pytest.fixture(autouse=True)
def _keep_the_limit() -> Any:
    limit = rx.get_max_bytes()
    yield
    rx.set_max_bytes(limit)


@pytest.mark.parametrize(("value", "said"), [
    (-3, "non-negative"), (2**70, ""), ("7", "an integer"), (1.5, "an integer"),
])
@pytest.mark.parametrize(("name", "arg", "call"), CALLS, ids=[f"{n}-{a}" for n, a, _ in CALLS])
def test_a_bad_integer_argument_is_a_routed_experts_error_naming_it(
    name: str, arg: str, call: Callable[[Any], Any], value: Any, said: str
) -> None:
    with pytest.raises(rx.RoutedExpertsError) as e:
        call(value)
    assert f"`{arg}`" in str(e.value) or name == "expert_load", (name, str(e.value))
    assert said in str(e.value)


@pytest.mark.parametrize(("name", "arg", "call"), CALLS, ids=[f"{n}-{a}" for n, a, _ in CALLS])
def test_numpy_integers_are_integers(name: str, arg: str, call: Callable[[Any], Any]) -> None:
    # A valid value as numpy gives it: whatever the call then says, it is not about the type.
    value = np.int64(0 if arg in ("choice", "start", "cp_rank", "tp_rank", "decode_start") else 6)
    try:
        call(value)
    except rx.RoutedExpertsError as e:
        assert "expected an integer" not in str(e), (name, str(e))
