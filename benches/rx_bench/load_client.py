"""The load rounds' HTTP/1.1 client: keep-alive connections on uvloop (asyncio's own loop where
uvloop is missing), a body with a length read straight into one buffer of its size, a chunked
body decoded as it arrives (a long chunk's data read straight into the connection's buffer).

Why not aiohttp: on the two cores the bench shares with the servers and engines, aiohttp spent
about 3.8 ms of the client's CPU reading each 4.2 MB answer (per read, a bytes object, a parser
callback and a queue entry, then the pieces joined), against 0.9 ms for a 0.3 MB one. A client
that costs more per byte than the server it measures caps the requests/s of whichever server
sends more bytes, and that is the measurement, not the server. Every server in a round gets the
same client.
"""

from __future__ import annotations

import asyncio
from typing import Any

_HEAD_LIMIT = 64 * 1024  # a response head larger than this is refused
_READ = 256 * 1024  # what one read asks for while the body's length is unknown
_BODY_LIMIT = 1 << 30  # a body said to be larger is refused before anything is allocated


class HttpError(Exception):
    """The server's answer could not be read as HTTP/1.1 (or the connection ended early)."""


class _Response(asyncio.BufferedProtocol):
    """One connection; one request in flight on it at a time."""

    def __init__(self) -> None:
        self.store = bytearray()  # the last body with a length: its buffer is used again
        self.chunks = bytearray()  # a chunked body's bytes (from 0 to `filled`), used again
        self.scratch = bytearray(_READ)  # reads while the body's length is unknown
        self.into_chunk = False  # whether the last buffer handed out was `chunks`
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytearray | memoryview]] | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head = bytearray()  # the head, then (chunked) the undecoded rest
        self.status = 0
        self.length: int | None = None  # the body's declared length
        self.body: bytearray | None = None
        self.filled = 0
        self.chunked = False
        self.chunk_left = 0  # data bytes of the current chunk still to come, read into `chunks`
        self.need_crlf = False  # a chunk's data ended: its CRLF comes next
        self.keep_alive = True

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection closed mid-answer ({exc})"))

    def get_buffer(self, sizehint: int) -> memoryview:
        self.into_chunk = False
        if self.length is not None and self.body is not None and self.filled < self.length:
            return memoryview(self.body)[self.filled :]
        if self.chunk_left:
            self.into_chunk = True
            end = self.filled + self.chunk_left
            self._room(end)
            return memoryview(self.chunks)[self.filled : end]
        return memoryview(self.scratch)

    def buffer_updated(self, nbytes: int) -> None:
        if self.waiter is None or self.waiter.done():
            return  # nothing asked: a stray byte on an idle connection is dropped with it
        try:
            if self.body is not None and self.length is not None:
                self.filled += nbytes
                if self.filled == self.length:
                    self._finish(self.body)
                return
            if self.into_chunk:
                self.filled += nbytes
                self.chunk_left -= nbytes
                self.need_crlf = not self.chunk_left
                return
            self.head += memoryview(self.scratch)[:nbytes]
            if not self.status:
                self._read_head()
            if self.chunked:
                self._read_chunks()
        except HttpError as e:
            self.waiter.set_exception(e)
        except ValueError as e:  # a length or chunk size that is not a number
            self.waiter.set_exception(HttpError(f"unreadable answer: {e}"))

    # parsing

    def _read_head(self) -> None:
        end = self.head.find(b"\r\n\r\n")
        if end < 0:
            if len(self.head) > _HEAD_LIMIT:
                raise HttpError(f"response head over {_HEAD_LIMIT} bytes")
            return
        lines = bytes(self.head[:end]).split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                self.length = int(value)
                if not 0 <= self.length <= _BODY_LIMIT:
                    raise HttpError(f"content-length {self.length} is not 0 to {_BODY_LIMIT}")
            elif name == b"transfer-encoding":
                self.chunked = value == b"chunked"
                if not self.chunked:
                    raise HttpError(f"transfer-encoding {value!r} is not read here")
            elif name == b"connection" and value == b"close":
                self.keep_alive = False
        rest = self.head[end + 4 :]
        if self.chunked:
            self.head, self.filled = rest, 0
        elif self.length is not None:
            if len(rest) > self.length:
                raise HttpError(f"{len(rest) - self.length} bytes after a {self.length}-byte body")
            # The same length again (a load repeats one request) reads into the same buffer, so
            # no fresh one is zeroed and faulted in for every answer.
            if len(self.store) != self.length:
                self.store = bytearray(self.length)
            self.body = self.store
            self.body[: len(rest)] = rest
            self.filled = len(rest)
            if self.filled == self.length:
                self._finish(self.body)
        else:
            raise HttpError("an answer with neither a length nor chunks is not read here")

    def _read_chunks(self) -> None:
        data, at = self.head, 0
        while True:
            if self.need_crlf:
                if len(data) < at + 2:
                    break
                if data[at : at + 2] != b"\r\n":
                    raise HttpError("a chunk's data not followed by CRLF")
                at += 2
                self.need_crlf = False
            eol = data.find(b"\r\n", at)
            if eol < 0:
                break
            size = int(bytes(data[at:eol]).split(b";", 1)[0], 16)
            if not 0 <= size <= _BODY_LIMIT - self.filled:
                raise HttpError(f"a chunk of {size} bytes past the {_BODY_LIMIT}-byte limit")
            if size == 0:  # the last chunk: no trailers expected, just the blank line
                if len(data) < eol + 4:
                    break
                del data[:]
                self._finish(memoryview(self.chunks)[: self.filled])
                return
            # What has come of its data is copied; the rest is read straight into `chunks`.
            take = min(size, len(data) - eol - 2)
            self._room(self.filled + size)
            self.chunks[self.filled : self.filled + take] = data[eol + 2 : eol + 2 + take]
            self.filled += take
            at = eol + 2 + take
            if take < size:
                self.chunk_left = size - take
                break
            self.need_crlf = True
        del data[:at]  # what is decoded goes, so the undecoded rest stays small

    def _room(self, end: int) -> None:
        """`chunks` at least `end` bytes long. A longer one is a new buffer (the last answer,
        a view of the old one, may still be held), so the size settles after a few answers."""
        if len(self.chunks) < end:
            grown = bytearray(max(end, 2 * len(self.chunks)))
            grown[: self.filled] = memoryview(self.chunks)[: self.filled]
            self.chunks = grown

    def _finish(self, body: bytearray | memoryview) -> None:
        assert self.waiter is not None
        self.waiter.set_result((self.status, body))


