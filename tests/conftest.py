"""Shared test helpers: the golden vectors (tests/vectors/) and array builders."""

from __future__ import annotations

import base64
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

import routed_experts as rx

# No per-example deadline: speed is the benchmarks' to measure, and a deadline is a timed
# assertion that a loaded machine (CI checks the x86_64 wheel beside a qemu emulation) fails.
# Under user-mode emulation (tests/emulated_wheel_check.py) code runs several times slower: a
# quarter of the examples there (the same properties run in full natively; the emulated run
# checks that the aarch64 build behaves the same).
EMULATED = bool(os.environ.get("ROUTED_EXPERTS_EMULATED"))
settings.register_profile("untimed", deadline=None)
settings.register_profile("emulated", deadline=None, max_examples=25)
settings.load_profile("emulated" if EMULATED else "untimed")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under emulation, a property that sets its own count runs a quarter of it (at least 25):
    the profile above reaches only those that set none."""
    if not EMULATED:
        return
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and own.max_examples > 25:
            quarter = settings(own, max_examples=max(25, own.max_examples // 4))
            test._hypothesis_internal_use_settings = quarter  # type: ignore[union-attr]

REPO = Path(__file__).resolve().parent.parent
# The benchmark harness (benches/rx_bench, not in the wheel) for the tests that run it small; the
# wheel checks copy it beside their copy of tests/. Appended: nothing there shadows a module.
if (REPO / "benches" / "rx_bench").is_dir():
    sys.path.append(str(REPO / "benches"))
# The live tests need a real engine: `make test-engines` makes its environment and names it
# (RX_VLLM_PYTHON and RX_VLLM_RELEASE: test_live_vllm*.py; RX_SGLANG_PYTHON and
# RX_SGLANG_RELEASE: test_live_sglang*.py); elsewhere
# (`make test`, the wheel checks) they are not collected, and the recorded bodies stand in
# (tests/test_real_vllm.py, tests/test_real_sglang.py). Declared here: a conftest.py of
# tests/real/ would be imported as the same module name as this one.
collect_ignore_glob = [
    f"real/test_live_{engine}*.py"
    for engine, var in (("vllm", "RX_VLLM_PYTHON"), ("sglang", "RX_SGLANG_PYTHON"))
    if not os.environ.get(var)
]
# The trainer tests need torch, megatron-core and transformers: `make test-trainer` makes their
# environment (tests/trainer/trainer_env.py) and runs them there (RX_TRAINER=1), nowhere else.
if not os.environ.get("RX_TRAINER"):
    collect_ignore_glob.append("trainer/*")
# Golden vectors from an independent implementation of the format (tests/vectors/README.md).
VECTORS = Path(__file__).resolve().parent / "vectors"


def load_vectors(name: str) -> list[dict[str, Any]]:
    """Every case of one golden-vector file (a missing file fails the run: they are tracked)."""
    path = VECTORS / f"{name}.json"
    cases: list[dict[str, Any]] = json.loads(path.read_text())
    assert cases, f"{path} has no cases"
    return cases


def vector_params(name: str) -> list[Any]:
    return [pytest.param(case, id=case["name"]) for case in load_vectors(name)]


def expected_array(expect: dict[str, Any]) -> np.ndarray:
    return np.array(expect["array"], dtype=expect["dtype"]).reshape(expect["shape"])


def assert_payload(p: rx.RoutedExperts, expect: dict[str, Any]) -> None:
    """`p` equals an `expect` block of the vectors: shape, dtype, start and every value."""
    assert list(p.shape) == expect["shape"]
    assert p.dtype == expect["dtype"]
    assert p.start == expect["start"]
    assert p.array.dtype == np.dtype(expect["dtype"])
    np.testing.assert_array_equal(p.array, expected_array(expect))


def error_class(name: str) -> type[Exception]:
    cls = getattr(rx, name)
    assert issubclass(cls, rx.RoutedExpertsError)
    return cls  # type: ignore[no-any-return]


def sidecar_doc(rows: np.ndarray, start: int = 0, **extra: Any) -> dict[str, Any]:
    """format.md §3.1 built by hand, not by the library (a reference for what it reads and
    writes): the rows' little-endian C-order bytes in standard base64, the keys in order, and
    any `extra` fields after them."""
    le = np.ascontiguousarray(rows).astype(rows.dtype.newbyteorder("<"))
    doc: dict[str, Any] = {
        "data": base64.b64encode(le.tobytes()).decode(),
        "shape": list(rows.shape),
        "start": start,
        "dtype": rows.dtype.name,
    }
    doc.update(extra)
    return doc


def sidecar(rows: np.ndarray, start: int) -> str:
    """The same as the compact text the library writes: no spaces."""
    return json.dumps(sidecar_doc(rows, start), separators=(",", ":"))


# Every dtype the format carries (format.md §3.1).
DTYPES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "int64"]


def sidecar_reference(text: bytes | str) -> tuple[np.ndarray, int]:
    """format.md §3.1 read by hand (Python's json, base64 and numpy): the rows and the start a
    compact sidecar holds. What the library accepts must read the same way here."""
    doc = json.loads(text)
    raw = base64.b64decode(doc["data"], validate=True)
    dtype = np.dtype(doc.get("dtype", "uint8")).newbyteorder("<")
    return np.frombuffer(raw, dtype=dtype).reshape(doc["shape"]), int(doc.get("start", 0))
