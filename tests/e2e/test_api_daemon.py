"""The API of the real daemon, over HTTP in the lab's lb namespace.

What a client without the token, or with a hostile request, can make the daemon do
(issue 10, failures 12 and 13): a 64 MiB body without the token is refused before it is
read and the daemon's memory does not grow; a body over ``api.max_body_bytes`` is a 413;
an idle connection is closed; a weight of another type is a 422 that changes nothing. Then
fuzzing: schemathesis without the token or with a wrong one, and requests of hostile
sizes with it, all get a 4xx and leave the running configuration as it was; schemathesis
with the token (valid and invalid requests) never gets a 5xx, whatever state earlier
requests left; and the daemon still serves a plain configuration."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from xdplb.daemon.api import openapi_spec
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

PORT = 9181
TOKEN = "schemathesis-real-daemon"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE = f"http://127.0.0.1:{PORT}"
MAX_BODY = 1 << 20
IDLE = 1.0
API = {
    "listen": f"127.0.0.1:{PORT}",
    "token": TOKEN,
    "max_body_bytes": MAX_BODY,
    "idle_timeout": IDLE,
}
VIP = "/api/v1/vips/198.18.100.1/80/tcp"
schema = schemathesis.openapi.from_dict(openapi_spec())
#: Generated requests only (no coverage phase: hundreds of boundary cases per operation,
#: which a request refused at the door does not need).
FUZZING = schemathesis.Config.from_dict(
    {"phases": {"coverage": {"enabled": False}, "examples": {"enabled": False}}}
)
fuzzed = schemathesis.openapi.from_dict(openapi_spec(), config=FUZZING)


def vips(lab: Lab) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    return [{"address": "198.18.100.1", "port": 80, "backends": backends}]


@pytest.fixture(scope="module")
def daemon(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    node = LbNode(lab, tmp_path_factory.mktemp("api"), vips(lab), api=API)
    node.start()
    with lab.enter("lb"):  # the test's own thread talks from the lb namespace
        yield node
    node.destroy()


@pytest.fixture
def fresh(daemon: LbNode, lab: Lab) -> LbNode:
    """The daemon serving its plain configuration (earlier fuzzing may have changed it)."""
    with httpx.Client(base_url=BASE, headers=AUTH) as api:
        r = api.put("/api/v1/config", json=daemon.config.model_dump(mode="json"))
        assert r.status_code == 200, r.text
    return daemon


def running_config() -> Any:
    with httpx.Client(base_url=BASE, headers=AUTH) as api:
        r = api.get("/api/v1/config")
        assert r.status_code == 200, r.text
        return r.json()


def rss_kib(daemon: LbNode) -> int:
    assert daemon.proc is not None
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def connect() -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", PORT), timeout=5)
    return sock


def status_of(sock: socket.socket) -> int:
    """The status of the answer on ``sock`` (within the socket's timeout)."""
    line = sock.makefile("rb").readline()
    assert line.startswith(b"HTTP/1.1 "), line
    return int(line.split()[1])


def head(method: str, path: str, *headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: lb", "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (an EOF is waiting), without blocking."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("auth", ["", f"Authorization: Bearer wrong-{TOKEN}"])
def test_a_64_mib_body_without_the_token_is_401_unread(fresh: LbNode, auth: str) -> None:
    before = rss_kib(fresh)
    with connect() as sock:
        sock.sendall(
            head("PUT", "/api/v1/config", *filter(None, [auth]), f"Content-Length: {64 << 20}")
        )
        assert status_of(sock) == 401  # answered before a byte of the body was sent
        sent = 0
        with contextlib.suppress(OSError):  # the daemon closed the connection
            while sent < 64 << 20:
                sent += sock.send(b"\xff" * (1 << 20))
    assert sent < 64 << 20
    assert rss_kib(fresh) - before < 4096, f"{before} KiB -> {rss_kib(fresh)} KiB"


def test_a_body_over_the_limit_is_413(fresh: LbNode) -> None:
    before = running_config()
    with connect() as sock:
        sock.sendall(
            head(
                "PUT",
                "/api/v1/config",
                *[f"{k}: {v}" for k, v in AUTH.items()],
                f"Content-Length: {MAX_BODY + 1}",
            )
        )
        assert status_of(sock) == 413
    with connect() as sock:  # chunked: cut where the count passes the limit
        sock.sendall(
            head(
                "PUT",
                "/api/v1/config",
                *[f"{k}: {v}" for k, v in AUTH.items()],
                "Transfer-Encoding: chunked",
            )
        )
        chunk = b"[" * 65536
        for _ in range(MAX_BODY // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.sendall(b"1\r\n[\r\n")  # the byte over the limit; the body does not end
        assert status_of(sock) == 413
    assert running_config() == before


def test_idle_connections_are_closed(fresh: LbNode) -> None:
    start = time.monotonic()
    socks = [connect() for _ in range(20)]
    try:
        wait_for(
            lambda: [closed(s) for s in socks],
            "the daemon closing 20 idle connections",
            until=all,
            timeout=IDLE + 5,
        )
    finally:
        for s in socks:
            s.close()
    assert time.monotonic() - start >= IDLE * 0.9


@pytest.mark.parametrize("weight", ["3", True, 3.0])
def test_a_weight_of_another_type_is_422(fresh: LbNode, lab: Lab, weight: Any) -> None:
    be = f"{VIP}/backends/{lab.addr(lab.backends[0])}"
    before = running_config()
    with httpx.Client(base_url=BASE, headers=AUTH) as api:
        r = api.patch(be, json={"weight": weight})
        assert r.status_code == 422, r.text
        assert r.json() == {"error": "Input should be a valid integer", "field": "weight"}
        assert api.get(be).json()["weight"] == 1
    assert running_config() == before


# Fuzzing.


@fuzzed.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_without_the_token_every_answer_is_401(fresh: LbNode, case: schemathesis.Case) -> None:
    before = running_config()
    for headers in ({}, {"Authorization": f"Bearer not-{TOKEN}"}):
        r = case.call(base_url=BASE, headers=headers)
        if r.status_code == 400 and r.text == "Invalid HTTP request received.":
            # uvicorn's parser refused the request (a generated header such as an empty
            # Transfer-Encoding) before any route ran: a refusal too, nothing answered.
            continue
        assert r.status_code == 401, (case.method, case.formatted_path, r.text)
    assert running_config() == before


CHANGES = [
    ("PUT", "/api/v1/config"),
    ("POST", "/api/v1/vips"),
    ("PUT", VIP),
    ("PATCH", VIP + "/backends/198.18.0.11"),
    ("PUT", "/api/v1/acl"),
]
FIELDS = ["weight", "address", "vips", "allow", "instance", "port"]


@st.composite
def hostile(draw: st.DrawFn) -> tuple[str, str, bytes]:
    """A change with a hostile body (huge strings, numbers, arrays, nesting), or any
    route with a long path or query string."""
    method, path = draw(st.sampled_from(CHANGES))
    n = draw(st.sampled_from([1000, 100_000, MAX_BODY // 4, MAX_BODY + 1]))
    kind = draw(
        st.sampled_from(
            ["path", "query", "string", "number", "float", "array", "objects", "nesting"]
        )
    )
    if kind == "path":
        return "GET", "/api/v1/vips/" + "1" * min(n, 20_000) + "/80/tcp", b""
    if kind == "query":
        return method, path + "?persist=" + "a" * min(n, 20_000), b"{}"
    value = {
        "string": b'"' + b"a" * n + b'"',
        "number": b"9" * n,
        "float": b"1e" + b"9" * min(n, 400),
        "array": b"[" + b"0," * (n // 2) + b"0]",
        "objects": b"[" + b"{}," * (n // 3) + b"{}]",
        "nesting": b"[" * (n // 2) + b"]" * (n // 2),
    }[kind]
    return method, path, b'{"' + draw(st.sampled_from(FIELDS)).encode() + b'": ' + value + b"}"


@given(hostile())
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_hostile_sizes_are_4xx(fresh: LbNode, hostile_request: tuple[str, str, bytes]) -> None:
    method, path, body = hostile_request
    before = running_config()
    headers = {**AUTH, "Content-Type": "application/json"}
    with httpx.Client(base_url=BASE, headers=headers) as api:
        try:
            r = api.request(method, path, content=body)
        except (httpx.RemoteProtocolError, httpx.WriteError):
            # The daemon answered 413 and closed while the client was still sending.
            assert len(body) > MAX_BODY
        else:
            assert 400 <= r.status_code < 500, (method, path[:60], len(body), r.text[:200])
    assert fresh.proc is not None and fresh.proc.poll() is None, fresh.log_tail()
    assert running_config() == before


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_error_from_the_daemon(daemon: LbNode, case: schemathesis.Case) -> None:
    case.call_and_validate(base_url=BASE, headers=AUTH, checks=[not_a_server_error])
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()


def test_the_daemon_still_serves(daemon: LbNode, lab: Lab) -> None:
    daemon.write(
        [{"address": "198.18.100.1", "port": 80, "backends": [{"address": str(lab.addr("b1"))}]}],
        api=API,
    )
    with httpx.Client(base_url=BASE, headers=AUTH) as api:
        r = api.post("/api/v1/reload", params={"force": "true"})  # the fuzz's changes go
        assert r.status_code == 200, r.text
        st_ = api.get("/api/v1/status").json()
    assert [v["name"] for v in st_["vips"]] == ["198.18.100.1:80/tcp"]
    assert Path(daemon.config_path).exists()
