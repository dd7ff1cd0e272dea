"""Merging the routing of a decode server's event stream, relayed as bytes: blocks of events
that cannot hold routing pass through untouched; only the event that carries it is merged."""

from __future__ import annotations

import routed_experts as rx
from routed_experts._core import _routing_count

# A block of events is looked at line by line only if it holds one of these: the routing key,
# a \u escape (the key may be spelled "routed\u005fexperts"), or the end-of-stream marker.
_LOOK_CLOSER = (b'"routed_experts"', b"\\u", b"[DONE]")


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

    def feed(self, chunk: bytes) -> bytes:
        """The complete lines this chunk ends, merged where they carry routing."""
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            self._hold(chunk)
            return b""
        block = chunk[:cut]
        if self._partial:
            block = b"".join([*self._partial, block])
            self._partial, self._partial_len = [], 0
        if cut < len(chunk):
            self._hold(chunk[cut:])
        return self._block(block)

    def finish(self) -> bytes:
        """The rest of the stream (a last line without a newline); then the checks above."""
        rest = b"".join(self._partial)
        self._partial, self._partial_len = [], 0
        out = self._block(rest) if rest else b""
        if not self.done:
            raise rx.MergeError("the decode stream ended without data: [DONE]")
        if not self.merged:
            rx.merge_response(self.prefill_body, b"{}", require_routing=True)
        return out

    def line(self, line: bytes) -> bytes:
        """One line of the stream, merged if it is a `data:` event that carries routing."""
        if line.strip() == b"data: [DONE]":
            self.done = True
            return line
        if not line.startswith(b"data:") or (
            b'"routed_experts"' not in line and b"\\u" not in line
        ):
            return line
        payload = line[5:].lstrip()
        merged = rx.merge_response(self.prefill_body, payload, start=self.start)
        if _routing_count(payload) > 0:
            self.merged = True
            self.merged_bytes += len(merged)
        return b"data: " + merged

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

    def _block(self, block: bytes) -> bytes:
        if len(block) > self.max_line_bytes:
            longest = max(len(line) for line in block.split(b"\n"))
            if longest > self.max_line_bytes:
                raise self._too_long()
        if not any(marker in block for marker in _LOOK_CLOSER):
            return block
        return b"".join(self.line(line) for line in block.splitlines(keepends=True))
