"""A real SGLang server (its CPU engine, `make test-engines` when RX_SGLANG_PYTHON names an
environment made by `engine_env.py sglang RELEASE`), the tiny MoE model made here without a
dense layer, and every reply's routing read by the library checked against the model's own
(transformers, in the engine's environment): `/generate` plain, streamed and from a start,
`/v1/completions` and `/v1/chat/completions` plain and streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import routed_experts as rx

HARNESS = Path(__file__).resolve().parent / "harness"
sys.path.insert(0, str(HARNESS))

import sglang_engine  # noqa: E402
import tiny_model  # noqa: E402

PYTHON = Path(os.environ["RX_SGLANG_PYTHON"])
# The release: RX_SGLANG_RELEASE, or the one the environment was made for (its `.ready`).
RELEASE = os.environ.get("RX_SGLANG_RELEASE") or (
    (PYTHON.parent.parent / ".ready").read_text().strip()
)
SHAPE = {"num_layers": tiny_model.LAYERS, "top_k": tiny_model.TOP_K}
SHORT = "expert router token layer prompt"
LONG = " ".join(tiny_model.WORDS[i % 24] for i in range(66))


class Live:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.model = work / "tiny-e8-nodense"
        subprocess.run(
            [str(PYTHON), str(HARNESS / "tiny_model.py"), str(self.model), "--dense-layers",
             "none"], check=True, capture_output=True,
        )  # fmt: skip
        self.server = sglang_engine.Server(PYTHON, RELEASE, self.model, work / "sglang.log")
        self.started_in = 0.0
        # Each answer from the engine's environment once (a transformers start is ~10 s).
        self.known: dict[str, Any] = {}

    def start(self) -> None:
        t0 = time.monotonic()
        self.server.start()
        self.server.wait_ready()
        self.started_in = time.monotonic() - t0
        print(f"\nSGLang {RELEASE} ready in {self.started_in:.1f} s", file=sys.stderr)

    @property
    def url(self) -> str:
        return self.server.url

    def log_tail(self) -> str:
        return "\n".join((self.work / "sglang.log").read_text(errors="replace").splitlines()[-30:])

    def in_engine(self, code: str, data: Any) -> Any:
        key = json.dumps([code, data])
        if key in self.known:
            return self.known[key]
        out = subprocess.run(
            [str(PYTHON), "-c", code, str(self.model)],
            input=json.dumps(data), capture_output=True, text=True, check=True,
        )  # fmt: skip
        self.known[key] = json.loads(out.stdout)
        return self.known[key]

    def truth(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """The model's own routing of each sequence, rows [0, len - 1)."""
        key = json.dumps(["truth", sequences])
        if key not in self.known:
            out = subprocess.run(
                [str(PYTHON), str(HARNESS / "truth.py"), str(self.model)],
                input=json.dumps(sequences), capture_output=True, text=True, check=True,
            )  # fmt: skip
            self.known[key] = json.loads(out.stdout)
        got = self.known[key]
        return [np.asarray(t["rows"])[: len(s) - 1] for s, t in zip(sequences, got)]

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids the server's chat template makes (the model's tokenizer)."""
        code = (
            "import json, sys\nfrom transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
            "ids = t.apply_chat_template(json.load(sys.stdin), add_generation_prompt=True,"
            " tokenize=True)\n"
            "ids = ids['input_ids'] if hasattr(ids, 'keys') else ids\n"
            "print(json.dumps(list(ids)))\n"
        )
        return list(self.in_engine(code, messages))

    def greedy(self, ids: list[int], max_new: int) -> list[int]:
        """The tokens a greedy /generate of `ids` returns (the OpenAI endpoints return none)."""
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
        r = httpx.post(self.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    with tempfile.TemporaryDirectory(prefix="rx-live-sglang-") as tmp:
        s = Live(Path(tmp))
        try:
            s.start()
            yield s
        finally:
            s.server.stop()


def alive(live: Live) -> None:
    assert live.server.alive(), "the server died\n" + live.log_tail()


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in r.iter_lines()
        if line.startswith("data: ") and line.strip() != "data: [DONE]"
    ]


PROMPT_IDS = [305, 337, 345, 389, 386]  # SHORT, as the tiny tokenizer makes it


def test_generate_plain_and_from_a_start(live: Live) -> None:
    sp = {"max_new_tokens": 5, "temperature": 0}
    got, seqs = {}, set()
    for start in (0, 3):
        body = {"input_ids": PROMPT_IDS, "sampling_params": sp, "return_routed_experts": True}
        if start:
            body["routed_experts_start_len"] = start
        r = httpx.post(live.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        p = rx.from_response(r.content, start=start or None, **SHAPE)
        assert p is not None and p.start == start
        got[start] = p.to_numpy()
        seqs.add(tuple(PROMPT_IDS + r.json()["output_ids"]))
    assert len(seqs) == 1, "greedy: the same tokens both times"
    want = live.truth([list(seqs.pop())])[0]
    for start, rows in got.items():
        np.testing.assert_array_equal(rows, want[start:])
    alive(live)


def test_generate_streamed(live: Live) -> None:
    ids = PROMPT_IDS[:3]
    body = {"input_ids": ids, "stream": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0}}  # fmt: skip
    with httpx.stream("POST", live.url + "/generate", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = sse(r)
    routed = [e for e in events if rx.from_response(json.dumps(e), **SHAPE) is not None]
    assert len(routed) == 1 and routed[0] is events[-1], "routing once, on the last event"
    p = rx.from_response(json.dumps(routed[0]), **SHAPE)
    assert p is not None
    seq = ids + events[-1]["output_ids"]
    np.testing.assert_array_equal(p.to_numpy(), live.truth([seq])[0])
    alive(live)


def openai_routing(live: Live, path: str, body: dict[str, Any]) -> rx.RoutedExperts:
    """The one routing value of an OpenAI endpoint's reply: the body's, or the one event of
    the stream that carries it."""
    if body["stream"]:
        with httpx.stream("POST", live.url + path, json=body, timeout=300) as r:
            assert r.status_code == 200
            events = sse(r)
        got = [p for e in events if (p := rx.from_response(json.dumps(e), **SHAPE)) is not None]
        assert len(got) == 1
        return got[0]
    r = httpx.post(live.url + path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    p = rx.from_response(r.content, **SHAPE)
    assert p is not None
    return p


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_completions(live: Live, stream: bool) -> None:
    ids = [*PROMPT_IDS, 305]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0,
            "return_routed_experts": True, "stream": stream}  # fmt: skip
    p = openai_routing(live, "/v1/completions", body)
    seq = ids + live.greedy(ids, 5)
    np.testing.assert_array_equal(p.to_numpy(), live.truth([seq])[0])
    alive(live)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_chat(live: Live, stream: bool) -> None:
    # The same conversation both ways (the second a prefix-cache hit): one truth for both.
    messages = [{"role": "user", "content": SHORT}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 5, "temperature": 0,
            "return_routed_experts": True, "stream": stream}  # fmt: skip
    p = openai_routing(live, "/v1/chat/completions", body)
    ids = live.chat_ids(messages)
    seq = ids + live.greedy(ids, 5)
    np.testing.assert_array_equal(p.to_numpy(), live.truth([seq])[0])
    alive(live)


def test_a_long_prompt_twice_keeps_its_cached_rows(live: Live) -> None:
    # The second time its prefix comes from the radix cache; its rows come back all the same.
    code = (
        "import json, sys\nfrom transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "print(json.dumps(t(json.load(sys.stdin))['input_ids']))\n"
    )
    ids = list(live.in_engine(code, LONG + " live"))
    body = {"input_ids": ids, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0}}  # fmt: skip
    got = []
    for _ in range(2):
        r = httpx.post(live.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got.append(r.json())
    assert got[1]["meta_info"]["cached_tokens"] > 0
    want = live.truth([ids + got[1]["output_ids"]])[0]
    for doc in got:
        p = rx.from_response(json.dumps(doc), **SHAPE)
        assert p is not None
        np.testing.assert_array_equal(p.to_numpy(), want)
    alive(live)
