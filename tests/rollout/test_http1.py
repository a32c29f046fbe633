"""The lean HTTP/1.1 client `SGLangGenerator` sends `/generate` through (rstar_jax.rollout.http1),
against real servers on loopback: aiohttp's, and raw asyncio servers for what aiohttp's server
does not write (bodies read to the close, interim answers, malformed answers)."""

import asyncio
import socket

import numpy as np
import orjson
import pytest
from aiohttp import web

from rstar_jax.rollout.http1 import Http1Pool, HttpConnectError, HttpDisconnected
from rstar_jax.rollout.protocol import SamplingParams
from rstar_jax.rollout.sglang import SGLangGenerator, SGLangUnavailable, _lean_pool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _aiohttp_server(routes: dict):
    app = web.Application(client_max_size=64 << 20)
    for path, handler in routes.items():
        app.router.add_route("*", path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _raw_server(answer, close_after: bool = False):
    """A server that reads one request head (+ Content-Length body) per exchange and writes
    `answer(request_bytes)`; None (or `close_after`, once written) closes the connection. Returns
    (server, port, peers)."""
    peers = []

    async def handle(reader, writer):
        peers.append(writer.get_extra_info("peername"))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                out = answer(head + body)
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], peers


def test_keep_alive_bodies_and_connection_reuse():
    async def scenario():
        seen = []

        async def echo(request):
            seen.append(request.transport.get_extra_info("peername"))
            body = await request.read()
            return web.Response(body=body[::-1], content_type="application/json")

        async def chunked(request):
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for part in (b"[1,", b"2,", b"3]"):
                await response.write(part)
            await response.write_eof()
            return response

        async def closing(request):
            return web.Response(body=b"{}", headers={"Connection": "close"})

        runner, port = await _aiohttp_server({"/echo": echo, "/chunked": chunked, "/closing": closing})
        pool = Http1Pool("127.0.0.1", port, limit=4)
        try:
            big = bytes(range(256)) * 2000  # larger than one socket read
            for _ in range(5):
                assert await pool.request("POST", "/echo", big) == (200, big[::-1])
            assert len(set(seen)) == 1  # one kept-alive connection served all five
            assert await pool.request("POST", "/chunked", b"{}") == (200, b"[1,2,3]")
            assert await pool.request("POST", "/closing", b"{}") == (200, b"{}")
            assert await pool.request("POST", "/echo", b"ab") == (200, b"ba")
            assert len(set(seen)) == 2  # the connection the server closed was not reused
            status, _ = await pool.request("POST", "/missing", b"{}")
            assert status == 404
            # At most `limit` connections however many requests are in flight.
            results = await asyncio.gather(*(pool.request("POST", "/echo", b"x%d" % k) for k in range(12)))
            assert [r[1] for r in results] == [(b"x%d" % k)[::-1] for k in range(12)]
            assert len(pool._idle) <= 4
        finally:
            pool.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_interim_answers_and_idle_connections_the_server_closed():
    async def scenario():
        server, port, peers = await _raw_server(
            lambda request: b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            close_after=True)
        pool = Http1Pool("127.0.0.1", port)
        try:
            assert await pool.request("POST", "/a", b"{}") == (200, b"ok")
            await asyncio.sleep(0.1)  # the server's close reaches the idle connection
            assert await pool.request("POST", "/a", b"{}") == (200, b"ok")  # on a new connection
            assert len(peers) == 2
        finally:
            pool.close()
            server.close()

    asyncio.run(scenario())


def test_a_body_without_length_ends_at_the_close():
    async def scenario():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n[1, 2]")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool("127.0.0.1", port)
        try:
            assert await pool.request("POST", "/g", b"{}") == (200, b"[1, 2]")
            assert await pool.request("POST", "/g", b"{}") == (200, b"[1, 2]")  # a new connection
            assert not pool._idle
        finally:
            pool.close()
            server.close()

    asyncio.run(scenario())


