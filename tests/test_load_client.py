"""The bench's load client (`benches/rx_bench/load_client.py`): an answer read whole however
the bytes are split, with a length or in chunks; connections reused, closed and reopened;
errors and timeouts raised, not read as answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rx_bench import load_client
from rx_bench.load_client import Connection, HttpError, _Response


def _feed(data: bytes, cuts: list[int]) -> Any:
    """Hand `data` to a protocol as the loop would, in pieces ending at `cuts`; the waiter."""

    async def go() -> Any:
        p = _Response()
        p.waiter = asyncio.get_running_loop().create_future()
        at = 0
        for end in [*sorted(c for c in cuts if 0 < c < len(data)), len(data)]:
            while at < end:
                buf = p.get_buffer(-1)
                n = min(len(buf), end - at)
                buf[:n] = data[at : at + n]
                p.buffer_updated(n)
                at += n
        return p.waiter

    return asyncio.run(go())


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = [], 0
    for size in sizes:
        piece = body[at : at + size]
        if not piece:
            break
        out.append(b"%x;ext=1\r\n" % len(piece) + piece + b"\r\n")
        at += len(piece)
    if at < len(body):
        out.append(b"%x\r\n" % (len(body) - at) + body[at:] + b"\r\n")
    return b"".join(out) + b"0\r\n\r\n"


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=3000),
    cuts=st.lists(st.integers(0, 4000), max_size=12),
    chunked=st.booleans(),
    sizes=st.lists(st.integers(1, 700), max_size=8),
)
def test_an_answer_is_read_whole_however_its_bytes_are_split(
    body: bytes, cuts: list[int], chunked: bool, sizes: list[int]
) -> None:
    if chunked:
        data = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(body, sizes)
    else:
        data = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    waiter = _feed(data, cuts)
    assert waiter.done() and waiter.result() == (200, body)


def test_an_answer_is_not_done_before_its_last_byte() -> None:
    data = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789"
    assert not _feed(data[:-1], []).done()
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(b"abc", [2])
    assert not _feed(chunked[:-2], []).done()  # the blank line after the last chunk not yet in


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", "transfer-encoding b'gzip'"),
        (b"HTTP/1.1 200 OK\r\n\r\nbody until close", "neither a length nor chunks is"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nabc", "1 bytes after a 2-byte body"),
        (b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 20000, "response head over 65536 bytes"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 4e3\r\n\r\n", "unreadable answer"),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 9999999999\r\n\r\n", "is not 0 to 1073741824"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "unreadable answer"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffff\r\n", "past the"),
    ],
)
def test_an_answer_it_cannot_read_is_an_error(data: bytes, says: str) -> None:
    waiter = _feed(data, [])
    with pytest.raises(HttpError, match=says.replace("(", r"\(")):
        waiter.result()


async def _server(answers: list[bytes], seen: list[bytes]) -> asyncio.Server:
    """Answers each request (read whole by its length) with the next of `answers`; an answer
    of b"" closes the connection unanswered; one that starts "SLOW" is never sent."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer_all(reader, writer)
        finally:
            writer.close()

    async def answer_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            seen.append(head + await reader.readexactly(length))
            answer = answers.pop(0)
            if answer.startswith(b"SLOW"):
                await asyncio.sleep(30)
            if not answer:
                break
            # Sent in pieces, so the client reads an answer across several reads.
            for i in range(0, len(answer), 7):
                writer.write(answer[i : i + 7])
                await writer.drain()
            if b"connection: close" in answer:
                break

    return await asyncio.start_server(serve, "127.0.0.1", 0)


def _answer(body: bytes, *headers: bytes) -> bytes:
    extra = b"".join(h + b"\r\n" for h in headers)
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_a_connection_is_kept_then_reopened_after_close_and_answers_stay_apart() -> None:
    seen: list[bytes] = []
    answers = [
        _answer(b'{"a":1}'),
        _answer(b'{"b":2}'),  # the same length: read into the same buffer, not mixed up
        _answer(b"[]", b"connection: close"),
        _answer(b"longer body"),
    ]

    async def go() -> list[Any]:
        server = await _server(answers, seen)
        port = server.sockets[0].getsockname()[1]
        conn = Connection("127.0.0.1", port)
        got = []
        for i in range(4):
            status, content = await conn.post("/v1/x", b"{}", {"x-request-id": f"r{i}"}, 5.0)
            got.append((status, bytes(content)))
        conn.close()
        server.close()
        return got

    got = load_client.run(go())
    assert got == [(200, b'{"a":1}'), (200, b'{"b":2}'), (200, b"[]"), (200, b"longer body")]
    assert [s.split(b"\r\n")[0] for s in seen] == [b"POST /v1/x HTTP/1.1"] * 4
    assert all(b"content-length: 2\r\n" in s and s.endswith(b"\r\n\r\n{}") for s in seen)
    assert b"x-request-id: r3" in seen[3]


def test_an_answer_cut_short_or_late_is_raised_and_the_next_post_reconnects() -> None:
    seen: list[bytes] = []
    answers = [b"", b"SLOW", _answer(b"ok")]

    async def go() -> list[str]:
        server = await _server(answers, seen)
        port = server.sockets[0].getsockname()[1]
        conn = Connection("127.0.0.1", port)
        said = []
        with pytest.raises(HttpError, match="connection closed mid-answer"):
            await conn.post("/", b"1", {}, 5.0)
        said.append("closed")
        with pytest.raises(asyncio.TimeoutError):
            await conn.post("/", b"2", {}, 0.3)
        said.append("timed out")
        status, content = await conn.post("/", b"3", {}, 5.0)
        said.append(f"{status} {bytes(content).decode()}")
        conn.close()
        server.close()
        return said

    # Three requests from one client: the unanswered, the late (its connection closed), and one
    # on a new connection.
    assert load_client.run(go()) == ["closed", "timed out", "200 ok"]
    assert len(seen) == 3


def test_a_long_chunk_is_read_into_the_connections_buffer_which_grows_once_needed() -> None:
    async def go() -> list[Any]:
        p = _Response()
        got = []
        for body in (b"a" * 1000, b"b" * 300_000, b"c" * 10):
            p._reset()
            p.waiter = asyncio.get_running_loop().create_future()
            data = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(body, [])
            at = 0
            while at < len(data):
                buf = p.get_buffer(-1)
                n = min(len(buf), len(data) - at, 4096)  # the chunk's data in 4 KiB reads
                buf[:n] = data[at : at + n]
                p.buffer_updated(n)
                at += n
            got.append((p.waiter.result()[1], bytes(p.waiter.result()[1]) == body))
        return got

    (first, ok1), (second, ok2), (third, ok3) = asyncio.run(go())
    assert ok1 and ok2 and ok3
    # The second answer needed a larger buffer: the first answer's view still shows its bytes;
    # the third reused the second's buffer.
    assert bytes(first) == b"a" * 1000 and third.obj is second.obj


def test_a_chunked_answer_is_checked_by_its_bytes() -> None:
    from rx_bench.proxy import _as_expected

    buffer = bytearray(b"abcdef")  # a connection's buffer, longer than the answer in it
    assert _as_expected(b"abc", memoryview(buffer)[:3])
    assert not _as_expected(b"abd", memoryview(buffer)[:3])
    assert not _as_expected(b"ab", memoryview(buffer)[:3])
    assert not _as_expected(b"abcd", memoryview(buffer)[:3])
    assert _as_expected(b"abc", bytearray(b"abc")) and not _as_expected(b"abc", bytearray(b"ab"))
