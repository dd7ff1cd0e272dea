"""`rx.from_response` answers None only for a response that carries no routing in any choice
(format.md §3.2): a choice the body does not have, a choice without routing beside choices
with it, and a body that is no response (`{}`, a request, an error reply: its message quoted)
each raise a `RoutedExpertsError` of its own kind."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import routed_experts as rx

P = rx.RoutedExperts.from_array(np.arange(12).reshape(6, 1, 2) % 7)


def response(routed: list[bool]) -> bytes:
    choices: list[dict[str, Any]] = [{"index": i, "text": "x"} for i in range(len(routed))]
    for c, has in zip(choices, routed):
        if has:
            c["routed_experts"] = P.to_dict()
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": choices}).encode()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6), st.integers(0, 9))
def test_none_means_no_routing_in_a_response_and_nothing_else(
    routed: list[bool], choice: int
) -> None:
    body = response(routed)
    if choice >= len(routed):
        said = "`choice`: expected one of the body's choices"
        with pytest.raises(rx.PayloadError, match=said) as e:
            rx.from_response(body, choice)
        assert e.value.kind == "field" and e.value.details["field"] == "choice"
    elif routed[choice]:
        assert rx.from_response(body, choice) == P
    elif any(routed):
        with pytest.raises(rx.PayloadError, match=f"choice {choice} carries no routing") as e:
            rx.from_response(body, choice)
        assert e.value.kind == "rows_lost"
    else:
        assert rx.from_response(body, choice) is None


@pytest.mark.parametrize(("body", "said"), [
    (b"{}", "an empty JSON object"),
    (b'{"model": "m", "prompt": "hi", "max_tokens": 4}', 'keys "max_tokens", "model"'),
    (b'{"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError"}}',
     '"max_tokens must be at least 1"'),
    (b'{"object": "error", "message": "The model `x` does not exist.", "code": 404}',
     '"The model `x` does not exist."'),
    (b'{"detail": "Not Found"}', '"Not Found"'),
    (b"[]", "an empty JSON array"),
])
def test_a_body_that_is_no_response_is_named_not_read_as_none(body: bytes, said: str) -> None:
    with pytest.raises(rx.PayloadError) as e:
        rx.from_response(body)
    assert e.value.kind == "not_response" and said in str(e.value), str(e.value)


def test_the_proxys_own_error_reply_is_quoted() -> None:
    # What the proxy answers when an engine fails (proxy.md's error table).
    reply = {"error": {"message": "the prefill server's reply is 525701904 bytes, over the limit",
                       "type": "upstream_error", "side": "prefill", "param": None, "code": 502}}
    with pytest.raises(rx.PayloadError, match="error reply, not a response: .the prefill server"):
        rx.from_response(json.dumps(reply))


def test_a_response_without_routing_anywhere_is_none() -> None:
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {}}
    assert rx.from_response(json.dumps(chunk)) is None
    assert rx.from_response(json.dumps({"text": "a", "meta_info": {"id": "x"}})) is None
    with pytest.raises(rx.PayloadError, match="`choice`: expected"):
        rx.from_response(json.dumps({"text": "a", "meta_info": {"id": "x"}}), 1)