def test_failures_connect_timeout_disconnect_and_malformed_answers():
    async def scenario():
        with pytest.raises(HttpConnectError, match="cannot connect"):
            await Http1Pool("127.0.0.1", _free_port()).request("POST", "/g", b"{}")

        async def slow(request):
            await asyncio.sleep(1.0)
            return web.Response(body=b"{}")

        runner, port = await _aiohttp_server({"/slow": slow})
        pool = Http1Pool("127.0.0.1", port)
        try:
            with pytest.raises(TimeoutError):
                await pool.request("POST", "/slow", b"{}", timeout=0.2)
            assert not pool._idle  # the interrupted connection is closed, not pooled
            task = asyncio.ensure_future(pool.request("POST", "/slow", b"{}"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not pool._idle
        finally:
            pool.close()
            await runner.cleanup()

        for reply, match in ((None, "closed the connection"), (b"SMTP ready\r\n\r\n", "not an HTTP/1 status line"),
                             (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "Content-Length"),
                             (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "hexadecimal")):
            server, port, _ = await _raw_server(lambda request, reply=reply: reply)
            pool = Http1Pool("127.0.0.1", port)
            try:
                with pytest.raises(HttpDisconnected, match=match):
                    await pool.request("POST", "/g", b"{}", timeout=5)
            finally:
                pool.close()
                server.close()

    asyncio.run(scenario())


def test_generate_gives_the_same_result_through_either_client():
    """One fake SGLang `/generate` (with a path prefix, as behind a proxy): the lean client and
    aiohttp send the same body and read the same result; a refused connection is retried, then
    raises SGLangUnavailable, as through aiohttp."""

    async def scenario():
        bodies = []

        async def generate(request):
            raw = await request.read()
            bodies.append((request.path, request.headers.get("Content-Type"), raw))
            ids = orjson.loads(raw)["input_ids"]
            out = [i + 1 for i in ids[-3:]]
            lps = [-0.5, float(np.float32(-1.25e-3)), -7.0]
            return web.Response(body=orjson.dumps({"output_ids": out, "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3",
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)]}}),
                content_type="application/json")

        async def server_info(request):
            return web.json_response({"max_total_num_tokens": 4096, "context_length": 1024,
                                      "max_req_input_len": 1000, "vocab_size": 1000})

        runner, port = await _aiohttp_server({"/v1/generate": generate, "/v1/get_server_info": server_info})
        sampling = SamplingParams(max_new_tokens=8, seed=3)
        try:
            results = []
            for lean in (True, False):
                async with SGLangGenerator(f"http://127.0.0.1:{port}/v1/") as gen:
                    assert (gen._lean is not None) and gen._lean_prefix == "/v1"
                    if not lean:
                        gen._lean = None
                    results.append(await gen.generate(np.arange(10, 20, dtype=np.int32), sampling, rid="r1"))
            assert results[0] == results[1]
            assert list(results[0].token_ids) == [18, 19, 20] and results[0].weight_version == 3
            assert bodies[0] == bodies[1] and bodies[0][:2] == ("/v1/generate", "application/json")
        finally:
            await runner.cleanup()
        async with SGLangGenerator(f"http://127.0.0.1:{_free_port()}", retries=1, backoff_s=0.01) as gone:
            gone._info, gone._vocab_checked = {"max_total_num_tokens": 10}, True
            with pytest.raises(SGLangUnavailable, match="failed after 2 attempt.*HttpConnectError"):
                await gone.generate([1], sampling)

    asyncio.run(scenario())


def test_only_plain_http_urls_take_the_lean_client():
    assert _lean_pool("http://127.0.0.1:30000", 8)[0].port == 30000
    assert _lean_pool("http://[::1]:30000", 8)[0]._host_header == b"Host: [::1]:30000\r\n"
    for url in ("https://example.com", "http://user:pw@127.0.0.1:1", "http://127.0.0.1:1/?x=1"):
        assert _lean_pool(url, 8) == (None, "")
    assert SGLangGenerator("http://127.0.0.1:1", codec="json")._lean is None
