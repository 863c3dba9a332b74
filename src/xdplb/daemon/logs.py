"""How the daemon logs: its two formats, and who made each API call.

This module owns the daemon's log output (``xdplb run --log-format text|json``) and the
"who" of the API: :func:`setup` installs the one handler, on stderr, in either format;
:func:`peer_of` reads the peer of each connection (``SO_PEERCRED`` on the unix socket:
uid and pid; the address on TCP; the daemon's uvicorn protocol leaves it in each
request's ``scope["state"]``), and :class:`CallerMiddleware` makes it, with whether a
token came along, the :func:`~xdplb.control.caller.caller` of the request, which the
runtime's log lines name.

- ``text``: ``LEVEL logger message key=value...``, one line per event; with a timestamp
  first, except when stderr is the journal (``JOURNAL_STREAM`` names it), which stamps
  lines itself and reads the level from a ``<N>`` syslog prefix.
- ``json``: one object per line: ``time``, ``level``, ``logger``, ``message`` and the
  event's fields (``vip``, ``backend``, ``reason``, ``who``, ...; ``extra=`` of the call).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import socket
import struct
import sys
from enum import StrEnum
from typing import IO, Any

from xdplb.control.caller import acting_for


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


#: Attributes every LogRecord has: what is not one of them came with ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

#: syslog priorities of the levels (journald's ``<N>`` prefix).
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3}


def fields(record: logging.LogRecord) -> dict[str, Any]:
    """The event's own fields: what the call passed as ``extra``."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _value(v: Any) -> str:
    text = ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)
    if not text or any(c.isspace() or c in '"=\\' for c in text):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """``[<N>][time ]LEVEL logger message key=value...`` (see the module docstring)."""

    def __init__(self, *, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        line = f"{record.levelname} {record.name} {record.getMessage()}"
        line += "".join(f" {k}={_value(v)}" for k, v in fields(record).items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if self.journal:
            prio = _PRIORITY.get(record.levelno, 2 if record.levelno > logging.ERROR else 6)
            return f"<{prio}>{line}"
        when = self.formatTime(record, "%Y-%m-%dT%H:%M:%S")
        return f"{when}.{int(record.msecs):03d} {line}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        when = dt.datetime.fromtimestamp(record.created, dt.UTC)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in fields(record).items():
            doc.setdefault(k, v)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def stderr_is_journal(stream: IO[str] | None = None) -> bool:
    """Whether stderr is journald's stream (systemd sets ``JOURNAL_STREAM`` to its
    ``device:inode``; a child whose stderr was redirected inherits the variable)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat((stream or sys.stderr).fileno())
    except (ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


#: Libraries' loggers that say a line per request (a health check's HTTP request).
QUIET = ("httpx", "httpcore")


def setup(fmt: LogFormat = LogFormat.TEXT, *, verbose: bool = False) -> None:
    """The daemon's logging: one handler on stderr in ``fmt``; INFO (DEBUG if
    ``verbose``); nothing per health check from httpx and httpcore. Like
    ``logging.basicConfig``, nothing is done if the root logger has a handler already (a
    test's capture)."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(journal=stderr_is_journal()))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)


# -- who calls the API -----------------------------------------------------------------

#: Where the protocol leaves the peer in the request's ``scope["state"]``.
PEER = "xdplb.peer"


def peer_of(sock: Any) -> str | None:
    """``uid 0 pid 4242`` (unix socket, ``SO_PEERCRED``) or ``198.18.0.1:51234`` (TCP)."""
    if sock is None:
        return None
    try:
        if sock.family == socket.AF_UNIX:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", creds)
            return f"uid {uid} pid {pid}"
        host, port = sock.getpeername()[:2]
    except OSError:
        return None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class CallerMiddleware:
    """ASGI: each HTTP request runs as its peer (:func:`~xdplb.control.caller.caller`):
    ``uid 0 pid 4242 (unix socket, no token)``, ``198.18.0.1:51234 (token)``."""

    def __init__(self, app: Any, *, token: bool) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        peer = scope.get("state", {}).get(PEER)
        client = scope.get("client")
        if peer is None and client:
            host, port = client[0], client[1]
            peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        sent = any(k == b"authorization" for k, _ in scope.get("headers", ()))
        how = "token" if self.token and sent else "no token"
        if peer is None or peer.startswith("uid "):
            how = f"unix socket, {how}"
        with acting_for(f"{peer or 'unknown peer'} ({how})"):
            await self.app(scope, receive, send)
