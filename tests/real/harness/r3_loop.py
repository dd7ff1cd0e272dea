"""The R3 loop's last hop, measured: the bodies a real vLLM sent through the proxy, read by the
library (`rx.from_response`, `rx.pack(num_tokens=[P + G], mask=True)`) and replayed into the
same model in transformers (`rx.replay.hf`), beside the same model routing on its own. Runs in
an engine environment (torch, transformers) with the clone's python/ on the path.

    python r3_loop.py MODEL_DIR DTYPE BODY.json [BODY.json ...] > figures.json

Each body is a completions reply asked with `logprobs: 1` and `return_token_ids: true`. Over
every (token, MoE layer) router the engine routed (rows [0, P + G - 1): the last sampled token
has none), the answer counts:

- `native_agree`: the trainer's own top-k equals the engine's, as a set;
- `replay_agree`: the ids the trainer's experts were handed under replay equal the engine's;
- the log-prob of each sampled token, the trainer's (natively and under replay) against the
  engine's own (`|Δ logprob|`);
- `stats`: what `replay.stats()` counted (the router flip rate, replayed and filled rows).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def loop(model_dir: str, dtype: str, bodies: list[bytes]) -> dict[str, Any]:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import routed_experts as rx

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    gates = rx.replay.hf_gates(model)
    moe = [i for i, g in enumerate(gates) if g is not None]

    def picks(after_replay: bool) -> tuple[dict[int, Any], list[Any]]:
        # Registered before replay's hook, a gate's hook sees its own pick; after, the ids
        # replay handed the experts.
        seen: dict[int, Any] = {}
        hooks = [gates[i].register_forward_hook(
            lambda _g, _a, out, i=i: seen.__setitem__(i, out[2].detach().clone()))
            for i in moe]  # fmt: skip
        return seen, hooks

    totals = {"routers": 0, "native_agree": 0, "replay_agree": 0, "tokens": 0,
              "flipped": 0, "replayed": 0, "filled": 0}  # fmt: skip
    native_gap: list[float] = []
    replay_gap: list[float] = []
    sequences = []
    for body in bodies:
        doc = json.loads(body)
        for choice in doc["choices"]:
            payload = rx.from_response(body, choice=choice["index"])
            prompt = doc.get("prompt_token_ids") or choice.get("prompt_token_ids")
            generated = choice["token_ids"]
            seq = list(prompt) + list(generated)
            n, p = len(seq), len(prompt)
            if payload is None or payload.start != 0 or payload.stop != n - 1:
                raise AssertionError(
                    f"choice {choice['index']}: expected routing rows [0, {n - 1}), got "
                    f"{None if payload is None else (payload.start, payload.stop)}"
                )
            engine_lp = np.asarray(choice["logprobs"]["token_logprobs"], dtype=np.float64)
            packed, _, mask = rx.pack([payload], num_tokens=[n], mask=True)
            engine_rows = payload.to_numpy()  # [n - 1, layers, top_k]
            ids = torch.tensor([seq])
            own, hooks = picks(False)
            with torch.no_grad():
                native_logits = model(ids).logits
            for h in hooks:
                h.remove()
            with rx.replay.hf(model, packed[None], mask[None]) as replay:
                handed, hooks = picks(True)
                with torch.no_grad():
                    replay_logits = model(ids).logits
                stats = replay.stats()
            for h in hooks:
                h.remove()
            for i in moe:
                want = np.sort(engine_rows[:, i], axis=-1)
                mine = np.sort(own[i][: n - 1].numpy(), axis=-1)
                used = np.sort(handed[i][: n - 1].numpy(), axis=-1)
                totals["routers"] += n - 1
                totals["native_agree"] += int((mine == want).all(axis=-1).sum())
                totals["replay_agree"] += int((used == want).all(axis=-1).sum())
            totals["tokens"] += n
            for key in ("flipped", "replayed", "filled"):
                totals[key] += getattr(stats, key)
            target = torch.tensor(seq[p:])
            for logits, gaps in ((native_logits, native_gap), (replay_logits, replay_gap)):
                lp = torch.log_softmax(logits[0, p - 1 : n - 1].float(), dim=-1)
                mine_lp = lp.gather(1, target[:, None])[:, 0].double().numpy()
                gaps.extend(np.abs(mine_lp - engine_lp).tolist())
            sequences.append({"prompt": p, "generated": len(generated)})
    return {
        "dtype": dtype,
        "sequences": sequences,
        **totals,
        "native_agreement": totals["native_agree"] / totals["routers"],
        "replay_agreement": totals["replay_agree"] / totals["routers"],
        "flip_rate": totals["flipped"] / totals["replayed"] if totals["replayed"] else None,
        "native_logprob_gap": {"mean": float(np.mean(native_gap)), "max": float(max(native_gap))},
        "replay_logprob_gap": {"mean": float(np.mean(replay_gap)), "max": float(max(replay_gap))},
        "sampled_tokens": len(native_gap),
    }


if __name__ == "__main__":
    model_dir, dtype, *paths = sys.argv[1:]
    figures = loop(model_dir, dtype, [open(p, "rb").read() for p in paths])  # noqa: SIM115
    json.dump(figures, sys.stdout)
