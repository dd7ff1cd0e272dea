"""Merging the routing of a decode server's event stream, relayed as bytes: blocks of events
that cannot hold routing pass through untouched; only the event that carries it is merged."""

from __future__ import annotations

import routed_experts as rx
from routed_experts._core import _routing_count

# What may hold routing: the key, or any \u escape (the key may be spelled "routed\u005fexperts").
_ROUTING_MARKERS = (b'"routed_experts"', b"\\u")
# A block of events is looked at line by line only if it may hold routing or the stream's end.
_LOOK_CLOSER = (*_ROUTING_MARKERS, b"[DONE]")


class StreamMerger:
    """Merges the routing of server-sent events from a decode server with the prefill routing.

    Feed it the decode stream's bytes as they arrive (`feed`), then call `finish`: what they
    return is the stream to send on, with every event that carries `routed_experts` merged and
    every other byte as it came. Raises RoutedExpertsError when routing cannot be merged, when
    the stream ended without `data: [DONE]`, or when no event carried routing while the prefill
    body did. A line (one event's data) longer than `max_line_bytes` is a PayloadError.
    """

    def __init__(
        self, prefill_body: bytes, start: int | None = None, max_line_bytes: int | None = None
    ) -> None:
        self.prefill_body, self.start = prefill_body, start
        self.max_line_bytes = max_line_bytes if max_line_bytes is not None else rx.get_max_bytes()
        self.merged = False  # some event carried routing (and was merged)
        self.done = False  # the stream's `data: [DONE]` was seen
        self.merged_bytes = 0  # bytes of the merged events
        self._partial: list[bytes] = []  # the line being received, in pieces
        self._partial_len = 0

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete line held back until its end arrives."""
        return self._partial_len

    def feed(self, chunk: bytes) -> list[bytes]:
        """The pieces to send on for the lines this chunk completes (routing merged)."""
        out: list[bytes] = []
        pos = 0
        if self._partial:
            nl = chunk.find(b"\n")
            if nl < 0:
                self._hold(chunk)
                return out
            pos = nl + 1
            self._hold(chunk if pos == len(chunk) else chunk[:pos])
            out += self._held_line()
        cut = chunk.rfind(b"\n") + 1
        if cut > pos:
            # (A whole-range slice of bytes is the object itself: no copy in the common case.)
            out += self._block(chunk[pos:cut])
            pos = cut
        if pos < len(chunk):
            self._hold(chunk[pos:])
        return out

    def finish(self) -> list[bytes]:
        """The rest of the stream (a last line without a newline); then the checks above."""
        out = self._held_line() if self._partial else []
        if not self.done:
            raise rx.MergeError("the decode stream ended without data: [DONE]")
        if not self.merged:
            rx.merge_response(self.prefill_body, b"{}", require_routing=True)
        return out

    def line(self, line: bytes) -> list[bytes]:
        """One line of the stream, as pieces: merged if it is a `data:` event that carries
        routing, else as it came."""
        if line.strip() == b"data: [DONE]":
            self.done = True
            return [line]
        if not line.startswith(b"data:") or not _may_route(line):
            return [line]
        return self._event(line[5:].lstrip())

    def _event(self, payload: bytes) -> list[bytes]:
        merged = rx.merge_response(self.prefill_body, payload, start=self.start)
        if _routing_count(payload) > 0:
            self.merged = True
            self.merged_bytes += len(merged)
        return [b"data: ", merged]

    def _held_line(self) -> list[bytes]:
        """The line held in pieces, now complete. A `data:` line (the large event with the
        routing arrives this way) loses its prefix before the pieces are joined, so the event
        is copied once."""
        pieces, self._partial, self._partial_len = self._partial, [], 0
        if len(pieces) > 1 and len(pieces[0]) < 16:
            pieces = [pieces[0] + pieces[1], *pieces[2:]]  # room to see the prefix
        first = pieces[0]
        if len(pieces) > 1 and first.startswith(b"data:") and first[5:].strip():
            payload = b"".join([first[5:].lstrip(), *pieces[1:]])
            if payload.strip() == b"[DONE]":
                self.done = True
            elif _may_route(payload):
                return self._event(payload)
            return pieces  # as it came
        return self._block(b"".join(pieces))

    def _hold(self, piece: bytes) -> None:
        self._partial_len += len(piece)
        if self._partial_len > self.max_line_bytes:
            raise self._too_long()
        self._partial.append(piece)

    def _too_long(self) -> rx.PayloadError:
        return rx.PayloadError(
            f"decode stream: a line of more than {self.max_line_bytes} bytes "
            "(the limit on one event)"
        )

    def _block(self, block: bytes) -> list[bytes]:
        if len(block) > self.max_line_bytes:
            longest = max(len(line) for line in block.split(b"\n"))
            if longest > self.max_line_bytes:
                raise self._too_long()
        if not any(marker in block for marker in _LOOK_CLOSER):
            return [block]
        out: list[bytes] = []
        for line in block.splitlines(keepends=True):
            out += self.line(line)
        return out


def _may_route(text: bytes) -> bool:
    return any(marker in text for marker in _ROUTING_MARKERS)
