"""The long-context reliability rounds of `bench-proxy` (lockup, slow, split) at small sizes:
the same code `make bench-proxy` runs at the audit's sizes, here with budgets small enough that
the same situations arise in seconds. What is asserted is what must hold on any machine (every
stream ends merged or with a clean error, small requests are answered, nothing stays held);
memory figures are the benchmark's to report, not a timed test's to assert."""

from __future__ import annotations

import pytest
from engines import DATA_PLANE

from rx_bench import reliability

pytestmark = pytest.mark.skipif(DATA_PLANE != "rust", reason="the Rust server's own budget")


@pytest.mark.slow_under_emulation  # 14 s under qemu: budget queue, run natively
def test_more_large_streams_than_the_budget_holds_all_end_and_small_requests_get_through() -> None:
    # 12 streams of ~1 MiB routing events (1024 x 94 x 8) beside ~1 MiB prefill bodies, against
    # a 4 MiB budget: about two requests fit at once.
    r = reliability.bench_lockup(12, 1024, 4 << 20, kinds=("proxy",), timeout=60)
    proxy = r["proxy"]
    assert set(proxy["outcomes"]) <= {"merged", "error event"}, proxy
    assert sum(proxy["outcomes"].values()) == 12
    assert proxy["outcomes"].get("merged", 0) >= 1, proxy
    assert proxy["small_requests"] >= 1 and proxy["small_not_ok"] == 0, proxy
    assert proxy["after"] == {"buffered_bytes": 0, "in_flight": 0}
    assert proxy["after_ok"]


@pytest.mark.slow_under_emulation  # 66 MB of events merged and checked: minutes under qemu
@pytest.mark.parametrize("routing_format", ["compact", "engine"])
def test_long_vllm_routing_events_merge_as_they_pass_and_all_complete(routing_format: str) -> None:
    # vLLM's bodies: .npy, a 1000-token prompt, decode's event the 11,000 generated rows
    # (about 11 MB, past the size from which an event is merged as it passes), 6 at once
    # against a 24 MiB budget that could not hold them whole together; answered as compact
    # sidecars or as vLLM's own `.npy` text.
    r = reliability.bench_lockup(
        6, 12_000, 24 << 20, kinds=("proxy",), timeout=120, shape="vllm", generated=11_000,
        routing_format=routing_format,
    )
    assert r["event_mib"] > 8, r
    proxy = r["proxy"]
    assert proxy["outcomes"] == {"merged": 6}, proxy  # each byte for byte the whole merge's
    assert proxy["small_not_ok"] == 0, proxy
    assert proxy["after"] == {"buffered_bytes": 0, "in_flight": 0}
    assert proxy["after_ok"]


@pytest.mark.slow_under_emulation  # 26 s under qemu: budget timing, run natively
def test_slow_readers_hold_the_budget_until_they_read_and_give_it_back_when_they_leave() -> None:
    # Replies of ~8 MiB (8192 x 94 x 8) to clients with small receive windows: more than the
    # sockets' buffers take in, so the proxy holds the rest.
    r = reliability.bench_slow(4, 8192, 32 << 20, seconds=3, rcvbuf=4096)
    for kind in ("plain", "stream"):
        s = r[kind]
        # Their responses were counted while unread (never past the budget), and nothing is
        # left held once they leave.
        assert 1 < s["peak_buffered_mib"] <= 32, s
        assert s["after"]["buffered_bytes"] == 0 and s["after"]["in_flight"] == 0, s


@pytest.mark.slow_under_emulation  # 23 s under qemu: relay framing, run natively
def test_a_routing_event_one_byte_per_http_chunk_merges_as_in_one_piece() -> None:
    r = reliability.bench_split(256)
    assert r["one_piece"]["outcomes"] == {"merged": 1}
    assert r["byte_split"]["outcomes"] == {"merged": 1}
