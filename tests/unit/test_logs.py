"""The daemon's log formats (text for the journal or a terminal, JSON lines), its logging
setup, and who the API's log lines name (the unix socket peer's uid and pid, a TCP peer's
address, whether a token came along)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fake_controller import FakeController

from xdplb.config import Config
from xdplb.control.caller import acting_for, caller
from xdplb.control.interface import ChangeResult
from xdplb.daemon import logs
from xdplb.daemon.api import create_app
from xdplb.daemon.serving import ApiProtocol
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.unit

DOWN = {
    "vip": "198.18.100.1:80/tcp",
    "backend": "198.18.0.12",
    "health": "down",
    "reason": "timeout after 1000 ms",
}


def record(level: int = logging.WARNING, /, **extra: Any) -> logging.LogRecord:
    rec = logging.LogRecord(
        "xdplb.control.runtime",
        level,
        __file__,
        1,
        "VIP %s: backend %s is down: %s",
        ("198.18.100.1:80/tcp", "198.18.0.12", "timeout after 1000 ms"),
        None,
    )
    rec.__dict__.update(extra)
    return rec


def test_text_for_the_journal_is_level_logger_message_fields() -> None:
    line = logs.TextFormatter(journal=True).format(record(**DOWN))
    assert line == (
        "<4>WARNING xdplb.control.runtime VIP 198.18.100.1:80/tcp: backend 198.18.0.12 is "
        "down: timeout after 1000 ms vip=198.18.100.1:80/tcp backend=198.18.0.12 health=down "
        'reason="timeout after 1000 ms"'
    )
    info = logs.TextFormatter(journal=True).format(record(logging.INFO, interfaces=["a", "b"]))
    assert info.startswith("<6>INFO ") and info.endswith(" interfaces=a,b")


def test_text_elsewhere_starts_with_a_timestamp() -> None:
    line = logs.TextFormatter().format(record())
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} WARNING xdplb\.control\.runtime VIP .*", line
    )


def test_json_is_one_object_with_the_event_fields() -> None:
    doc = json.loads(logs.JsonFormatter().format(record(**DOWN)))
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", doc.pop("time"))
    assert doc == {
        "level": "WARNING",
        "logger": "xdplb.control.runtime",
        "message": "VIP 198.18.100.1:80/tcp: backend 198.18.0.12 is down: timeout after 1000 ms",
        **DOWN,
    }
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record()
        rec.exc_info = sys.exc_info()
    one = logs.JsonFormatter().format(rec)
    assert "\n" not in one and "ValueError: boom" in json.loads(one)["exc"]


def test_the_journal_is_recognised_by_device_and_inode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (tmp_path / "stream").open("w") as f, (tmp_path / "other").open("w") as g:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert logs.stderr_is_journal(f)
        assert not logs.stderr_is_journal(g)  # inherited by a child whose stderr was redirected
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not logs.stderr_is_journal(f)


def test_setup_installs_one_handler_and_quiets_httpx() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    quiet = {n: logging.getLogger(n).level for n in logs.QUIET}
    root.handlers.clear()
    try:
        logs.setup(logs.LogFormat.JSON)
        (handler,) = root.handlers
        assert isinstance(handler.formatter, logs.JsonFormatter)
        assert root.level == logging.INFO
        assert all(logging.getLogger(n).level == logging.WARNING for n in logs.QUIET)
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        logs.setup(logs.LogFormat.TEXT)  # once only, like basicConfig
        assert root.handlers == [handler]
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        for n, level in quiet.items():
            logging.getLogger(n).setLevel(level)


class Recording(FakeController):
    """Records who the runtime would name for each change."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[str] = []

    def replace_config(self, cfg: Config, *, persist: bool) -> ChangeResult:
        self.callers.append(caller())
        return super().replace_config(cfg, persist=persist)


def serve(app: Any, **where: Any) -> Iterator[uvicorn.Server]:
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", http=ApiProtocol, **where)
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_for(lambda: server.started or not t.is_alive(), "uvicorn starting", timeout=5)
    try:
        yield server
    finally:
        server.should_exit = True
        t.join(5)


WEIGHT = "/api/v1/vips/198.18.100.1/80/tcp/backends/198.18.0.11"


def test_api_changes_run_as_their_unix_socket_peer(tmp_path: Path) -> None:
    fake = Recording()
    sock = tmp_path / "api.sock"
    app = logs.CallerMiddleware(create_app(fake), token=False)
    for _ in serve(app, uds=str(sock)):
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(transport=transport, base_url="http://xdplb") as c:
            assert c.patch(WEIGHT, json={"weight": 4}).status_code == 200
    assert fake.callers == [f"uid {os.getuid()} pid {os.getpid()} (unix socket, no token)"]
    assert caller() == "the daemon"  # the request's, not ours


def test_api_changes_over_tcp_name_the_address_and_the_token() -> None:
    fake = Recording()
    token = "a-token-of-16-chars"
    app = logs.CallerMiddleware(create_app(fake, token=token), token=True)
    for server in serve(app, host="127.0.0.1", port=0):
        port = server.servers[0].sockets[0].getsockname()[1]
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers) as c:
            assert c.patch(WEIGHT, json={"weight": 4}).status_code == 200
            local = c.get("/api/v1/status")  # (a read: nobody recorded)
            assert local.status_code == 200
    (who,) = fake.callers
    assert re.fullmatch(r"127\.0\.0\.1:\d+ \(token\)", who), who


def test_acting_for_nests_and_restores() -> None:
    with acting_for("SIGHUP"):
        assert caller() == "SIGHUP"
        with acting_for("the file changed"):
            assert caller() == "the file changed"
        assert caller() == "SIGHUP"
    assert caller() == "the daemon"
