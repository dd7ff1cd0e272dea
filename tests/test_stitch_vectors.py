"""Every case of tests/vectors/stitch.json."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import routed_experts as rx
from conftest import assert_payload, error_class, expected_array, vector_params


@pytest.mark.parametrize("case", vector_params("stitch"))
def test_stitch_vector(case: dict[str, Any]) -> None:
    t = rx.Trajectory()
    parts = [rx.RoutedExperts.from_json(p) for p in case["parts"]]
    if "error" in case:
        with pytest.raises(error_class(case["error"])):
            for p in parts:
                before = t.payload
                t.append(p, overlap=case["overlap"])
        assert t.payload == before  # the failed append changed nothing
        return
    for p in parts:
        t.append(p, overlap=case["overlap"])
    assert t.payload is not None
    assert_payload(t.payload, case["expect_payload"])
    assert (t.start, t.stop, len(t)) == (
        0,
        case["expect_payload"]["shape"][0],
        case["expect_payload"]["shape"][0],
    )
    args = (case["num_tokens"], case["pad"], case["max_missing"])
    if "expect_training_error" in case:
        with pytest.raises(error_class(case["expect_training_error"])):
            t.to_training(*args)
        return
    out = t.to_training(*args)
    want = case["expect_training"]
    assert out.dtype == np.dtype(want["dtype"]) and list(out.shape) == want["shape"]
    np.testing.assert_array_equal(out, expected_array(want))
    assert out.flags.writeable
