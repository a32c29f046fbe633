"""A lean HTTP/1.1 client for the rollout's hot path: one POST per turn to a server on plain HTTP.

`SGLangGenerator` sends `/generate` through it (the control plane keeps aiohttp): per request it
writes one buffer (request line, four headers, the JSON body) on a kept-alive connection and reads
the status, the headers it needs and the body, with none of a general client's per-request
machinery (header multidicts, tracing, cookie and redirect handling, payload writers, response
objects): about half the client CPU per request at a rollout's sizes
(benchmarks/RESULTS.md, "The host side of a rollout").

What it keeps of a client: keep-alive connections pooled per server (at most `limit` open, a
connection the server closed while idle is dropped before it is reused, one that answered with
`Connection: close` or was interrupted is closed), a connect timeout and a total timeout per request,
`Content-Length`, chunked and read-to-close bodies. Failures raise `HttpConnectError` (the request
never left: safe to retry), `HttpDisconnected` (the connection broke or the answer was not HTTP: it
may have reached the server) and `TimeoutError`; cancelling the caller closes the connection.
"""

from __future__ import annotations

import asyncio

_MAX_HEAD = 64 * 1024  # a status line and headers longer than this are not an HTTP answer we read


class HttpError(Exception):
    """A request that got no complete HTTP answer."""


class HttpConnectError(HttpError):
    """No connection to the server: the request was not sent."""


class HttpDisconnected(HttpError):
    """The connection broke (or the answer was malformed) after the request was written."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection; at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future | None = None
        self._buf = bytearray()
        self._reset()

    def _reset(self) -> None:
        self._status = 0
        self._head = -1  # bytes of the status line and headers, once read
        self._length = -1  # Content-Length, when given
        self._chunked = False
        self._to_close = False  # the body runs to the end of the connection
        self._keep = True
        self._chunks: bytearray | None = None
        self._at = 0  # chunked: where the next chunk's size line starts

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():  # nothing asked: a server talking out of turn
            self.close()
            return
        self._buf += data
        try:
            self._parse()
        except HttpDisconnected as e:
            self._fail(e)

    def eof_received(self):
        if self._waiter is not None and not self._waiter.done() and self._to_close and self._head >= 0:
            self._done(bytes(memoryview(self._buf)[self._head:]), keep=False)
        self.closed = True
        return False  # close the transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._to_close and self._head >= 0 and exc is None:
                self._done(bytes(memoryview(self._buf)[self._head:]), keep=False)
            else:
                self._fail(HttpDisconnected(f"the server closed the connection before answering in full"
                                            f"{f' ({exc})' if exc else ''}"))

    # -- one exchange ----------------------------------------------------------------------------
    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """Writes `request`, returns (status, body, whether the connection can be reused)."""
        self._reset()
        self._buf.clear()
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self._waiter

    def _done(self, body: bytes, keep: bool) -> None:
        self._buf = bytearray()  # an idle connection holds no buffer
        self._keep = keep
        self._waiter.set_result((self._status, body, keep and not self.closed))

    def _fail(self, error: Exception) -> None:
        self.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)

    def _parse(self) -> None:
        buf = self._buf
        while self._head < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise HttpDisconnected(f"no end of the headers in the first {_MAX_HEAD} bytes")
                return
            self._read_head(bytes(buf[:end]))
            if 100 <= self._status < 200:  # an interim answer: the real one follows
                del buf[:end + 4]
                self._reset()
                continue
            self._head = end + 4
            if self._status in (204, 304):
                self._length = 0
        if self._length >= 0:
            need = self._head + self._length
            if len(buf) >= need:
                if len(buf) > need:
                    raise HttpDisconnected(f"{len(buf) - need} bytes after a {self._length}-byte body")
                self._done(bytes(memoryview(buf)[self._head:need]), self._keep)
        elif self._chunked:
            self._parse_chunks()
        # else: the body runs to the end of the connection (eof_received / connection_lost)

    def _read_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpDisconnected(f"not an HTTP/1 status line: {lines[0][:100]!r}")
        self._status = int(parts[1])
        self._keep = parts[0] != b"HTTP/1.0"
        self._length, self._chunked = -1, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                try:
                    self._length = int(value)
                except ValueError:
                    raise HttpDisconnected(f"a Content-Length that is not a number: {value[:40]!r}") from None
            elif name == b"transfer-encoding":
                self._chunked = b"chunked" in value.lower()
            elif name == b"connection":
                value = value.strip().lower()
                if value == b"close":
                    self._keep = False
                elif value == b"keep-alive":
                    self._keep = True
        if self._chunked:
            self._length = -1  # Transfer-Encoding wins over Content-Length (RFC 9112 6.3)
            self._chunks, self._at = bytearray(), 0
        elif self._length < 0:
            self._to_close, self._keep = True, False

    def _parse_chunks(self) -> None:
        buf, at = self._buf, max(self._at, self._head)
        while True:
            line_end = buf.find(b"\r\n", at)
            if line_end < 0:
                self._at = at
                return
            size_text = bytes(buf[at:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpDisconnected(f"a chunk size that is not hexadecimal: {size_text[:40]!r}") from None
            if size == 0:
                trailer_end = buf.find(b"\r\n\r\n", line_end)  # the trailer section (usually empty)
                if buf[line_end:line_end + 4] == b"\r\n\r\n" or trailer_end >= 0:
                    self._done(bytes(self._chunks), self._keep)
                self._at = at
                return
            if len(buf) < line_end + 2 + size + 2:
                self._at = at
                return
            self._chunks += buf[line_end + 2:line_end + 2 + size]
            at = line_end + 2 + size + 2


class Http1Pool:
    """Kept-alive connections to one `host:port`, at most `limit` open (further requests wait)."""

    def __init__(self, host: str, port: int, *, limit: int = 1024):
        self.host, self.port = host, port
        self._limit = limit
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._host_header = f"Host: {f'[{host}]' if ':' in host else host}:{port}\r\n".encode("ascii")

    async def request(self, method: str, target: str, body: bytes | None = None, *,
                      timeout: float | None = None, connect_timeout: float | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; `target` is the path (and query). timeout: seconds for the
        whole request, the wait for a connection included; connect_timeout: for opening one."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            self._drop_idle()
            self._loop, self._slots = loop, asyncio.Semaphore(self._limit)
        head = (f"{method} {target} HTTP/1.1\r\n".encode("latin-1") + self._host_header +
                (b"Accept: */*\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                 if body is not None else b"Accept: */*\r\n\r\n"))
        request = head + body if body is not None else head
        if timeout is None:
            return await self._send(request, connect_timeout)
        async with asyncio.timeout(timeout):
            return await self._send(request, connect_timeout)

    async def _send(self, request: bytes, connect_timeout: float | None) -> tuple[int, bytes]:
        async with self._slots:
            conn = None
            while self._idle:
                conn = self._idle.pop()
                if not conn.closed:
                    break
                conn = None
            if conn is None:
                conn = await self._connect(connect_timeout)
            try:
                status, body, keep = await conn.exchange(request)
            except BaseException:  # a failure, a timeout or a cancellation: the exchange is unfinished
                conn.close()
                raise
            if keep and not conn.closed:
                self._idle.append(conn)
            else:
                conn.close()
            return status, body

    async def _connect(self, timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as e:
            raise HttpConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        return conn

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            try:
                conn.close()
            except RuntimeError:  # its loop is already closed
                pass

    def close(self) -> None:
        """Closes the idle connections (those in use close when their request ends)."""
        self._drop_idle()


__all__ = ["Http1Pool", "HttpConnectError", "HttpDisconnected", "HttpError"]
