"""vLLM's disaggregated-serving protocol as the proxy speaks it: the constants a client or a
test needs. The rules themselves (what each side receives, the errors) are the Rust data
plane's (`src/proxy/request.rs`)."""

from __future__ import annotations

from typing import Any

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
REQUEST_ID = "x-request-id"

# What vLLM's disaggregated prefill expects: compute the prompt, keep the KV cache for a remote
# decode, return the parameters the decode server needs to fetch it. The prefill request
# carries exactly this (the Rust data plane's PREFILL_KV_TRANSFER_PARAMS; a test compares).
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
