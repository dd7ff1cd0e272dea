"""The Python blocks of the README and of the library guide (docs/usage.md) run as written, in
order, in one namespace per file (a user copies them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# Every page whose Python blocks a user copies: each page's blocks run on their own.
PAGES = ["README.md", "docs/usage.md"]
QUICKSTART = "# quickstart: needs the three commands above running"
# A trainer step needs torch and a model: the last test runs those blocks where they are.
TRAINER_STEP = "# trainer step"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (REPO / page).read_text(), re.M | re.S)


@pytest.mark.source_tree
@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_of_the_page_runs(page: str) -> None:
    blocks = python_blocks(page)
    assert len(blocks) >= 3
    # The quickstart's block needs servers: the next test runs it with them.
    blocks = [b for b in blocks if not b.startswith((QUICKSTART, TRAINER_STEP))]
    namespace: dict[str, object] = {}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{page} python block {i + 1}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # pragma: no cover - the failure names the block
            raise AssertionError(f"{page} python block {i + 1} fails: {e!r}") from e


@pytest.mark.source_tree
def test_the_proxy_quickstart_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's three commands (on ports the system picks, which they print) and the OpenAI
    SDK request after them, as a user copies them."""
    import contextlib
    import shlex
    import time
    import urllib.request

    pytest.importorskip("openai")
    text = README.read_text()
    start = text.index("**Try it in a minute")
    commands = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    client = re.search(r"```python\n(" + re.escape(QUICKSTART) + r".*?)```", text[start:], re.S)
    assert commands and client
    lines = [line.rstrip(" &") for line in commands.group(1).strip().splitlines()]
    assert len(lines) == 3
    # As written, from the clone's root after `make run`: the command is the one `make run`
    # installed into .venv (not one on PATH, which a fresh shell does not have).
    exe = REPO / ".venv" / "bin" / "routed-experts"
    if not exe.exists():
        pytest.skip("no .venv in the clone: the quickstart runs after `make run`")
    ports: dict[str, str] = {}

    def run(line: str) -> tuple[subprocess.Popen[str], str]:
        for fixed, actual in ports.items():
            line = line.replace(f":{fixed}", f":{actual}")
        argv = shlex.split(line)
        assert argv[0] == ".venv/bin/routed-experts", line
        fixed = argv[argv.index("--port") + 1]
        argv[argv.index("--port") + 1] = "0"
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for said in proc.stdout:  # the engine prints its URL; the proxy logs it
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", said)
            if found:
                ports[fixed] = found.group(1)
                return proc, found.group(1)
        raise AssertionError(f"{line!r} ended before it said its port")

    with contextlib.ExitStack() as stack:
        procs = []
        for line in lines:
            proc, _ = run(line)
            procs.append(proc)
            stack.callback(_end, proc)
        proxy = f"http://127.0.0.1:{ports['8000']}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(proxy + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, "the proxy never became healthy"
                time.sleep(0.1)
        code = client.group(1).replace(":8000", ":" + ports["8000"])
        exec(compile(code, "README.md quickstart", "exec"), {})  # noqa: S102
        assert all(p.poll() is None for p in procs)
    assert capsys.readouterr().out.strip() == "(31, 48, 8)"


