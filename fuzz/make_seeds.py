"""Write the fuzzers' seed corpus (fuzz/seeds/<target>/) from the golden vectors and a few
hand-made inputs. Run once when the vectors change; the seeds are checked in."""

import base64
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

root = Path(__file__).parent / "seeds"
vectors = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "tests" / "vectors"


def put(target: str, data: bytes) -> None:
    d = root / target
    d.mkdir(parents=True, exist_ok=True)
    (d / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)


def npy_file(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


for case in json.loads((vectors / "decode.json").read_text()):
    put("sidecar", case["input_text"].encode())
    put("formats", b"\x00" + case["input_text"].encode())
for case in json.loads((vectors / "merge.json").read_text()):
    p, d = (json.dumps(case[k]).encode() for k in ("prefill", "decode"))
    body = lambda v: b'{"choices":[{"index":0,"routed_experts":' + v + b"}]}"  # noqa: E731
    put("merge_response", body(p) + b"\xff" + body(d))
for case in json.loads((vectors / "responses.json").read_text()):
    pb, db = case["prefill_body"].encode(), case["decode_body"].encode()
    put("response", b"\x00" + db)
    put("merge_response", pb + b"\xff" + db)
for case in json.loads((vectors / "interop.json").read_text()):
    value = case["input"]
    text = value.encode() if isinstance(value, str) else json.dumps(value).encode()
    put("formats", b"\x07" + text)
    if case["format"] == "vllm_npy":
        put("npy_header", base64.b64decode(value)[:128])
arr = np.arange(24, dtype=np.uint16).reshape(4, 3, 2)
for dt in ("uint8", "int8", "uint16", "int16", "int32", "int64", "uint32"):
    put("npy_header", npy_file(arr.astype(dt))[:128])
put("npy_header", b"\x93NUMPY\x01\x00\x46\x00{'descr': '<u2', 'fortran_order': False, 'shape': (1,,3,2), }\n")
for doc in (
    {"sglext": {"routed_experts": {"data": "AQI=", "shape": [1, 1, 2]}}},
    {"choices": [{"index": 0, "message": {"routed_experts": {"data": "AQI=", "shape": [1, 1, 2]}}}]},
    {"meta_info": {"routed_experts": "AQAAAAIAAAA=", "routed_experts_dtype": "int32"}},
    {"nvext": {"routed_experts": None}},
):
    put("response", b"\x06" + json.dumps(doc).encode())
put("response", b'\x00{"choices":[{"routed_experts":1,"routed\\u005fexperts":2}]}')
# A prefill body as the proxy reads it (kv_transfer_params), and the ambiguous one (twice).
kv = '"kv_transfer_params":{"remote_block_ids":[3,5],"remote_host":"h"}'
put("response", ('\x00{' + kv + ',"choices":[{"index":0,"routed_experts":'
                 '{"data":"CgsUFR4f","shape":[3,1,2],"start":0}}]}').encode())
put("response", ('\x00{' + kv + ',"choices":[],' + kv + '}').encode())
put("trajectory", bytes([0, 0, 0, 3, 1, 2, 3, 0, 2, 3, 9, 9, 9, 3, 0, 6, 1]))
put("trajectory", bytes([3, 0x80, 0, 2, 1, 2, 3, 4, 5, 6, 7, 8, 4, 1, 1, 5, 5, 5, 5, 2, 3, 0]))
# quality: geometry (layers | top_k << 2), starts (a | b << 4), sizes (a | b << 4), mode, experts,
# then value bytes (byte - 2: 1 is the -1 sentinel, 0 is -2).
put("quality", bytes([0x0A, 0x10, 0x33, 0, 16, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                      4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 20]))
put("quality", bytes([0x09, 0x00, 0x22, 2, 200, 1, 1, 4, 5, 3, 4, 1, 1]))  # missing rows, x300
put("quality", bytes([0x0A, 0x00, 0x11, 3, 9, 3, 3, 4, 4, 3, 4, 4, 3]))  # repeats, past masks
put("quality", bytes([0x0A, 0x00, 0x11, 8, 2, 3, 4, 5, 6, 3, 4, 5, 6]))  # a huge num_experts
put("quality", bytes([0x1A, 0x00, 0x11, 4, 9, 3, 4, 0, 6, 3, 4, 5, 6]))  # layers differ
# The release matrix's shapes (docs/format.md §3.5): vLLM 0.21's split lists, vLLM 0.22+ .npy with
# token counts, a generate stream's routing event, SGLang's echo pair, NeMo-RL's filler, Dynamo's
# engine_data, weights, base85 and omni-npu values.
rows = np.array([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[1, 0], [3, 2]], [[5, 4], [7, 6]]])
usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
npy = base64.b64encode(npy_file(rows.astype(np.uint8))).decode()
flat = base64.b64encode(rows.astype("<i4").tobytes()).decode()
split_prefill = {"prompt_routed_experts": rows[:3].tolist(),
                 "choices": [{"index": 0, "routed_experts": None}],
                 "usage": dict(usage, completion_tokens=1)}
