"""The servers of one side (prefill or decode): round robin over those in rotation, and passive
health checks. A server that fails `eject_after` times in a row (no connection, a timeout, a
broken reply, a 5xx) leaves the rotation for `eject_seconds`; then it gets one trial request at a
time until one succeeds. Nothing is probed on the side: real requests are the checks."""

from __future__ import annotations

import logging
import math
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("routed_experts.proxy")


def check_url(url: str) -> str:
    """`url` if it can be an upstream's base URL (`http(s)://HOST[:PORT][/PREFIX]`, to which
    the endpoint path is appended), else ValueError saying what is wrong with it. Checked at
    start: a URL without a scheme would otherwise fail every request."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"expected a URL starting with http:// or https://, got {url!r}")
    try:
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        raise ValueError(f"expected a port from 1 to 65535 in {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"expected a host in {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"expected no query or fragment in {url!r} (endpoints are appended)")
    return url


class Upstream:
    """One server and its health."""

    def __init__(self, side: str, url: str) -> None:
        check_url(url)
        self.side, self.url = side, url.rstrip("/")
        self.failures = 0  # in a row
        self.ejected_until = 0.0  # time.monotonic() when it may be tried again
        self.trials = 0  # trial requests (or a probe) under way while it is out of rotation
        self.probed_at = -math.inf  # time.monotonic() of the last probe


@dataclass
class Lease:
    """An upstream picked for one request; `trial` when it is out of rotation and on trial."""

    upstream: Upstream
    trial: bool


# Outcomes of a request to an upstream, for its health.
OK, FAILED, UNKNOWN = "ok", "failed", "unknown"


class Pool:
    """Round robin over one side's upstreams, skipping those out of rotation.

    `on_change(upstream, healthy)` is called when an upstream leaves or rejoins the rotation.
    """

    def __init__(
        self,
        side: str,
        urls: Sequence[str],
        eject_after: int,
        eject_seconds: float,
        on_change: Callable[[Upstream, bool], Any] = lambda u, healthy: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError(f"give at least one {side} server")
        self.side = side
        self.upstreams = [Upstream(side, url) for url in urls]
        self.eject_after, self.eject_seconds = eject_after, eject_seconds
        self.on_change, self.clock = on_change, clock
        self._next = 0

    def healthy(self, u: Upstream) -> bool:
        return u.failures < self.eject_after

    def pick(self, avoid: Upstream | None = None) -> Lease | None:
        """The next upstream in rotation (not `avoid`), or one whose ejection is over and that
        has no trial under way; None when there is neither."""
        now, n = self.clock(), len(self.upstreams)
        for i in range(n):
            u = self.upstreams[(self._next + i) % n]
            if u is avoid:
                continue
            if self.healthy(u):
                self._next = (self._next + i + 1) % n
                return Lease(u, trial=False)
            if now >= u.ejected_until and u.trials == 0:
                u.trials += 1
                return Lease(u, trial=True)
        return None

    def probe_candidate(self, interval: float) -> Upstream | None:
        """When no upstream can be picked: the out-of-rotation one to probe before refusing (the
        one whose ejection ends first, with no trial or probe under way and no probe in the
        last `interval` seconds), reserved as a trial; None when there is none. Failures alone
        never shut a side out: a server that answers its probe serves the request."""
        now = self.clock()
        ready = [
            u
            for u in self.upstreams
            if not self.healthy(u) and u.trials == 0 and now - u.probed_at >= interval
        ]
        if not ready:
            return None
        u = min(ready, key=lambda x: x.ejected_until)
        u.trials += 1
        u.probed_at = now
        return u

    def probed(self, u: Upstream, answered: bool) -> Lease | None:
        """The outcome of `probe_candidate`'s probe: a trial lease when the server answered
        (the request it serves decides whether it rejoins), else None."""
        if answered:
            return Lease(u, trial=True)
        u.trials -= 1
        return None

    def release(self, lease: Lease, outcome: str) -> None:
        """Record how a request to the leased upstream ended (OK, FAILED or UNKNOWN: the client
        left before it was known)."""
        u = lease.upstream
        if lease.trial:
            u.trials -= 1
        if outcome == OK:
            if not self.healthy(u):
                log.warning("%s server %s is back in rotation", self.side, u.url)
                self.on_change(u, True)
            u.failures = 0
        elif outcome == FAILED:
            u.failures += 1
            if u.failures >= self.eject_after:
                u.ejected_until = self.clock() + self.eject_seconds
                if u.failures == self.eject_after or lease.trial:
                    log.warning(
                        "%s server %s failed %d times in a row: out of rotation for %g s",
                        self.side,
                        u.url,
                        u.failures,
                        self.eject_seconds,
                    )
                if u.failures == self.eject_after:
                    self.on_change(u, False)

    def retry_after(self) -> int:
        """Whole seconds until an upstream of this side may be tried again (at least 1)."""
        now = self.clock()
        wait = min(max(u.ejected_until - now, 0.0) for u in self.upstreams)
        return max(1, math.ceil(wait))

    def status(self) -> list[dict[str, Any]]:
        """Each upstream's health, for /health."""
        now = self.clock()
        return [
            {
                "url": u.url,
                "healthy": self.healthy(u),
                "consecutive_failures": u.failures,
                "retry_in_s": round(max(u.ejected_until - now, 0.0), 3)
                if not self.healthy(u)
                else 0.0,
            }
            for u in self.upstreams
        ]

    def any_healthy(self) -> bool:
        return any(self.healthy(u) for u in self.upstreams)