class Connection:
    """A keep-alive connection to `host:port`, opened when first asked and again after an
    answer that closes it or a timeout."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.protocol: _Response | None = None

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], timeout: float
    ) -> tuple[int, bytearray | memoryview]:
        """POST `body`; the status and the whole body (a view of it when it came in chunks),
        which is this connection's to reuse: it stays as it is until the next post. Raises
        HttpError or asyncio.TimeoutError (the connection is closed then)."""
        loop = asyncio.get_running_loop()
        if self.protocol is None or self.protocol.closed:
            _, proto = await loop.create_connection(_Response, self.host, self.port)
            self.protocol = proto
        p = self.protocol
        p._reset()
        p.waiter = loop.create_future()
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head += f"content-length: {len(body)}\r\n\r\n"
        assert p.transport is not None
        p.transport.writelines([head.encode(), body])
        try:
            status, content = await asyncio.wait_for(p.waiter, timeout)
        except BaseException:
            self.close()
            raise
        finally:
            p.waiter = None
        if not p.keep_alive:
            self.close()
        return status, content

    def close(self) -> None:
        if self.protocol is not None and self.protocol.transport is not None:
            self.protocol.transport.close()
        self.protocol = None


def run(coro: Any) -> Any:
    """Run `coro` to its end on a new uvloop loop (asyncio's where uvloop is missing)."""
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        # As asyncio.run ends: what is left running is cancelled and let finish first.
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
