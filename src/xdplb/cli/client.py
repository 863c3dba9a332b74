"""A client of the daemon's HTTP API (:mod:`xdplb.daemon.api`), for the CLI and for tests.

Where it connects (:func:`endpoint`, the one order every command follows): ``--api URL``
if given; else the ``api`` section of the configuration file given with ``-c``
(``api.listen``: a TCP address or ``unix:/path``, with the file's token); else the default
unix socket ``/run/xdplb/<instance>.api.sock`` (``XDPLB_RUN_DIR`` moves it). Every error
names the endpoint it tried and where that came from. Answers are parsed into the models
of :mod:`xdplb.control.interface` and :mod:`xdplb.control.status`.

What it raises, which the CLI maps to its exit codes:

- :class:`NotRunning` (exit 3): nothing listens: the socket file is absent, or the
  connection is refused (a stale socket, or no daemon on that port);
- :class:`Unreachable` (exit 1): any other transport failure (timeout, reset);
- :class:`ApiError` (exit 2 for a 4xx, 1 for a 5xx): the daemon answered an error;
  ``error`` and ``field`` are those of its body.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from xdplb.config import AclConfig, BackendConfig, Config, VipConfig
from xdplb.config import Protocol as L4Protocol
from xdplb.config.load import api_token
from xdplb.control.interface import AclView, ChangeResult, DrainStatus, VipRef
from xdplb.control.status import BackendStatus, ClusterStatus, Status, VipStatus
from xdplb.core.addresses import IPAddress
from xdplb.core.closing import Closing
from xdplb.core.paths import api_socket

M = TypeVar("M", bound=BaseModel)

#: Seconds a request may take; every handler of the daemon is quick.
DEFAULT_TIMEOUT = 5.0
#: How often ``wait_drained`` asks.
DRAIN_POLL = 0.1


class ClientError(Exception):
    """Base of what :class:`Client` raises."""


class NotRunning(ClientError):
    """No daemon listens where the client connects."""


class Unreachable(ClientError):
    """The daemon could not be reached or did not answer in time."""


class ApiError(ClientError):
    """The daemon answered with an error status."""

    def __init__(self, status: int, error: str, field: str = "") -> None:
        self.status = status
        self.error = error
        self.field = field
        super().__init__(f"{error} (field {field})" if field else error)


class DrainTimeout(ClientError):
    """``wait_drained`` gave up; ``last`` is the last drain status it read."""

    def __init__(self, last: DrainStatus, waited: float) -> None:
        self.last = last
        self.waited = waited
        super().__init__(f"{last.backend} of {last.vip} not drained after {waited:.1f} s")


_VIP_RE = re.compile(
    r"^(?:\[(?P<v6>[^\]]+)\]|(?P<v4>[0-9.]+)):(?P<port>[0-9]{1,5})(?:/(?P<proto>\w+))?$"
)


def parse_vip(text: str) -> VipRef:
    """``198.18.100.1:80/tcp``, ``[fd78::1]:443/udp``; the protocol defaults to tcp.
    ValueError with a message for the operator otherwise."""
    m = _VIP_RE.match(text.strip())
    if m is None:
        raise ValueError(
            f"{text!r}: a VIP is written ADDRESS:PORT[/PROTOCOL], e.g. 198.18.100.1:80/tcp "
            "or [fd78:6470:6c62:100::1]:80/udp"
        )
    host = m["v6"] or m["v4"]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address") from None
    if (m["v6"] is not None) != (addr.version == 6):
        raise ValueError(f"{text!r}: only IPv6 addresses are written in brackets")
    port = int(m["port"])
    if port > 65535:
        raise ValueError(f"{text!r}: port {port} is above 65535")
    proto = (m["proto"] or "tcp").lower()
    if proto not in ("tcp", "udp"):
        raise ValueError(f"{text!r}: the protocol is tcp or udp, not {proto!r}")
    return VipRef(address=addr, port=port, protocol=L4Protocol(proto))


def parse_backend(text: str) -> IPAddress:
    """A backend address (brackets around an IPv6 one are accepted). ValueError."""
    try:
        return ipaddress.ip_address(text.strip().removeprefix("[").removesuffix("]"))
    except ValueError:
        raise ValueError(f"{text!r} is not an IP address") from None


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is asked: a base URL or a unix socket, the bearer token to send,
    and where the choice came from (``--api``, ``api.listen in FILE``; empty for the
    default socket), which every error repeats."""

    url: str | None = None
    socket: Path | None = None
    token: str | None = None
    origin: str = ""

    @property
    def where(self) -> str:
        return self.url if self.url is not None else str(self.socket)

    @property
    def described(self) -> str:
        return f"{self.where} (from {self.origin})" if self.origin else self.where


