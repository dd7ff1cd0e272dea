"""The error contract (format.md §8): every public function and method refuses a negative, a
huge and a wrong-typed argument with a `RoutedExpertsError` naming the argument (never
`OverflowError`, a conversion's `TypeError` or a panic), and takes numpy's integers as
integers."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import routed_experts as rx

P = rx.RoutedExperts.from_array(np.arange(12).reshape(6, 1, 2) % 7)
BODY = b'{"choices":[{"index":0,"routed_experts":' + P.to_json() + b"}]}"


def _fed() -> rx.BodyReader:
    reader = rx.BodyReader()
    reader.feed(BODY)
    return reader


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
    ("group_from_response", "start", lambda v: rx.group_from_response(BODY, start=v)),
    ("group_from_response", "num_layers", lambda v: rx.group_from_response(BODY, num_layers=v)),
    ("group_from_response", "top_k", lambda v: rx.group_from_response(BODY, top_k=v)),
    ("group_from_response", "max_bytes", lambda v: rx.group_from_response(BODY, max_bytes=v)),
    ("BodyReader", "max_bytes", lambda v: rx.BodyReader(max_bytes=v)),
    ("BodyReader.group", "start", lambda v: _fed().group(start=v)),
    ("BodyReader.group", "num_layers", lambda v: _fed().group(num_layers=v)),
    ("BodyReader.group", "top_k", lambda v: _fed().group(top_k=v)),
    ("BodyReader.group", "max_bytes", lambda v: _fed().group(max_bytes=v)),
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
    ("pack_shard", "pad_to_multiple", lambda v: rx.pack_shard([P], pad_to_multiple=v)),
    ("pack_shard", "cp_size", lambda v: rx.pack_shard([P], cp_size=v)),
    ("pack_shard", "cp_rank", lambda v: rx.pack_shard([P], cp_rank=v)),
    ("pack_shard", "tp_size", lambda v: rx.pack_shard([P], tp_size=v)),
    ("pack_shard", "tp_rank", lambda v: rx.pack_shard([P], tp_rank=v)),
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


# Every public callable with arguments, and a call of it that succeeds: the sweep below sets one
# argument at a time to a bad value. A public callable missing here fails
# `test_the_sweep_covers_every_public_callable`.
def _merger(**kw: Any) -> Any:
    from routed_experts.proxy import StreamMerger

    return StreamMerger(**kw)


def _traj(method: str) -> Callable[..., Any]:
    return lambda **kw: getattr(trajectory(), method)(**kw)


VALID: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "agreement": (rx.agreement, {"a": P, "b": P}),
    "decode": (rx.decode, {"value": P.to_json()}),
    "detect_format": (rx.detect_format, {"value": P.to_json()}),
    "encode": (rx.encode, {"payload": P}),
    "expert_load": (rx.expert_load, {"routing": P, "num_experts": 8}),
    "from_response": (rx.from_response, {"body": BODY}),
    "group_from_response": (rx.group_from_response, {"body": BODY}),
    "BodyReader": (rx.BodyReader, {}),
    "BodyReader.feed": (lambda **kw: rx.BodyReader().feed(**kw), {"chunk": BODY}),
    "BodyReader.group": (lambda **kw: _fed().group(**kw), {}),
    "merge": (rx.merge, {"prefill": P, "decode": P}),
    "merge_response": (rx.merge_response, {"prefill_body": BODY, "decode_body": BODY}),
    "pack": (rx.pack, {"samples": [P]}),
    "pack_shard": (rx.pack_shard, {"samples": [P]}),
    "set_max_bytes": (rx.set_max_bytes, {"n": 2**30}),
    "shard": (rx.shard, {"batch": P.array, "cu_seqlens": [0, 6]}),
    "RoutedExperts.from_json": (rx.RoutedExperts.from_json, {"value": P.to_json()}),
    "RoutedExperts.from_array": (rx.RoutedExperts.from_array, {"array": P.array}),
    "RoutedExperts.from_transport": (
        rx.RoutedExperts.from_transport, {"value": P.to_transport()}
    ),
    "RoutedExperts.to_numpy": (P.to_numpy, {}),
    "RoutedExperts.slice": (P.slice, {"start": 0, "stop": 2}),
    "RoutedExperts.astype": (P.astype, {"dtype": "uint16"}),
    "RoutedExperts.validate": (P.validate, {}),
    "RoutedExperts.validation_report": (P.validation_report, {}),
    "Trajectory.append": (_traj("append"), {"payload": P}),
    "Trajectory.truncate": (_traj("truncate"), {"stop": 3}),
    "Trajectory.to_training": (_traj("to_training"), {"num_tokens": 6}),
    "StreamMerger": (_merger, {"prefill_body": BODY}),
    "StreamMerger.feed": (
        lambda **kw: _merger(prefill_body=BODY).feed(**kw), {"chunk": b"data: {}\n\n"}
    ),
    "StreamMerger.line": (
        lambda **kw: _merger(prefill_body=BODY).line(**kw), {"line": b"data: {}"}
    ),
}
# Public callables the sweep leaves out, and why.
NOT_SWEPT = {
    "RoutedExperts.to_torch": "needs torch; its dtype is read as to_numpy's is",
}


def _public() -> dict[str, Any]:
    """Every public function, class and method (of `routed_experts` and the proxy's
    StreamMerger) that takes an argument."""
    import routed_experts.proxy as proxy

    found: dict[str, Any] = {}
    tops = [(n, getattr(rx, n)) for n in rx.__all__] + [("StreamMerger", proxy.StreamMerger)]
    for name, obj in tops:
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            found[name] = obj
            for m in vars(obj):
                if not m.startswith("_") and callable(getattr(obj, m)):
                    found[f"{name}.{m}"] = getattr(obj, m)
        elif callable(obj):
            found[name] = obj
    # Python 3.9 gives no signature for some extension classes: a class the sweep names is
    # public all the same.
    return {n: o for n, o in found.items() if _params(o) or n in VALID}


def _params(obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "args", "kwargs")]


def test_the_sweep_covers_every_public_callable() -> None:
    public = set(_public())
    assert public - set(VALID) - set(NOT_SWEPT) == set()
    assert set(VALID) - public == set(), "the sweep names a callable that is not public"


SWEEP = [(name, arg) for name, obj in _public().items() if name in VALID for arg in _params(obj)]
# Values of the right type whose content is read later (a stream's pieces), so a str is taken.
TEXT_TAKEN = {("StreamMerger", "prefill_body"), ("StreamMerger.feed", "chunk"),
              ("StreamMerger.line", "line"), ("BodyReader.feed", "chunk")}


@pytest.mark.parametrize(("name", "arg"), SWEEP, ids=[f"{n}-{a}" for n, a in SWEEP])
def test_every_argument_of_every_public_callable_refuses_bad_values_in_our_family(
    name: str, arg: str
) -> None:
    call, valid = VALID[name]
    call(**valid)  # the valid call succeeds: what fails below is the one bad argument
    for bad in (-3, 2**70, 1.5, object(), "x"):
        if bad == "x" and (name, arg) in TEXT_TAKEN:
            continue
        with pytest.raises(rx.RoutedExpertsError) as e:
            call(**{**valid, arg: bad})
        if not isinstance(bad, str):  # a wrong type or range names the argument
            assert f"`{arg}`" in str(e.value), (name, arg, bad, str(e.value))
