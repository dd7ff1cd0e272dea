"""The load rounds' HTTP/1.1 client: keep-alive connections on uvloop (asyncio's own loop where
uvloop is missing), a body with a length read straight into one buffer of its size, a chunked
body decoded as it arrives.

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
        self.scratch = bytearray(_READ)  # reads while the body's length is unknown
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, bytes | bytearray]] | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head = bytearray()  # the head, then (chunked) the undecoded rest
        self.status = 0
        self.length: int | None = None  # the body's declared length
        self.body: bytearray | None = None
        self.filled = 0
        self.chunked = False
        self.chunk_at = 0  # in `head`: where the next chunk's size line starts
        self.keep_alive = True

    # asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(HttpError(f"connection closed mid-answer ({exc})"))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.length is not None and self.body is not None and self.filled < self.length:
            return memoryview(self.body)[self.filled :]
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
            self.head, self.body = rest, bytearray()
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
        assert self.body is not None
        data, at = self.head, self.chunk_at
        while True:
            eol = data.find(b"\r\n", at)
            if eol < 0:
                break
            size = int(bytes(data[at:eol]).split(b";", 1)[0], 16)
            if not 0 <= size <= _BODY_LIMIT - len(self.body):
                raise HttpError(f"a chunk of {size} bytes past the {_BODY_LIMIT}-byte limit")
            if size == 0:  # the last chunk: no trailers expected, just the blank line
                if len(data) < eol + 4:
                    break
                del data[:]
                self._finish(self.body)
                return
            if len(data) < eol + 2 + size + 2:
                break
            self.body += memoryview(data)[eol + 2 : eol + 2 + size]
            at = eol + 2 + size + 2
        del data[:at]  # what is decoded goes, so the undecoded rest stays small
        self.chunk_at = 0

    def _finish(self, body: bytearray) -> None:
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
    ) -> tuple[int, bytes | bytearray]:
        """POST `body`; the status and the whole body, which is this connection's to reuse: it
        stays as it is until the next post. Raises HttpError or asyncio.TimeoutError (the
        connection is closed then)."""
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
