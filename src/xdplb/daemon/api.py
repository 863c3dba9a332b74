"""The daemon's HTTP API (FastAPI), its Prometheus metrics and its status page.

Every handler is ``async``, so it runs on the daemon's event loop, never in a thread
pool, and calls the :class:`~xdplb.control.interface.Controller` synchronously: controller calls
are quick and the daemon's state needs no lock.

Changes to VIPs and backends are made here, not in the daemon: take the running
configuration, build the new one (re-validated through :func:`parse_config`, so the
cross-field checks run), and hand it whole to ``ctl.replace_config``. ``persist``
(default false) also writes it to the file; otherwise ``Status.runtime_changes`` says
the running configuration differs from the file.

Errors are all ``{"error": message, "field": dotted path or ""}``:

- 400: malformed path or query (``/vips/not-an-ip/80/tcp``, ``port`` 70000);
- 401: missing or wrong bearer token (with ``WWW-Authenticate: Bearer``);
- 404: unknown VIP, backend or route; 405: method not allowed; 409: the VIP exists, or
  a reload would drop changes made through the API (``?force=true`` applies it);
- 408: the body took longer than ``api.body_timeout``; 413: it is over ``api.max_body_bytes``;
- 422: the body does not validate, or the controller refused the change
  (:class:`~xdplb.core.errors.ConfigError`); ``field`` is the dotted path (``weight``,
  ``backends[1].weight``; a refused configuration names it in the whole configuration,
  ``vips[2].backends[0].address``);
- 500: a bug; logged with its traceback, answered with a generic message.

With a token, every route needs ``Authorization: Bearer <token>``, /metrics included
(Prometheus sends it with ``authorization: {credentials: ...}``), except three that
hold no data of the instance: the status page ``/`` and its ``/static`` files (the
page asks for the token and then calls the API with it), and ``/openapi.json`` (the
same document as the published ``docs/openapi.json``). Without a token, only callers on
this host (unix socket, loopback) are served; any other gets 401.

The token is checked before a byte of the body is read, by :class:`_Gate`, an ASGI
middleware (a FastAPI dependency would run only after the body was read and parsed), and
the body is read there too, up to ``api.max_body_bytes`` (413 beyond: at once when
``Content-Length`` says so, else when the count passes it) within ``api.body_timeout``
(408). Header size, idle connections and concurrent connections are bounded where the
server is configured (:mod:`xdplb.daemon.serving`).

``python -m xdplb.daemon.api --openapi > docs/openapi.json`` writes the specification.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path as FsPath
from typing import Annotated, Any, NamedTuple, NoReturn, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xdplb.config import AclConfig, BackendConfig, Config, VipConfig, parse_config
from xdplb.config import Protocol as L4Protocol
from xdplb.control.interface import (
    AclView,
    ChangeResult,
    Controller,
    DrainStatus,
    ReloadRefused,
    VipRef,
)
from xdplb.control.sessions import MAX_PAGE, ConnectionPage, SessionCount, parse_query
from xdplb.control.status import AclHits, BackendStatus, ClusterStatus, Status, VipStatus
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError
from xdplb.daemon.history import History, HistoryView
from xdplb.daemon.metrics import Metrics

log = logging.getLogger("xdplb.daemon.api")

API_VERSION = "1"
PREFIX = "/api/v1"
#: The status page and its files (written by the web front end).
WEB_DIR = FsPath(__file__).resolve().parent / "web"

T = TypeVar("T")

#: Declares the token in the specification; :class:`_Gate` checks it (auto_error=False:
#: this dependency never answers).
_bearer = HTTPBearer(auto_error=False, description="Required when the daemon is given a token")


class ErrorBody(BaseModel):
    """Every error the API answers."""

    model_config = ConfigDict(frozen=True)

    error: str
    """What went wrong, for a human."""
    field: str
    """Dotted path of the culprit (``backends[1].weight``), empty if none."""


class WeightChange(BaseModel):
    """Body of PATCH .../backends/{backend}."""

    # Strict as the configuration's models: "3", true and 3.0 are not weights.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    weight: Annotated[int, Field(ge=0, le=65535)]


class ApiError(Exception):
    """An answer other than 2xx, raised anywhere in a handler."""

    def __init__(self, status: int, error: str, field: str = "") -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.field = field


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "Malformed path or query"),
        (401, "Missing or wrong bearer token"),
        (404, "Unknown VIP, backend or route"),
        (408, "The body took longer than api.body_timeout"),
        (413, "The body is larger than api.max_body_bytes"),
        (422, "The body does not validate, or the change was refused"),
        (500, "Internal error (logged)"),
    )
}
_CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorBody, "description": "The VIP exists"}
}

# Path parameters: typed in the schema; a value that does not parse is a 400.
AddressP = Annotated[
    IPAddress,
    Path(description="VIP address (IPv4 or IPv6, not bracketed)", examples=["198.18.100.1"]),
]
PortP = Annotated[int, Path(ge=0, le=65535, description="VIP port (0: every port)", examples=[80])]
ProtocolP = Annotated[L4Protocol, Path(description="tcp or udp", examples=["tcp"])]
BackendP = Annotated[
    IPAddress, Path(description="backend address (IPv4 or IPv6)", examples=["198.18.0.11"])
]
PersistQ = Annotated[bool, Query(description="also write the change to the configuration file")]


def _is(text: str, addr: IPAddress) -> bool:
    """Whether an address the status reports (a string) is ``addr``."""
    try:
        return ipaddress.ip_address(text) == addr
    except ValueError:
        return False


async def _vip_ref(address: AddressP, port: PortP, protocol: ProtocolP) -> VipRef:
    """The VIP of a path: a dependency (async: it runs on the loop, not in a thread)."""
    return VipRef(address=address, port=port, protocol=protocol)


#: The VIP named by ``/vips/{address}/{port}/{protocol}`` (three path parameters).
VipP = Annotated[VipRef, Depends(_vip_ref)]


class BackendRef(NamedTuple):
    vip: VipRef
    address: IPAddress


async def _backend_ref(
    address: AddressP, port: PortP, protocol: ProtocolP, backend: BackendP
) -> BackendRef:
    """The backend of a path (its parameters in the path's order, as the spec lists them)."""
    return BackendRef(VipRef(address=address, port=port, protocol=protocol), backend)


#: The backend named by ``.../backends/{backend}`` of a VIP's path.
BackendRefP = Annotated[BackendRef, Depends(_backend_ref)]


def _guard(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call the controller: a refusal becomes a 422, a KeyError a 404, anything else a
    logged 500 (never a traceback to the client)."""
    try:
        return fn(*args, **kwargs)
    except ApiError:
        raise
    except ConfigError as e:
        raise ApiError(422, e.message, e.field) from None
    except KeyError as e:
        raise ApiError(404, str(e.args[0]) if e.args else "not found") from None
    except Exception:
        log.exception("controller call %s failed", getattr(fn, "__name__", fn))
        raise ApiError(500, "internal error (see the daemon's log)") from None


def _vip_index(cfg: Config, ref: VipRef) -> int:
    key = (ref.address, ref.port, ref.protocol)
    for i, vip in enumerate(cfg.vips):
        if vip.key == key:
            return i
    raise ApiError(404, f"no VIP {ref.name}")


def _backend_index(vip: VipConfig, addr: IPAddress) -> int:
    for i, b in enumerate(vip.backends):
        if b.address == addr:
            return i
    raise ApiError(404, f"no backend {addr} in VIP {vip.name}")


def _with_vips(cfg: Config, vips: Sequence[VipConfig]) -> Config:
    """``cfg`` with other VIPs, validated whole (ConfigError: 422 naming the field)."""
    data = cfg.model_dump(mode="json")
    data["vips"] = [v.model_dump(mode="json") for v in vips]
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ApiError(422, e.message, e.field) from None


def _replacing_vip(cfg: Config, i: int, vip: VipConfig) -> Config:
    """``cfg`` with ``vip`` in place of its i-th VIP, validated whole."""
    return _with_vips(cfg, [*cfg.vips[:i], vip, *cfg.vips[i + 1 :]])


def _with_acl(cfg: Config, acl: AclConfig, vip: int | None = None) -> Config:
    """``cfg`` with another global ACL (``vip`` None) or VIP ``vip``'s, validated whole."""
    data = cfg.model_dump(mode="json")
    where = data if vip is None else data["vips"][vip]
    where["acl"] = acl.model_dump(mode="json")
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ApiError(422, e.message, e.field) from None


def _acl_view(acl: AclConfig, scope: str, st: Status) -> AclView:
    hits = next(
        (h for h in st.acl if h.scope == scope),
        AclHits(scope=scope, allow=0, deny=0, default=0),
    )
    return AclView(allow=[str(p) for p in acl.allow], deny=[str(p) for p in acl.deny], hits=hits)


def _with_backends(vip: VipConfig, backends: Sequence[BackendConfig]) -> VipConfig:
    return vip.model_copy(update={"backends": list(backends)})


def _dotted(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.startswith("function-"):
            continue  # pydantic's validator names (union members, wrappers)
        else:
            out += f".{part}" if out else part
    return out


def _validation_error(exc: RequestValidationError) -> ApiError:
    errs = list(exc.errors())
    if not errs:
        return ApiError(422, "invalid request")
    first = errs[0]
    where, *rest = first.get("loc", ("body",))
    field = _dotted(rest)
    sub = getattr(first.get("ctx", {}).get("error"), "field", None)
    if isinstance(sub, str):  # a model-level check names its field (config.checks.FieldError)
        field = f"{field}.{sub}" if field else sub
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        msg, field = "the body is not valid JSON", ""  # its loc is the offset
    if len(errs) > 1:
        msg += f" (and {len(errs) - 1} more)"
    # The URL (path, query, headers) is malformed: 400; the entity is: 422.
    return ApiError(422 if where == "body" else 400, msg, field)


def _allowed(request: Request, routes: Sequence[BaseRoute]) -> str:
    """Every method of the path. Starlette names only the first route's; GET and PUT of
    one path are two routes."""
    methods: set[str] = set()
    for route in routes:
        if isinstance(route, APIRoute) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


def _error_response(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    if e.status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    body = ErrorBody(error=e.error, field=e.field).model_dump()
    return JSONResponse(body, status_code=e.status, headers=headers)


def _local_peer(client: tuple[str, int] | None) -> bool:
    """The caller (``scope["client"]``) is on this host: a unix socket (no address) or a
    loopback address."""
    if client is None or not client[0]:
        return True
    try:
        return ipaddress.ip_address(client[0].split("%")[0]).is_loopback
    except ValueError:
        return False  # a name, or a proxy's idea of one: not provably local


#: Bytes of a body per VIP and per ACL prefix the ``limits`` allow, for the default of
#: ``api.max_body_bytes``: twice what a configuration of 64 backends per VIP, each VIP
#: with a health check, and every ACL prefix takes as ``GET /config`` answers it.
BODY_PER_VIP = 8 * 1024
BODY_PER_ACL_RULE = 64


def body_limit(cfg: Config) -> int:
    """The largest body the API reads: ``api.max_body_bytes``, or what the largest
    sensible configuration at ``cfg.limits`` takes (6 MiB at the default limits)."""
    if cfg.api.max_body_bytes is not None:
        return cfg.api.max_body_bytes
    lim = cfg.limits
    return max(1 << 20, lim.vips * BODY_PER_VIP + 2 * lim.acl_rules * BODY_PER_ACL_RULE)


def _public(path: str) -> bool:
    """What is served without the token: it holds no data of the instance."""
    return path in ("/", "/openapi.json", "/static") or path.startswith("/static/")


class _Gate:
    """The token, then the body, before the application sees the request: a caller
    without the token gets its 401 before a byte of its body is read, and a body is read
    whole here (into memory, as FastAPI would), bounded in size and time, then replayed."""

    def __init__(self, app: ASGIApp, *, token: bytes | None, config: Callable[[], Config]) -> None:
        self.app = app
        self.token = token
        #: The running configuration: its api section and limits bound the body.
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _public(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
        refusal = self._refusal(scope, headers)
        if refusal is None and has_body:
            refusal, receive = await self._read_body(headers, receive)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        # The rest of a refused body is not worth reading: the connection ends.
        response = _error_response(refusal, {"Connection": "close"} if has_body else None)
        await response(scope, receive, send)

    def _refusal(self, scope: Scope, headers: Headers) -> ApiError | None:
        if self.token is None:
            # No token: the configuration only allows that on a unix socket or a
            # loopback address; a call from anywhere else (a listener the operator
            # forwarded, a proxy) is refused all the same.
            if _local_peer(scope.get("client")):
                return None
            return ApiError(401, "a bearer token is required for calls from other hosts")
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials:
            return ApiError(401, "a bearer token is required")
        if not hmac.compare_digest(credentials.encode(), self.token):
            return ApiError(401, "wrong bearer token")
        return None

    async def _read_body(
        self, headers: Headers, receive: Receive
    ) -> tuple[ApiError | None, Receive]:
        cfg = self.config()
        limit, timeout = body_limit(cfg), cfg.api.body_timeout
        too_big = ApiError(413, f"the body is larger than {limit} bytes (api.max_body_bytes)")
        # uvicorn's h11 refuses a Content-Length that is not a number; another server, or
        # an ASGI client, may pass one through.
        declared = headers.get("content-length", "0").strip()
        if not declared.isdigit():
            return ApiError(400, f"Content-Length {declared!r} is not a number"), receive
        if int(declared) > limit:
            return too_big, receive
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away
                        return ApiError(400, "the connection closed before the body"), receive
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        return too_big, receive
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return ApiError(408, f"the body took over {timeout:g} s (api.body_timeout)"), receive
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return None, replay


def create_app(
    ctl: Controller,
    *,
    token: str | None = None,
    metrics: Metrics | None = None,
    history: History | None = None,
) -> FastAPI:
    """The API of ``ctl``. ``token``: the bearer token every data route requires (None:
    no authentication, for a unix socket only root can reach); ``history``: the rates the
    daemon samples (None: an empty one)."""
    metrics = metrics if metrics is not None else Metrics(ctl)
    history = history if history is not None else History()

    app = FastAPI(
        title="xdplb",
        version=API_VERSION,
        summary="The daemon of an xdplb instance: status, configuration, drain, metrics.",
        docs_url=None,
        redoc_url=None,
        responses=_ERRORS,
    )

    app.add_middleware(
        _Gate, token=token.encode() if token is not None else None, config=ctl.config
    )
    api = APIRouter(prefix=PREFIX, dependencies=[Security(_bearer)])

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # The router's own list: the app's holds it as one opaque entry.
            headers["Allow"] = _allowed(request, [*api.routes, *app.router.routes])
        return _error_response(ApiError(exc.status_code, str(exc.detail)), headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error_response(ApiError(500, "internal error (see the daemon's log)"))

    def vip_config(ref: VipRef) -> tuple[Config, int]:
        cfg = _guard(ctl.config)
        return cfg, _vip_index(cfg, ref)

    def change(cfg: Config, persist: bool) -> ChangeResult:
        return _guard(ctl.replace_config, cfg, persist=persist)

    @api.get("/status", summary="Everything the daemon knows: VIPs, backends, counters")
    async def get_status() -> Status:
        return _guard(ctl.status)

    @api.get(
        "/cluster",
        summary="The node in its cluster: BGP, the fleet's store, session sync",
        responses={404: {"model": ErrorBody, "description": "No bgp, cluster or sync section"}},
    )
    async def get_cluster() -> ClusterStatus:
        view = _guard(ctl.cluster)
        if view is None:
            raise ApiError(
                404,
                "this node is in no cluster: its configuration has no bgp, cluster or sync section",
            )
        return view

    @api.get("/history", summary="Per-second rates of every VIP and backend, last minute")
    async def get_history(
        since: Annotated[
            float | None,
            Query(allow_inf_nan=False, description="only intervals ending after this time"),
        ] = None,
    ) -> HistoryView:
        return history.view(since)

    @api.get("/config", summary="The running configuration, API changes included")
    async def get_config() -> Config:
        return _guard(ctl.config)

    @api.put("/config", summary="Replace the whole configuration atomically")
    async def put_config(cfg: Config, persist: PersistQ = False) -> ChangeResult:
        return change(cfg, persist)

    @api.post(
        "/reload",
        summary="Re-read the configuration file (409 if it drops unpersisted changes)",
        responses={409: {"model": ErrorBody, "description": "It would drop API changes"}},
    )
    async def reload(
        force: Annotated[
            bool, Query(description="apply the file even if it drops changes")
        ] = False,
    ) -> ChangeResult:
        def reload_or_refuse() -> ChangeResult:
            try:
                return ctl.reload(force=force)
            except ReloadRefused as e:
                raise ApiError(409, str(e)) from None

        return _guard(reload_or_refuse)

    @api.get("/vips", summary="Every VIP with its backends")
    async def list_vips() -> list[VipStatus]:
        return _guard(ctl.status).vips

    @api.post("/vips", status_code=201, responses=_CONFLICT, summary="Add a VIP")
    async def add_vip(vip: VipConfig, persist: PersistQ = False) -> ChangeResult:
        cfg = _guard(ctl.config)
        if any(v.key == vip.key for v in cfg.vips):
            raise ApiError(409, f"VIP {vip.name} exists (PUT replaces it)", "address")
        return change(_with_vips(cfg, [*cfg.vips, vip]), persist)

    vip_path = "/vips/{address}/{port}/{protocol}"

    def vip_status(ref: VipRef) -> VipStatus:
        for v in _guard(ctl.status).vips:
            if _is(v.address, ref.address) and (v.port, v.protocol) == (ref.port, ref.protocol):
                return v
        raise ApiError(404, f"no VIP {ref.name}")

    @api.get(vip_path, summary="One VIP with its backends")
    async def get_vip(ref: VipP) -> VipStatus:
        return vip_status(ref)

    @api.put(vip_path, summary="Replace a VIP (its address, port and protocol stay)")
    async def put_vip(ref: VipP, vip: VipConfig, persist: PersistQ = False) -> ChangeResult:
        for field, want, got in (
            ("address", ref.address, vip.address),
            ("port", ref.port, vip.port),
            ("protocol", ref.protocol, vip.protocol),
        ):
            if want != got:
                raise ApiError(422, f"is {got}, the path says {want}", field)
        cfg, i = vip_config(ref)
        return change(_replacing_vip(cfg, i, vip), persist)

    @api.delete(vip_path, summary="Remove a VIP")
    async def delete_vip(ref: VipP, persist: PersistQ = False) -> ChangeResult:
        cfg, i = vip_config(ref)
        return change(_with_vips(cfg, [*cfg.vips[:i], *cfg.vips[i + 1 :]]), persist)

    @api.get(vip_path + "/backends", summary="The backends of a VIP")
    async def list_backends(ref: VipP) -> list[BackendStatus]:
        return vip_status(ref).backends

    be_path = vip_path + "/backends/{backend}"

    @api.get(be_path, summary="One backend of a VIP")
    async def get_backend(be: BackendRefP) -> BackendStatus:
        for b in vip_status(be.vip).backends:
            if _is(b.address, be.address):
                return b
        raise ApiError(404, f"no backend {be.address} in VIP {be.vip.name}")

    def with_backend(be: BackendRef, body: BackendConfig | None, persist: bool) -> ChangeResult:
        """``be``'s VIP with ``body`` in its place (appended if the VIP has no such
        backend; None: removed), validated whole and applied."""
        cfg, i = vip_config(be.vip)
        vip = cfg.vips[i]
        bes = list(vip.backends)
        j = next((j for j, b in enumerate(bes) if b.address == be.address), None)
        if body is None:
            del bes[_backend_index(vip, be.address)]
        elif j is None:
            bes.append(body)
        else:
            bes[j] = body
        return change(_replacing_vip(cfg, i, _with_backends(vip, bes)), persist)

    @api.put(be_path, summary="Add or replace a backend of a VIP")
    async def put_backend(
        be: BackendRefP, body: BackendConfig, persist: PersistQ = False
    ) -> ChangeResult:
        if body.address != be.address:
            raise ApiError(422, f"is {body.address}, the path says {be.address}", "address")
        return with_backend(be, body, persist)

    @api.patch(be_path, summary="Change a backend's weight")
    async def patch_backend(
        be: BackendRefP, body: WeightChange, persist: PersistQ = False
    ) -> ChangeResult:
        cfg, i = vip_config(be.vip)
        old = cfg.vips[i].backends[_backend_index(cfg.vips[i], be.address)]
        return with_backend(be, old.model_copy(update={"weight": body.weight}), persist)

    @api.delete(be_path, summary="Remove a backend from a VIP (no drain: see /drain)")
    async def delete_backend(be: BackendRefP, persist: PersistQ = False) -> ChangeResult:
        return with_backend(be, None, persist)

    def drain_target(be: BackendRef) -> BackendRef:
        """``be``, once the running configuration is known to have it (else 404)."""
        cfg, i = vip_config(be.vip)
        _backend_index(cfg.vips[i], be.address)
        return be

    @api.post(be_path + "/drain", summary="No new connections to the backend for this VIP")
    async def drain(be: BackendRefP) -> DrainStatus:
        return _guard(ctl.drain, *drain_target(be))

    @api.post(be_path + "/enable", summary="Undo a drain")
    async def enable(be: BackendRefP) -> DrainStatus:
        return _guard(ctl.enable, *drain_target(be))

    @api.get(be_path + "/drain", summary="How a drain is going")
    async def drain_status(be: BackendRefP) -> DrainStatus:
        return _guard(ctl.drain_status, *drain_target(be))

    @api.get("/acl", summary="The global source ACL (every VIP address) and its hits")
    async def get_acl() -> AclView:
        return _acl_view(_guard(ctl.config).acl, "global", _guard(ctl.status))

    @api.put("/acl", summary="Replace the global source ACL (live; tables are kept)")
    async def put_acl(acl: AclConfig, persist: PersistQ = False) -> ChangeResult:
        return change(_with_acl(_guard(ctl.config), acl), persist)

    @api.get(vip_path + "/acl", summary="A VIP's own source ACL and its hits")
    async def get_vip_acl(ref: VipP) -> AclView:
        cfg, i = vip_config(ref)
        return _acl_view(cfg.vips[i].acl, ref.name, _guard(ctl.status))

    @api.put(vip_path + "/acl", summary="Replace a VIP's own source ACL (live)")
    async def put_vip_acl(ref: VipP, acl: AclConfig, persist: PersistQ = False) -> ChangeResult:
        cfg, i = vip_config(ref)
        return change(_with_acl(cfg, acl, i), persist)

    @api.get("/connections", summary="A page of the session table, filtered (xdplb list -c)")
    async def list_connections(
        vip: Annotated[str | None, Query(description="ADDRESS:PORT[/PROTOCOL]")] = None,
        backend: Annotated[str | None, Query(description="backend address")] = None,
        client: Annotated[str | None, Query(description="client address or prefix")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
        cursor: Annotated[int, Query(ge=0, description="`next` of the previous page")] = 0,
    ) -> ConnectionPage:
        def read() -> ConnectionPage:
            try:
                return ctl.connections(
                    parse_query(vip, backend, client), cursor=cursor, limit=limit
                )
            except ConfigError as e:  # a parameter out of range: the request's fault
                raise ApiError(400, e.message, e.field) from None

        return _guard(read)

    @api.get("/connections/counts", summary="Session-table entries per VIP and backend")
    async def connection_counts() -> list[SessionCount]:
        return _guard(ctl.session_counts)

    app.include_router(api)

    @app.get(
        "/metrics",
        dependencies=[Security(_bearer)],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}},
        summary="Prometheus metrics",
    )
    async def get_metrics() -> Response:
        body = _guard(metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = WEB_DIR / "index.html"
        if not page.is_file():
            raise ApiError(404, "the status page is not installed")
        return FileResponse(page, media_type="text/html")

    app.mount("/static", StaticFiles(directory=WEB_DIR, check_dir=False), name="static")
    return app


class _NoController:
    """Stands in for the daemon when only the specification is wanted."""

    def _absent(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError("no controller: this app only serves its specification")

    status = cluster = config = replace_config = reload = drain = enable = drain_status = _absent
    connections = session_counts = _absent


def openapi_spec() -> dict[str, Any]:
    """The API's OpenAPI document (what ``/openapi.json`` serves)."""
    return create_app(_NoController()).openapi()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args != ["--openapi"]:
        print("usage: python -m xdplb.daemon.api --openapi > docs/openapi.json", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(openapi_spec(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