def _end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.mark.source_tree
@pytest.mark.skipif(
    not os.environ.get("RX_TRAINER"),
    reason="make test-trainer runs it (torch, megatron-core, transformers, torchtitan are there)",
)
def test_the_trainer_steps_run_on_real_models() -> None:
    """The library guide's two trainer steps as written, on the trainer tests' tiny models, with
    payloads recorded from the models themselves: the step replays them (the loss is the one
    the model gives on its own)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent / "trainer"))
    import trainer_models as tm
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    import routed_experts as rx

    steps = [b for page in PAGES for b in python_blocks(page) if b.startswith(TRAINER_STEP)]
    assert [s.splitlines()[0].split("(")[1].split(")")[0] for s in steps] == [
        "Megatron", "transformers", "torchtitan"]
    megatron_step, hf_step, torchtitan_step = steps

    with tm.megatron_world():
        model = tm.megatron_model()
        routers = rx.replay.megatron_routers(model)
        for router, _, _ in routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            own = tm.megatron_forward(model, 1)
        ids = [r.router_replay.get_recorded_indices().numpy() for r, _, _ in routers]
        for router, _, _ in routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
        rows = np.zeros((tm.SEQ, tm.LAYERS, tm.TOP_K), dtype=np.int64)
        for (_, number, _), t in zip(routers, ids):
            rows[:, number - 1] = t
        half = tm.SEQ // 2  # two samples packed as one sequence of SEQ tokens
        payloads = [rx.RoutedExperts.from_array(rows[:half], num_experts=tm.EXPERTS),
                    rx.RoutedExperts.from_array(rows[half:], num_experts=tm.EXPERTS)]
        logged: list[dict[str, float]] = []
        ns: dict[str, object] = {"rx": rx, "model": model, "payloads": payloads,
                                 "num_tokens": [half, tm.SEQ - half], "log": logged.append,
                                 "forward": lambda m: tm.megatron_forward(m, 1)}
        exec(compile(megatron_step, "docs/usage.md trainer step (Megatron)", "exec"), ns)  # noqa: S102
        assert torch.equal(ns["loss"].detach(), own)  # type: ignore[union-attr]
        # The model's own routing replayed: the stats the step logs say no router flipped.
        assert logged and logged[0]["replay/flip_rate"] == 0.0

    model = tm.hf_model("qwen3_moe")
    b, s = 2, 6
    input_ids = torch.randint(0, tm.HF_VOCAB, (b, s), generator=torch.Generator().manual_seed(1))
    seen: dict[int, torch.Tensor] = {}
    hooks = [g.register_forward_hook(lambda _g, _a, out, i=i: seen.__setitem__(i, out[2]))
             for i, g in enumerate(rx.replay.hf_gates(model)) if g is not None]
    with torch.no_grad():
        own = model(input_ids, labels=input_ids).loss
    for h in hooks:
        h.remove()
    rows = np.zeros((b, s, tm.HF_LAYERS, tm.TOP_K), dtype=np.int64)
    for i, t in seen.items():
        rows[:, :, i] = t.reshape(b, s, tm.TOP_K).numpy()
    payloads = [rx.RoutedExperts.from_array(rows[k, : s - 1], num_experts=tm.EXPERTS)
                for k in range(b)]
    ns = {"rx": rx, "model": model, "input_ids": input_ids, "payloads": payloads}
    exec(compile(hf_step, "docs/usage.md trainer step (transformers)", "exec"), ns)  # noqa: S102
    # The last token of each sample had no row and was filled; its logits predict nothing (a
    # causal LM's loss ends at the token before), so the loss is the model's own, bit for bit.
    assert torch.equal(ns["loss"].detach(), own)  # type: ignore[attr-defined]
    assert model.model.layers[1].mlp.gate.weight.grad is not None  # the step's backward ran
    assert ns["stats"].flipped == 0 and ns["stats"].filled == 2 * 2  # type: ignore[attr-defined]

    import test_torchtitan_replay as tt

    model = tt.build("dm")
    seen = {}
    hooks = [r.register_forward_hook(lambda _r, _a, out, i=i: seen.__setitem__(i, out[1]))
             for r, i in rx.replay.torchtitan_routers(model)]
    with torch.no_grad():
        own = tt.forward(model)
    for h in hooks:
        h.remove()
    b, s = tt.TOKENS.shape
    rows = np.zeros((b, s, 2, 8), dtype=np.int64)
    for i, t in seen.items():
        rows[:, :, i] = t.numpy()
    ns = {"rx": rx, "model": model, "tokens": tt.TOKENS, "positions": tt.POSITIONS,
          "loss_fn": lambda logits, labels: logits.float().logsumexp(-1).mean(),
          "payloads": [rx.RoutedExperts.from_array(rows[k, : s - 1], num_experts=64)
                       for k in range(b)]}
    with torch.no_grad():  # torch's FlexAttention has no backward on a CPU
        exec(compile(torchtitan_step, "docs/usage.md trainer step (torchtitan)", "exec"), ns)  # noqa: S102
    # The last token's row was filled; every earlier position's logits are the model's own.
    assert torch.equal(ns["logits"][:, :-1], own[:, :-1])  # type: ignore[index]
    assert ns["stats"].flipped == 0 and ns["stats"].filled == b  # type: ignore[attr-defined]