split_decode = {"prompt_routed_experts": np.zeros((3, 2, 2), int).tolist(),
                "choices": [{"index": 0, "routed_experts": rows[3:].tolist()}], "usage": usage}
releases = [
    split_decode,
    {"choices": [{"index": 0, "token_ids": None, "routed_experts": npy}], "usage": usage},
    {"request_id": "g", "choices": [{"index": 0, "token_ids": [12], "routed_experts": npy}],
     "usage": None},
    {"choices": [{"index": 0, "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                            "routed_experts": flat}}],
     "sglext": {"routed_experts": flat}},
    {"choices": [{"index": 0, "message": {"routed_experts": "nrlre1:int8:5x2x2:" + base64.b64encode(
        np.concatenate([rows, [[[0, 1], [0, 1]]]]).astype(np.int8).tobytes()).decode()}}],
     "usage": usage},
    {"nvext": {"engine_data": {"routed_experts": {"data": "AAECAwQFBgcBAAMCBQQHBg==",
                                                  "shape": [4, 2, 2]}}}},
    {"choices": [{"index": 0, "routed_experts": {"data": "AAECAw==", "shape": [1, 2, 2]},
                  "routed_expert_weights": {"data": "AAAA"}}]},
    {"choices": [{"index": 0, "routed_experts": {
        "data": base64.b85encode(rows.astype(np.int32).tobytes()).decode(), "shape": [4, 2, 2]}}]},
    {"choices": [{"index": 0, "routed_experts": {"routed_experts_shape": [4, 2, 2],
                                                 "routed_experts_str": "AAECAw=="}}]},
    {"meta_info": {"routed_experts": [], "prompt_tokens": 3, "completion_tokens": 2}},
]
for doc in releases:
    put("response", b"\x06" + json.dumps(doc).encode())
put("merge_response", json.dumps(split_prefill).encode() + b"\xff" + json.dumps(split_decode).encode())
put("merge_response", json.dumps(releases[3]).encode() + b"\xff" + json.dumps(releases[3]).encode())
put("formats", b"\x00" + json.dumps(rows.tolist()).encode())
# The proxy's client bodies: a generate request (limits in sampling_params).
put("proxy", json.dumps({"token_ids": [1, 2, 3], "stream": True, "sampling_params": {
    "max_tokens": 9, "min_tokens": 2, "routed_experts_prompt_start": 1}}).encode())
# Issue 38: sidecars with keys beyond data/shape/start/dtype (prime-rl PR #3523's weights; an
# unknown key), Dynamo's generation artifact receipts, NeMo-RL values with and without the filler,
# and nested lists at a choice of vLLM 0.21's generated count.
weighted = {"data": "AAECAwQFBgcBAAMCBQQHBg==", "shape": [4, 2, 2], "start": 0, "dtype": "uint8",
            "format_version": 1, "weights": {"data": "AACAPwAAAD8=", "dtype": "float32"}}
put("sidecar", json.dumps(weighted).encode())
put("sidecar", json.dumps(dict(weighted, weights=None, note="x")).encode())
body = lambda v: json.dumps({"choices": [{"index": 0, "routed_experts": v}]}).encode()  # noqa: E731
put("merge_response", body(weighted) + b"\xff" + body(dict(weighted, start=0)))
receipt = {"format": "generation_artifact_v1", "contents": ["moe_routes"], "state": "ready",
           "actual_bytes": 4096, "sha256": "ab", "object_id": "obj-7"}
for doc in (
    {"choices": [{"index": 0, "message": {"content": "x"}}],
     "nvext": {"routed_experts": None, "generation_artifact": receipt}},
    {"request_id": "g", "choices": [{"index": 0, "token_ids": [1]}], "generation_artifact": receipt},
    {"generation_artifact": {"format": "generation_artifact_v1", "contents": ["logprobs"]}},
    {"generation_artifact": {"object_id": "x"}},
    {"choices": [{"index": 0, "routed_experts": rows[3:].tolist()}], "usage": usage},
    {"choices": [{"index": 0, "message": {"routed_experts": "nrlre1:int8:4x2x2:" + base64.b64encode(
        rows.astype(np.int8).tobytes()).decode()}}], "usage": usage},
):
    put("response", b"\x06" + json.dumps(doc).encode())
    put("merge_response", json.dumps(doc).encode() + b"\xff" + json.dumps(doc).encode())
put("formats", b"\x00" + json.dumps("nrlre1:int8:1x1x2:AAE=").encode())
put("formats", b"\x00")

# vLLM's .npy halves whose text the kept-format merge copies: decode from 0 (no start hint in
# the harness), rows off and on the base64 grid (row bytes 8, 6 and 24 at these dtypes).
for dt, prompt, total in (("uint8", 5, 11), ("uint16", 4, 9), ("int32", 7, 13), ("int64", 3, 3)):
    ids = (np.arange(total * 2 * 4) % 97).astype(dt).reshape(total, 2, 4)
    ids = np.ascontiguousarray(ids[:, :, : (3 if dt == "uint16" else 4)])
    npy = lambda a: json.dumps(base64.b64encode(npy_file(a)).decode()).encode()  # noqa: E731
    wrap = lambda v: b'{"choices":[{"index":0,"routed_experts":' + v + b"}]}"  # noqa: E731
    put("merge_response", wrap(npy(ids[:prompt])) + b"\xff" + wrap(npy(ids)))

# The streaming merge: every merge seed, fed whole and in small pieces (flags byte, then piece
# lengths), and vLLM-shaped .npy events whose merge streams.
for seed in sorted((root / "merge_response").iterdir()):
    data = seed.read_bytes()
    put("stream_merge", data)
    put("stream_merge", data + b"\xff\x00" + bytes([0, 2, 6, 30, 1] * 8))
for prompt, total in ((3, 6), (12, 90)):
    ids = (np.arange(total * 2 * 4) % 251).astype(np.uint8).reshape(total, 2, 4)
    npy = lambda a: json.dumps(base64.b64encode(npy_file(a)).decode()).encode()  # noqa: E731
    pre = b'{"choices":[{"index":0,"routed_experts":' + npy(ids[:prompt]) + b"}]}"
    ev = b'{"choices":[{"index":0,"text":"t","routed_experts":' + npy(ids[prompt - 1:]) + b'}],"usage":null}\n'
    flags = 1 | ((prompt - 1) << 4)  # decode asked from prompt - 1
    put("stream_merge", pre + b"\xff" + ev + b"\xff" + bytes([flags, 5, 17, 3, 60, 0, 9]))
    put("stream_merge", pre + b"\xff" + ev + b"\xff" + bytes([flags]))

# Upstream replies as the proxy reads them whole (the first byte sets the pieces' size): a
# uvicorn JSON reply, a chunked one with extensions and trailers, one that runs to the close,
# an interim 100 before a reply, and a length beside chunked coding.
for seed in (
    b"\x07HTTP/1.1 200 OK\r\ndate: x\r\nserver: uvicorn\r\ncontent-length: 2\r\n"
    b"content-type: application/json\r\n\r\n{}",
    b"\x02HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;a=b\r\nabc\r\n0\r\nt: 1\r\n\r\n",
    b"\x3fHTTP/1.0 500 Internal Server Error\r\ncontent-type: text/plain\r\n\r\nboom",
    b"\x00HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    b"\x05HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
):
    put("upstream_reply", seed)
