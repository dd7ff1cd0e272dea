"""Prometheus metrics of one proxy app (a registry of its own, so several apps in one process,
or in tests, do not collide), served at `GET /metrics`."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Seconds: from a fast merge (a millisecond) to a long generation (ten minutes).
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    600,
)

PHASES = ("prefill", "decode", "merge", "total")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "routed_experts_proxy_requests",
            "Requests answered, by endpoint, HTTP status and the side at fault "
            "(none, client, prefill, decode, merge, proxy); 499: the client left first",
            ["endpoint", "status", "side"],
            registry=r,
        )
        self.seconds = Histogram(
            "routed_experts_proxy_phase_seconds",
            "Time of each phase of a request: prefill call, decode call (to the end of a "
            "stream), merge, and the whole request",
            ["phase"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.merged_bytes = Counter(
            "routed_experts_proxy_merged_bytes",
            "Bytes of merged response bodies and merged stream events sent to clients",
            registry=r,
        )
        self.in_flight = Gauge(
            "routed_experts_proxy_requests_in_flight",
            "Completion requests being served",
            registry=r,
        )
        self.rejected = Counter(
            "routed_experts_proxy_rejected",
            "Requests refused with 503 before any upstream was called, by reason "
            "(in_flight: over --max-in-flight; no_upstream: a side has no server in rotation)",
            ["reason"],
            registry=r,
        )
        self.upstream_healthy = Gauge(
            "routed_experts_proxy_upstream_healthy",
            "1 while an upstream is in rotation, 0 while it is ejected by passive health checks",
            ["side", "upstream"],
            registry=r,
        )
        self.upstream_failures = Counter(
            "routed_experts_proxy_upstream_failures",
            "Failed requests to an upstream (no connection, timeout, broken reply, 5xx)",
            ["side", "upstream"],
            registry=r,
        )
        self._phase = {p: self.seconds.labels(p) for p in PHASES}

    def observe(self, phase: str, seconds: float) -> None:
        self._phase[phase].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
