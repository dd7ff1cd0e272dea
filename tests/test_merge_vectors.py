"""Every case of tests/vectors/merge.json and responses.json."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

import routed_experts as rx
from conftest import REPO, assert_payload, error_class, load_vectors, vector_params


@pytest.mark.parametrize("case", vector_params("merge"))
def test_merge_vector(case: dict[str, Any]) -> None:
    prefill = rx.RoutedExperts.from_json(case["prefill"])
    decode = rx.RoutedExperts.from_json(case["decode"])
    if "error" in case:
        with pytest.raises(error_class(case["error"])):
            rx.merge(prefill, decode)
        return
    assert_payload(rx.merge(prefill, decode), case["expect"])
    # Sidecars given directly (dict / JSON) merge the same way.
    assert_payload(rx.merge(case["prefill"], json.dumps(case["decode"])), case["expect"])


def _routing_by_index(body: bytes) -> dict[int, Any]:
    choices = json.loads(body)["choices"]
    return {c.get("index", i): c.get("routed_experts") for i, c in enumerate(choices)}


def _strip_routing(body: bytes) -> Any:
    doc = json.loads(body)
    for c in doc["choices"]:
        c.pop("routed_experts", None)
    return doc


@pytest.mark.parametrize("splice", [True, False], ids=["splice", "general"])
@pytest.mark.parametrize("case", vector_params("responses"))
def test_response_vector(case: dict[str, Any], splice: bool) -> None:
    prefill, decode = case["prefill_body"].encode(), case["decode_body"].encode()
    if "error" in case:
        with pytest.raises(error_class(case["error"])):
            rx.merge_response(prefill, decode, splice=splice)
        return
    merged = rx.merge_response(prefill, decode, splice=splice)
    routing = _routing_by_index(merged)
    for want in case["expect_choices"]:
        i = want["index"]
        if want.get("absent"):
            assert routing[i] is None
            assert rx.from_response(merged, choice=i) is None
            continue
        assert_payload(rx.RoutedExperts.from_json(routing[i]), want)
        assert_payload(rx.from_response(merged, choice=i), want)  # type: ignore[arg-type]
    if all(w.get("absent") for w in case["expect_choices"]):
        assert merged == decode  # no routing anywhere: the body comes back as it was
    # Outside the routing values, the merged body is the decode body byte for byte.
    _assert_same_outside_routing(merged, decode)


def _assert_same_outside_routing(merged: bytes, decode: bytes) -> None:
    assert _strip_routing(merged) == _strip_routing(decode)

    # Byte level: cut every routing object out of both and compare what is left.
    def cut(body: bytes) -> bytes:
        out, at = bytearray(), 0
        key = b'"routed_experts": '
        while (i := body.find(key, at)) != -1:
            j = body.index(b"}", i) + 1
            out += body[at : i + len(key)]
            at = j
        return bytes(out + body[at:])

    assert cut(merged) == cut(decode)


@pytest.mark.source_tree
def test_the_rust_example_merges_bodies_as_the_python_api_does(tmp_path: Path) -> None:
    # `cargo run --example merge -- PREFILL DECODE`: the crate as a Rust router uses it.
    for case in load_vectors("responses"):
        prefill, decode = tmp_path / "p.json", tmp_path / "d.json"
        prefill.write_text(case["prefill_body"])
        decode.write_text(case["decode_body"])
        r = subprocess.run(
            ["cargo", "run", "--quiet", "--example", "merge", "--", str(prefill), str(decode)],
            cwd=REPO, capture_output=True, timeout=600,
        )
        if "error" in case:
            # The example matches the error's kind: halves that do not fit exit 1, malformed
            # input 2 (the Python classes MergeError and PayloadError), missing routing 3.
            # Routing on one side only is 3, as the command's missing routing.
            try:
                rx.merge_response(case["prefill_body"], case["decode_body"])
            except rx.RoutedExpertsError as e:
                kind = e.kind
            code = 3 if kind == "missing_routing" else {"MergeError": 1, "PayloadError": 2}[
                case["error"]]
            assert r.returncode == code and r.stderr, (case["name"], r.stderr)
        elif rx.from_response(want := rx.merge_response(case["prefill_body"],
                                                        case["decode_body"])) is None:
            # Neither body carries routing: exit 3 unless --allow-missing, which writes
            # decode's body unchanged (the CLI's codes; README, "The command").
            assert r.returncode == 3 and b"neither body carries routing" in r.stderr, r.stderr
            r = subprocess.run(
                ["cargo", "run", "--quiet", "--example", "merge", "--", str(prefill), str(decode),
                 "--allow-missing"],
                cwd=REPO, capture_output=True, timeout=600,
            )  # fmt: skip
            assert r.returncode == 0 and r.stdout == want + b"\n", case["name"]
        else:
            assert r.returncode == 0, r.stderr
            assert r.stdout == want + b"\n", case["name"]
