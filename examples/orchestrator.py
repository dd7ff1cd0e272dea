"""An orchestrator's hop: a multi-turn rollout's reply bodies in, one routing of the whole
conversation out, handed to another process (docs/usage.md, format.md §5).

Run it: .venv/bin/python examples/orchestrator.py, after `make run` (needs only numpy and
routed_experts).
"""

import json
import subprocess
import sys

import numpy as np

import routed_experts as rx

LAYERS, TOP_K = 4, 2
rng = np.random.default_rng(0)
# What the model routed over the whole conversation (3 turns, 40 tokens), position by position.
conversation = rng.integers(0, 128, size=(40, LAYERS, TOP_K), dtype=np.uint8)


def engine(prompt_tokens: int, generated: int, start: int) -> bytes:
    """A vLLM reply to a request with routed_experts_prompt_start=start: rows [start, P + G - 1),
    base64 of an `np.save` file (the last sampled token has no row yet)."""
    rows = conversation[start : prompt_tokens + generated - 1]
    return json.dumps({
        "choices": [{"index": 0, "text": "...",
                     "routed_experts": rx.encode(rx.RoutedExperts.from_array(rows), "vllm_npy")}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated},
    }).encode()


# Each turn's prompt is the conversation so far plus the user's new message; the orchestrator
# asks only for the rows it lacks (start = the trajectory's stop), so no turn resends the past.
t = rx.Trajectory()
tokens = 0
for user, generated in [(8, 6), (5, 9), (7, 5)]:
    prompt = tokens + user
    start = t.stop or 0
    body = engine(prompt, generated, start)
    turn = rx.from_response(body, start=start)  # .npy carries no start: give the one asked for
    t.append(turn)  # by absolute position: a gap or a turn before the start is a MergeError
    tokens = prompt + generated
    print(f"turn: {prompt} prompt + {generated} generated tokens, rows [{turn.start}, "
          f"{turn.stop}) -> trajectory [{t.start}, {t.stop})")
assert t.payload is not None and (t.payload.array == conversation[: tokens - 1]).all()

# Rows both hold follow a policy: "keep" (the default), "replace", or "check" that they agree.
t.append(rx.RoutedExperts.from_array(conversation[10:20], start=10), overlap="check")
try:
    t.append(rx.RoutedExperts.from_array(conversation[:2], start=t.stop + 3))
except rx.MergeError as e:
    print(f"refused, trajectory unchanged at [{t.start}, {t.stop}): {e}")

# Across a process boundary (a queue, an HTTP hop, a file): the compact sidecar, as bytes.
# (A Trajectory also pickles, protocol 5 out of band, for Ray and multiprocessing.)
wire = t.payload.to_json()
trainer_side = """
import sys
import routed_experts as rx
t = rx.Trajectory()
t.append(rx.RoutedExperts.from_json(sys.stdin.buffer.read()))
rows, mask = t.to_training(int(sys.argv[1]), mask=True)  # the last token's row is padding
print(f"received rows [{t.start}, {t.stop}) -> training array {rows.shape}, "
      f"{int(mask.sum())} rows with routing")
"""
child = subprocess.run([sys.executable, "-c", trainer_side, str(tokens)], input=wire,
                       capture_output=True, check=True)
print(f"sent {len(wire)} bytes; the other process: {child.stdout.decode().strip()}")
