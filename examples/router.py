"""A P/D router's hop: prefill's and decode's response bodies in, one body out with the routing
of the whole sequence, or an error the router answers with (docs/usage.md, format.md §4).

Run it: .venv/bin/python examples/router.py, after `make run` (needs only numpy and
routed_experts).
"""

import json

import numpy as np

import routed_experts as rx

PROMPT, GENERATED = 6, 4  # tokens: P and G
LAYERS, TOP_K = 4, 2
rng = np.random.default_rng(0)
# What the model routed: vLLM returns rows for every position but the last sampled token's.
truth = rng.integers(0, 128, size=(PROMPT + GENERATED - 1, LAYERS, TOP_K), dtype=np.uint8)


def vllm_body(rows: np.ndarray, completion_tokens: int) -> bytes:
    """A completion as vLLM 0.22+ sends it: the routing as base64 of an `np.save` file."""
    routing = rx.encode(rx.RoutedExperts.from_array(rows), "vllm_npy")
    return json.dumps({
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": " Paris", "routed_experts": routing}],
        "usage": {"prompt_tokens": PROMPT, "completion_tokens": completion_tokens,
                  "total_tokens": PROMPT + completion_tokens},
    }).encode()


# Prefill ran with max_tokens=1: rows [0, P). Decode was asked for rows from P - 1 (its request's
# routed_experts_prompt_start): the last prompt position is the first it computed itself.
decode_start = PROMPT - 1
prefill_body = vllm_body(truth[:PROMPT], completion_tokens=1)
decode_body = vllm_body(truth[decode_start:], completion_tokens=GENERATED)

# A .npy value carries no start: the router passes the one it asked decode for. The result is
# decode's body, every byte the same but its routing: a compact sidecar of rows [0, P + G - 1).
body = rx.merge_response(prefill_body, decode_body, decode_start=decode_start)
# Without it, the decode body's token counts fix it (P + G - 1 - rows: format.md §4).
assert rx.merge_response(prefill_body, decode_body) == body
merged = rx.from_response(body)
assert merged is not None and (merged.array == truth).all()
print(f"merged: {len(body)} bytes, rows [{merged.start}, {merged.stop}), shape {merged.shape}")
print("text kept:", json.loads(body)["choices"][0]["text"])
# keep_format=True writes the merged routing in decode's own format (.npy) instead.
same = rx.merge_response(prefill_body, decode_body, decode_start=decode_start, keep_format=True)
assert rx.from_response(same) == merged

# What goes wrong between engines is an error the router can answer with (the proxy answers
# 502 naming the side), never a body with wrong routing. All are rx.RoutedExpertsError;
# rx.MergeError is for halves that do not fit, rx.PayloadError for what cannot be read.
broken = {
    # decode asked for rows from P + 1: rows [P, P + 1) are missing between the halves
    "a gap": (prefill_body, vllm_body(truth[PROMPT + 1:], GENERATED), PROMPT + 1),
    # decode's engine routed over 2 layers where prefill's has 4
    "mismatched halves": (prefill_body, vllm_body(truth[decode_start:, :2], GENERATED),
                          decode_start),
    # prefill's engine returned no routing: decode's own prompt rows are not to be trusted
    "no prefill routing": (json.dumps({"choices": [{"index": 0, "text": ""}]}), decode_body,
                           decode_start),
    # decode's rows start where no router asks (by its counts, at 2): refused, never guessed
    "a start no router asks": (prefill_body, vllm_body(truth[2:], GENERATED), None),
}
for what, (pre, dec, start) in broken.items():
    try:
        rx.merge_response(pre, dec, decode_start=start)
    except rx.RoutedExpertsError as e:
        print(f"{what}: {type(e).__name__}: {e}")
    else:
        raise AssertionError(f"{what} merged")
