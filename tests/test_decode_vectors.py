"""Every case of tests/vectors/decode.json: three input types and canonical re-encoding."""

from __future__ import annotations

import json
from typing import Any

import pytest

import routed_experts as rx
from conftest import assert_payload, error_class, vector_params

CASES = vector_params("decode")


def _inputs(text: str) -> list[Any]:
    inputs: list[Any] = [text, text.encode()]
    try:
        parsed = json.loads(text)
    except ValueError:
        return inputs
    return [*inputs, parsed]


@pytest.mark.parametrize("case", CASES)
def test_decode_vector(case: dict[str, Any]) -> None:
    for value in _inputs(case["input_text"]):
        if "error" in case:
            with pytest.raises(error_class(case["error"])):
                rx.RoutedExperts.from_json(value)
            continue
        p = rx.RoutedExperts.from_json(value)
        assert_payload(p, case["expect"])
        # Canonical re-encoding: fixed key order, no spaces, start and dtype always written.
        expect = case["expect"]
        canonical = json.loads(p.to_json())
        assert list(canonical) == ["data", "shape", "start", "dtype"]
        assert canonical["shape"] == expect["shape"]
        assert canonical["start"] == expect["start"]
        assert canonical["dtype"] == expect["dtype"]
        assert b" " not in p.to_json()
        assert rx.RoutedExperts.from_json(p.to_json()) == p
        assert p.to_dict() == canonical


def test_every_error_vector_is_a_payload_error() -> None:
    # The decode vectors only contain malformed sidecars: all of them are PayloadError.
    errors = [c for c in CASES if "error" in c.values[0]]
    assert errors and all(c.values[0]["error"] == "PayloadError" for c in errors)
