"""Health-check settings: pydantic models, in the format Bilibili's Nickel uses.

A VIP's ``health_check`` section reads, for example::

    {"checker": {"http": {"scheme": "http", "uri": "/", "check_port": 9080, "codes": [200]}},
     "fall_count": 2, "interval_ms": 2000, "rise_count": 2}

``checker`` names exactly one kind of check (tcp, http, udp, command); the counts give the
hysteresis (keepalived's and HAProxy's ``rise``/``fall``). Every model is frozen, so a
check's settings compare by value: the monitor keeps the state of a target whose settings
did not change across a reload.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

Port = Annotated[int, Field(ge=1, le=65535)]
StatusCode = Annotated[int, Field(ge=100, le=599)]


class _Model(BaseModel):
    # Strict as xdplb.config.schema's models; a tuple field reads a list (strict=False).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TcpCheck(_Model):
    """Up when a TCP connection is established (then closed at once)."""

    check_port: Port | None = None
    """Port to connect to; None: the VIP's own port."""


class HttpCheck(_Model):
    """Up when one HTTP request gets an expected status (and body, if asked)."""

    scheme: Literal["http", "https"] = "http"
    uri: Annotated[str, Field(min_length=1, pattern=r"^/[^\s]*$")] = "/"
    """Path and query; must start with ``/`` and hold no whitespace."""
    method: Literal["GET", "HEAD", "POST", "OPTIONS"] = "GET"
    codes: Annotated[tuple[StatusCode, ...], Field(strict=False, fail_fast=True)] = (200,)
    """Statuses that count as up (a YAML list; a tuple here, so that settings hash)."""
    body: Annotated[str, Field(min_length=1)] | None = None
    """A substring the response body must contain; None: the body is not read."""
    check_port: Port | None = None
    """None: the VIP's own port."""
    host: Annotated[str, Field(min_length=1, pattern=r"^[^\s/]+$")] | None = None
    """Host header (and TLS server name); None: the address connected to."""
    verify_tls: bool = False
    """Check the server's certificate (https); off by default, as backends seldom have
    certificates for their own addresses."""

    @field_validator("codes")
    @classmethod
    def _some_codes(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("must name at least one status code")
        return v


class UdpCheck(_Model):
    """Up when one datagram sent gets a reply (containing ``expect``, if given)."""

    check_port: Port | None = None
    """None: the VIP's own port."""
    payload: Annotated[str, Field(max_length=1400)] = "xdplb-health"
    """Sent as UTF-8; at most 1400 characters so that it fits in one packet."""
    expect: Annotated[str, Field(min_length=1)] | None = None
    """A substring the reply must contain; None: any reply counts."""


class CommandCheck(_Model):
    """Up when a command exits with status 0 within the timeout. It runs with
    XDPLB_BACKEND, XDPLB_ADDRESS, XDPLB_PORT and XDPLB_VIP in its environment."""

    command: Annotated[
        tuple[Annotated[str, Field(min_length=1)], ...],
        Field(min_length=1, strict=False, fail_fast=True),
    ]
    """argv (no shell): the program, then its arguments."""


CHECK_KINDS = ("tcp", "http", "udp", "command")


class CheckerConfig(_Model):
    """Exactly one of the four kinds of check."""

    tcp: TcpCheck | None = None
    http: HttpCheck | None = None
    udp: UdpCheck | None = None
    command: CommandCheck | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> CheckerConfig:
        given = [k for k in CHECK_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise ValueError(f"give exactly one of tcp, http, udp, command (got {got})")
        return self

    @property
    def kind(self) -> Literal["tcp", "http", "udp", "command"]:
        """Which check this is."""
        if self.tcp is not None:
            return "tcp"
        if self.http is not None:
            return "http"
        if self.udp is not None:
            return "udp"
        return "command"

    @property
    def check_port(self) -> int | None:
        """The port the check asks for (None: the VIP's; always None for a command)."""
        spec = self.tcp or self.http or self.udp
        return spec.check_port if spec is not None else None


class HealthCheckConfig(_Model):
    """How and how often one VIP's backends are checked."""

    checker: CheckerConfig
    interval_ms: Annotated[int, Field(ge=50, le=3_600_000)] = 2000
    """Time between two checks of one backend (before jitter)."""
    timeout_ms: Annotated[int, Field(ge=10)] = 1000
    """A check that has not succeeded by then has failed; at most ``interval_ms``."""
    rise_count: Annotated[int, Field(ge=1, le=100)] = 2
    """Consecutive successes that bring a down backend up."""
    fall_count: Annotated[int, Field(ge=1, le=100)] = 2
    """Consecutive failures that take an up backend down."""
    jitter: Annotated[float, Field(ge=0.0, le=0.5)] = 0.1
    """Each interval is ``interval * (1 ± jitter * U)``, U uniform in [0, 1], so that the
    checks of many backends do not fall into step."""
    via: Literal["tunnel", "direct"] = "tunnel"
    """tunnel: connect to the VIP with a firewall mark, so that the LB's TC program
    encapsulates the check to the backend like client traffic (this checks the tunnel and
    the backend's decapsulation too); direct: connect to the backend's own address."""

    @field_validator("timeout_ms")
    @classmethod
    def _timeout_within_interval(cls, v: int, info: ValidationInfo) -> int:
        # interval_ms is declared first, so it is in info.data when it was valid.
        interval = info.data.get("interval_ms")
        if interval is not None and v > interval:
            raise ValueError(f"must not be above interval_ms ({interval}), got {v}")
        return v