def endpoint(
    instance: str = "default",
    *,
    api: str | None = None,
    token: str | None = None,
    config: Path | None = None,
    cfg: Config | None = None,
) -> Endpoint:
    """The daemon of ``instance``: ``api`` (``--api``) if given; else ``cfg.api`` (the
    ``-c`` file ``config``, already loaded): ``api.listen`` as a TCP address or a unix
    socket, its token or token file; else the default unix socket of ``instance``.
    ``token`` (``--token``, else ``XDPLB_TOKEN``) wins over the file's. ConfigError if the
    file's token file cannot be read."""
    if token is None:
        token = os.environ.get("XDPLB_TOKEN") or None
    if api is not None:
        return Endpoint(url=api, token=token, origin="--api")
    if cfg is not None:
        if token is None:
            token = api_token(cfg.api)
        listen, origin = cfg.api.listen, f"api.listen in {config}"
        if listen.startswith("unix:"):
            return Endpoint(socket=Path(listen.removeprefix("unix:")), token=token, origin=origin)
        if listen:
            return Endpoint(url=f"http://{listen}", token=token, origin=origin)
        instance = cfg.instance
    return Endpoint(socket=api_socket(instance), token=token)


def _nobody_listens(e: BaseException) -> OSError | None:
    """A refused connection or an absent socket, somewhere in httpx's exception chain
    (httpx wraps httpcore's error, which carries the OSError as its argument)."""
    todo: list[BaseException] = [e]
    seen: set[int] = set()
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, ConnectionRefusedError | FileNotFoundError):
            return x
        todo += [a for a in (x.__cause__, x.__context__, *x.args) if isinstance(a, BaseException)]
    return None


def _vip_path(vip: VipRef) -> str:
    return f"/api/v1/vips/{vip.address}/{vip.port}/{vip.protocol}"


def _backend_path(vip: VipRef, backend: IPAddress) -> str:
    return f"{_vip_path(vip)}/backends/{backend}"


def _acl_path(vip: VipRef | None) -> str:
    return "/api/v1/acl" if vip is None else f"{_vip_path(vip)}/acl"


