"""vLLM's disaggregated-serving protocol as the proxy speaks it: the constants a client or a
test needs, read from the Rust data plane that holds them (`crates/proxy/src/request.rs`),
which also holds the rules (what each side receives, the errors)."""

from __future__ import annotations

import json
from typing import Any

from routed_experts._core import _proxy_protocol

_paths, _request_id, _prefill_kv = _proxy_protocol()

# The endpoints the proxy serves.
ENDPOINTS: tuple[str, ...] = tuple(_paths)
# The header that carries a request's id, to the upstreams and back.
REQUEST_ID: str = _request_id
# What vLLM's disaggregated prefill expects: compute the prompt, keep the KV cache for a remote
# decode, return the parameters the decode server needs to fetch it. The prefill request
# carries exactly this.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = json.loads(_prefill_kv)
