"""The sock_lb configuration file: services balanced at the socket for one cgroup.

A file of its own, for services that are not the daemon's VIPs (backends on ports of
their own, no XDP tier); the daemon balances its VIPs at the socket with its
configuration's ``socket_lb`` section instead (:mod:`xdplb.daemon.socket_lb`). This file
is what ``xdplb socklb apply`` reads::

    cgroup: /sys/fs/cgroup/clients
    services:
      - address: 10.96.0.10
        port: 80
        protocol: tcp
        affinity_seconds: 0
        backends:
          - {address: 127.0.0.2, port: 8001, weight: 1}
          - {address: 127.0.0.3, port: 8002, weight: 2, up: false}

Validation (pydantic) refuses what the maps could not hold, naming the field, so that
``apply`` either writes the whole state or nothing.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, IPvAnyAddress, ValidationError, model_validator

from xdplb.core.errors import ConfigError
from xdplb.datapath.sock_lb import MAX_BACKENDS, MAX_SERVICES, Endpoint, SockLbError
from xdplb.sockets.socklb_plan import DEFAULT_TABLE_SIZE, Backend, Service, check_services
from xdplb.tables.primes import is_prime

_PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendConfig(_Model):
    """A backend of a service."""

    address: IPvAnyAddress
    """Where connections go instead of the service address: same family as the service."""
    port: int = Field(ge=1, le=65535)
    weight: int = Field(default=1, ge=0, le=0xFFFF)
    """Share of the service's Maglev table relative to its other backends (0: none)."""
    up: bool = True
    """Health: a backend that is down gets no new flow, and the UDP sockets connected
    to it through the service are destroyed when it goes down."""


class ServiceConfig(_Model):
    """A service address that clients of the cgroup connect or send to."""

    address: IPvAnyAddress
    port: int = Field(ge=1, le=65535)
    protocol: Literal["tcp", "udp"]
    backends: list[BackendConfig] = Field(max_length=MAX_BACKENDS - 1)
    affinity_seconds: float = Field(default=0.0, ge=0, le=86400 * 365)
    """A client (its network namespace) keeps its backend as long as it calls the
    service again within this many seconds; 0: every socket is balanced on its own."""
    table_size: int = DEFAULT_TABLE_SIZE
    """Buckets of the Maglev table: a prime, over 100 x the number of backends for
    shares within 1% (the XDP tier's rule and default)."""

    @model_validator(mode="after")
    def _check(self) -> ServiceConfig:
        if not 2 <= self.table_size <= 0xFFFFFFFF or not is_prime(self.table_size):
            raise ValueError(f"table_size must be a prime, got {self.table_size}")
        for i, b in enumerate(self.backends):
            if b.address.version != self.address.version:
                raise ValueError(f"backends[{i}]: {b.address} is not of the service's family")
        return self

    def to_service(self) -> Service:
        return Service(
            address=self.address,
            port=self.port,
            proto=_PROTOCOLS[self.protocol],
            backends=tuple(
                Backend(Endpoint(b.address, b.port), b.weight, b.up) for b in self.backends
            ),
            affinity_s=self.affinity_seconds,
            table_size=self.table_size,
        )


class SockLbConfig(_Model):
    """The whole desired state of one sock_lb instance."""

    cgroup: Path | None = None
    """The cgroup v2 directory ``attach`` hooks into (may be given on the command line)."""
    services: list[ServiceConfig] = Field(default_factory=list, max_length=MAX_SERVICES)

    def to_services(self) -> list[Service]:
        """The datapath's form; ConfigError when services contradict one another (the
        same service twice, a backend up in one and down in another)."""
        out = [s.to_service() for s in self.services]
        try:
            check_services(out)
        except SockLbError as e:
            raise ConfigError("services", str(e)) from None
        return out


def parse(data: object) -> SockLbConfig:
    """Validate a parsed document; ConfigError naming the first bad field."""
    try:
        cfg = SockLbConfig.model_validate(data if data is not None else {})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(where, err["msg"].removeprefix("Value error, ")) from None
    cfg.to_services()
    return cfg


def load(path: Path) -> SockLbConfig:
    """Read and validate a sock_lb YAML file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path} is not valid YAML:\n{e}") from None
    return parse(data)