class Client(Closing):
    """The API of one daemon, at ``where`` (an :class:`Endpoint`; default: the one
    :func:`endpoint` finds for ``instance``, ``api`` and ``token``)."""

    def __init__(
        self,
        instance: str = "default",
        *,
        api: str | None = None,
        token: str | None = None,
        where: Endpoint | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.endpoint = where if where is not None else endpoint(instance, api=api, token=token)
        ep = self.endpoint
        headers = {"Authorization": f"Bearer {ep.token}"} if ep.token else {}
        self.socket = ep.socket
        self.where = ep.described
        if ep.url is not None:
            self._http = httpx.Client(base_url=ep.url, headers=headers, timeout=timeout)
        else:
            transport = httpx.HTTPTransport(uds=str(ep.socket))
            self._http = httpx.Client(
                transport=transport, base_url="http://xdplb", headers=headers, timeout=timeout
            )

    def close(self) -> None:
        self._http.close()

    # Transport.

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One request; raises NotRunning, Unreachable or ApiError as documented above."""
        ep = self.endpoint
        if ep.socket is not None and not ep.socket.exists():
            origin = f" (from {ep.origin})" if ep.origin else ""
            raise NotRunning(f"no daemon: {ep.socket} does not exist{origin}")
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.ConnectError as e:
            if (why := _nobody_listens(e)) is not None:
                reason = os.strerror(why.errno).lower() if why.errno else str(why)
                raise NotRunning(f"no daemon at {self.where}: {reason}") from None
            raise Unreachable(f"cannot reach the daemon at {self.where}: {e}") from None
        except httpx.TransportError as e:
            raise Unreachable(f"the daemon at {self.where} did not answer: {e!r}") from None
        if resp.is_success:
            return resp
        try:
            body = resp.json()
            error, field = str(body["error"]), str(body.get("field", ""))
        except (ValueError, KeyError, TypeError):
            error, field = resp.text.strip() or resp.reason_phrase, ""
        raise ApiError(resp.status_code, error, field)

    def _get(self, model: type[M], method: str, path: str, **kwargs: Any) -> M:
        resp = self.request(method, path, **kwargs)
        try:
            return model.model_validate_json(resp.content)
        except ValidationError as e:
            raise Unreachable(f"unexpected answer from {self.where}{path}: {e}") from None

    def _list(self, model: type[M], path: str) -> list[M]:
        resp = self.request("GET", path)
        try:
            return TypeAdapter(list[model]).validate_json(resp.content)  # type: ignore[valid-type]
        except ValidationError as e:
            raise Unreachable(f"unexpected answer from {self.where}{path}: {e}") from None

    @staticmethod
    def _persist(persist: bool) -> dict[str, str]:
        return {"persist": "true" if persist else "false"}

    # The API.

    def status(self) -> Status:
        return self._get(Status, "GET", "/api/v1/status")

    def cluster(self) -> ClusterStatus:
        """ApiError 404 when the daemon has no bgp, cluster or sync section."""
        return self._get(ClusterStatus, "GET", "/api/v1/cluster")

    def config(self) -> Config:
        return self._get(Config, "GET", "/api/v1/config")

    def replace_config(self, cfg: Config, *, persist: bool = False) -> ChangeResult:
        return self._get(
            ChangeResult,
            "PUT",
            "/api/v1/config",
            params=self._persist(persist),
            json=cfg.model_dump(mode="json"),
        )

    def reload(self, *, force: bool = False) -> ChangeResult:
        params = {"force": "true"} if force else {}
        return self._get(ChangeResult, "POST", "/api/v1/reload", params=params)

    def vips(self) -> list[VipStatus]:
        return self._list(VipStatus, "/api/v1/vips")

    def vip(self, vip: VipRef) -> VipStatus:
        return self._get(VipStatus, "GET", _vip_path(vip))

    def add_vip(self, vip: VipConfig, *, persist: bool = False) -> ChangeResult:
        """ApiError 409 if it exists."""
        return self._get(
            ChangeResult,
            "POST",
            "/api/v1/vips",
            params=self._persist(persist),
            json=vip.model_dump(mode="json"),
        )

    def replace_vip(self, vip: VipConfig, *, persist: bool = False) -> ChangeResult:
        ref = VipRef(address=vip.address, port=vip.port, protocol=vip.protocol)
        return self._get(
            ChangeResult,
            "PUT",
            _vip_path(ref),
            params=self._persist(persist),
            json=vip.model_dump(mode="json"),
        )

    def delete_vip(self, vip: VipRef, *, persist: bool = False) -> ChangeResult:
        return self._get(ChangeResult, "DELETE", _vip_path(vip), params=self._persist(persist))

    def backends(self, vip: VipRef) -> list[BackendStatus]:
        return self._list(BackendStatus, f"{_vip_path(vip)}/backends")

    def put_backend(
        self, vip: VipRef, backend: BackendConfig, *, persist: bool = False
    ) -> ChangeResult:
        """Add the backend, or replace it if the VIP has it."""
        return self._get(
            ChangeResult,
            "PUT",
            _backend_path(vip, backend.address),
            params=self._persist(persist),
            json=backend.model_dump(mode="json"),
        )

    def set_weight(
        self, vip: VipRef, backend: IPAddress, weight: int, *, persist: bool = False
    ) -> ChangeResult:
        return self._get(
            ChangeResult,
            "PATCH",
            _backend_path(vip, backend),
            params=self._persist(persist),
            json={"weight": weight},
        )

    def delete_backend(
        self, vip: VipRef, backend: IPAddress, *, persist: bool = False
    ) -> ChangeResult:
        return self._get(
            ChangeResult, "DELETE", _backend_path(vip, backend), params=self._persist(persist)
        )

    def drain(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        return self._get(DrainStatus, "POST", _backend_path(vip, backend) + "/drain")

    def enable(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        return self._get(DrainStatus, "POST", _backend_path(vip, backend) + "/enable")

    def drain_status(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        return self._get(DrainStatus, "GET", _backend_path(vip, backend) + "/drain")

    def wait_drained(
        self, vip: VipRef, backend: IPAddress, timeout: float, *, interval: float = DRAIN_POLL
    ) -> DrainStatus:
        """Poll the drain status every ``interval`` seconds until ``done`` is True and
        return that status; :class:`DrainTimeout` after ``timeout`` seconds (its
        ``last.done`` is None if no agent reported for the backend meanwhile)."""
        start = time.monotonic()
        while True:
            st = self.drain_status(vip, backend)
            if st.done is True:
                return st
            waited = time.monotonic() - start
            if waited >= timeout:
                raise DrainTimeout(st, waited)
            time.sleep(min(interval, max(0.0, timeout - waited)))

    def acl(self, vip: VipRef | None = None) -> AclView:
        """The global ACL (``vip`` None) or a VIP's, with its hits."""
        return self._get(AclView, "GET", _acl_path(vip))

    def put_acl(
        self, acl: AclConfig, vip: VipRef | None = None, *, persist: bool = False
    ) -> ChangeResult:
        """Replace the global ACL (``vip`` None) or a VIP's."""
        return self._get(
            ChangeResult,
            "PUT",
            _acl_path(vip),
            params=self._persist(persist),
            json=acl.model_dump(mode="json"),
        )

    def metrics(self) -> str:
        """The Prometheus text of /metrics."""
        return self.request("GET", "/metrics").text
