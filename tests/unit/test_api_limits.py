"""What a client may make the API read and hold (issue 10, failure 12): the token is
checked before a byte of the body is read, a body is bounded in size (at once by its
Content-Length, else as it streams) and in time, and uvicorn, as the daemon configures
it, closes a connection that sends nothing, or trickles its headers, and bounds headers.

The ASGI application is driven by hand here, with a ``receive`` that counts what it is
asked for, so "not read" is a count, not a guess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from fake_controller import CONFIG, FakeController
from starlette.types import ASGIApp, Message

from xdplb.config import ApiConfig, parse_config
from xdplb.daemon.api import body_limit, create_app
from xdplb.daemon.serving import MAX_HEADER_BYTES, server_options

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token-limits"
PATCH = "/api/v1/vips/198.18.100.1/80/tcp/backends/198.18.0.11"
CHUNK = b"x" * 65536


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        #: How many times the application called receive.
        self.reads = 0

    @property
    def error(self) -> tuple[str, str]:
        body = json.loads(self.body)
        return body["error"], body["field"]


def call(
    app: ASGIApp,
    method: str,
    path: str,
    headers: dict[str, str],
    body: Iterator[bytes],
    *,
    client: tuple[str, int] = ("198.18.0.1", 40000),
) -> Answer:
    """One request through the ASGI app; ``body`` is consumed only as far as the app
    reads (an endless iterator is an endless body; ``b""`` ends it; StopIteration: the
    client stops sending)."""
    answer = Answer()

    async def receive() -> Message:
        answer.reads += 1
        try:
            chunk = next(body)
        except StopIteration:
            await asyncio.Event().wait()  # a client that stopped sending
            raise AssertionError("unreachable") from None
        return {"type": "http.request", "body": chunk, "more_body": chunk != b""}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        else:
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": client,
        "server": ("127.0.0.1", 9180),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return answer


def endless() -> Iterator[bytes]:
    while True:
        yield CHUNK


def fake_with(**api: Any) -> FakeController:
    cfg = parse_config({**CONFIG, "api": api})
    return FakeController(cfg=cfg, file_cfg=cfg)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "a bearer token is required"),
        ({"Authorization": "Bearer wrong-token-xxxxx"}, "wrong bearer token"),
        ({"Authorization": f"Basic {TOKEN}"}, "a bearer token is required"),
    ],
)
def test_no_token_is_401_before_the_body_is_read(headers: dict[str, str], message: str) -> None:
    fake = FakeController()
    app = create_app(fake, token=TOKEN)
    big = {"Content-Length": str(64 << 20), "Content-Type": "application/json"}
    answer = call(app, "PATCH", PATCH, {**headers, **big}, endless())
    assert (answer.status, answer.error, answer.reads) == (401, (message, ""), 0)
    assert answer.headers["www-authenticate"] == "Bearer"
    assert answer.headers["connection"] == "close"
    chunked = {"Transfer-Encoding": "chunked", "Content-Type": "application/json"}
    answer = call(app, "PUT", "/api/v1/config", {**headers, **chunked}, endless())
    assert (answer.status, answer.reads) == (401, 0)
    assert fake.replaced == 0


def test_no_token_from_another_host_is_401_before_the_body_is_read() -> None:
    app = create_app(FakeController())
    headers = {"Content-Length": str(64 << 20)}
    answer = call(app, "PATCH", PATCH, headers, endless(), client=("198.18.0.1", 40000))
    assert (answer.status, answer.reads) == (401, 0)
    answer = call(app, "PATCH", PATCH, headers, endless(), client=("127.0.0.1", 40000))
    assert answer.status == 413  # local: served, so the body's size is what refuses it


def test_a_body_over_its_content_length_limit_is_413_unread() -> None:
    fake = fake_with(max_body_bytes=4096)
    app = create_app(fake, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": "4097"}
    answer = call(app, "PATCH", PATCH, headers, endless())
    assert (answer.status, answer.reads) == (413, 0)
    assert answer.error == ("the body is larger than 4096 bytes (api.max_body_bytes)", "")
    assert answer.headers["connection"] == "close"
    assert fake.replaced == 0


@pytest.mark.parametrize("declared", ["", "abc", "-1", "1e3"])
def test_a_content_length_that_is_not_a_number_is_400_unread(declared: str) -> None:
    """uvicorn's h11 refuses these first; another server or an ASGI client may not."""
    fake = fake_with(max_body_bytes=4096)
    app = create_app(fake, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": declared}
    answer = call(app, "PATCH", PATCH, headers, endless())
    assert (answer.status, answer.reads) == (400, 0)
    assert answer.error[0] == f"Content-Length {declared!r} is not a number"
    assert fake.replaced == 0


def test_a_streamed_body_is_cut_at_the_limit() -> None:
    fake = fake_with(max_body_bytes=1 << 20)
    app = create_app(fake, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}", "Transfer-Encoding": "chunked"}
    answer = call(app, "PUT", "/api/v1/config", headers, endless())
    assert answer.status == 413
    assert answer.reads == (1 << 20) // len(CHUNK) + 1  # not one chunk past the limit
    assert fake.replaced == 0


def test_a_body_that_stops_arriving_is_408() -> None:
    fake = fake_with(body_timeout=0.2)
    app = create_app(fake, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": "100"}
    answer = call(app, "PATCH", PATCH, headers, iter([b'{"weight":']))
    assert answer.status == 408
    assert answer.error == ("the body took over 0.2 s (api.body_timeout)", "")
    assert fake.replaced == 0


def test_a_body_within_the_limit_is_served() -> None:
    fake = fake_with(max_body_bytes=4096)
    app = create_app(fake, token=TOKEN)
    body = b'{"weight": 7}'
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/json",
        "Transfer-Encoding": "chunked",
    }
    answer = call(app, "PATCH", PATCH, headers, iter([body[:5], body[5:], b""]))
    assert answer.status == 200, answer.body
    assert fake.cfg.vips[0].backends[0].weight == 7
    assert "connection" not in answer.headers


def test_the_default_body_limit_fits_the_largest_sensible_configuration() -> None:
    """At the default limits: 512 VIPs of 64 backends, each with a health check, and
    every ACL prefix of both families, as GET /config answers it."""
    vips = [
        {
            "address": f"fd78:6470:6c62:100::{i + 1:x}",
            "port": 443,
            "health": {"checker": {"http": {"uri": "/healthz", "check_port": 8443}}},
            "backends": [
                {"address": f"fd78:6470:6c62::{(i * 8 + j) % 4095 + 1:x}", "weight": 100}
                for j in range(64)
            ],
        }
        for i in range(512)
    ]
    acl = {
        "allow": [f"fd78:{i:x}::/32" for i in range(16384)],
        "deny": [f"10.{i // 256}.{i % 256}.0/24" for i in range(16384)],
    }
    cfg = parse_config({"tunnel": {"source_v6": "fd78::2"}, "acl": acl, "vips": vips})
    size = len(json.dumps(cfg.model_dump(mode="json")))
    assert size < body_limit(cfg) < 3 * size
    assert body_limit(cfg) == 6 << 20
    small = parse_config({"limits": {"vips": 4, "acl_rules": 16}})
    assert body_limit(small) == 1 << 20


# uvicorn as the daemon configures it, on a loopback port.


@asynccontextmanager
async def served(api: ApiConfig) -> AsyncIterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    app = create_app(FakeController(), token=TOKEN)
    config = uvicorn.Config(app, log_level="critical", lifespan="off", **server_options(api))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(5):
            while not server.started:
                await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


async def closed_after(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection."""
    return await reader.read()


async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Send a request's headers a line every 0.1 s, never the end of them, for up to 3 s:
    whether the server closed the connection meanwhile."""
    writer.write(b"GET /api/v1/status HTTP/1.1\r\n")
    with contextlib.suppress(ConnectionError), contextlib.suppress(TimeoutError):
        async with asyncio.timeout(3):
            while True:
                writer.write(b"X-Slow: a\r\n")
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):  # a slow client's pace
                        if await reader.read() == b"":
                            return True
    return reader.at_eof()


def test_idle_connections_are_closed() -> None:
    async def run() -> None:
        async with served(ApiConfig(idle_timeout=0.5)) as port:
            loop = asyncio.get_running_loop()
            start = loop.time()
            silent = await asyncio.open_connection("127.0.0.1", port)
            assert await trickle(*await asyncio.open_connection("127.0.0.1", port))
            async with asyncio.timeout(3):
                assert await closed_after(silent[0]) == b""
            assert 0.4 < loop.time() - start < 2.5
            # A request is served, and its connection is closed once idle again.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
            writer.write(b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n")
            async with asyncio.timeout(3):
                assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                await closed_after(reader)
            silent[1].close()
            writer.close()

    asyncio.run(run())


def test_headers_are_bounded() -> None:
    async def run() -> None:
        async with served(ApiConfig()) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /api/v1/status HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEADER_BYTES)
            async with asyncio.timeout(3):
                assert (await reader.readline()).startswith(b"HTTP/1.1 400")
            writer.close()

    asyncio.run(run())


def test_connections_are_bounded() -> None:
    async def run() -> None:
        async with served(ApiConfig(max_connections=3)) as port:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /api/v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(3):
                assert (await reader.readline()).startswith(b"HTTP/1.1 503")
            for _, w in [*held, (reader, writer)]:
                w.close()

    asyncio.run(run())


def test_a_huge_array_of_bad_items_costs_one_error() -> None:
    """A list stops at its first bad item: 200,000 bad VIPs are one error, not 200,000
    (which took seconds and hundreds of MB to build and count)."""
    fake = FakeController()
    app = create_app(fake, token=TOKEN)
    body = json.dumps({**fake.cfg.model_dump(mode="json"), "vips": [{}] * 200_000}).encode()
    headers = {
        "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
    }
    answer = call(app, "PUT", "/api/v1/config", headers, iter([body, b""]))
    assert (answer.status, answer.error) == (422, ("Field required", "vips[0].address"))
    assert fake.replaced == 0
