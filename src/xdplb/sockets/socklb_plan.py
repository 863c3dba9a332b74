"""sock_lb's planner: the maps' contents for a set of services, computed without a kernel.

The datapath (:mod:`xdplb.datapath.sock_lb`) may import only core, so the Maglev tables
are built here, with :mod:`xdplb.tables.maglev` as the XDP tier builds them (same sizes,
same identity-sorted weighting), from the backends that are up; the datapath writes the
resulting :class:`~xdplb.datapath.sock_lb.Plan` as it is.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from xdplb.core.addresses import IPAddress
from xdplb.datapath.sock_lb import (
    MAX_BACKENDS,
    MAX_SERVICES,
    ApplyResult,
    BackendValue,
    Endpoint,
    Plan,
    ServiceKey,
    SockLb,
    SockLbError,
    SvcValue,
    U32Array,
)
from xdplb.tables import maglev

#: Buckets of a service's Maglev table unless told: the XDP tier's default.
DEFAULT_TABLE_SIZE = maglev.DEFAULT_SIZE


@dataclass(frozen=True)
class Backend:
    """One backend of a service."""

    #: Where the connection or datagram goes instead of the service address.
    endpoint: Endpoint
    #: Share of the service's table, relative to the other backends (0: none).
    weight: int = 1
    #: False: health says down: out of the table, and connected UDP sockets reset.
    up: bool = True


@dataclass(frozen=True)
class Service:
    """A service address that clients in the cgroup connect or send to."""

    address: IPAddress
    port: int
    #: socket.IPPROTO_TCP or socket.IPPROTO_UDP.
    proto: int
    backends: tuple[Backend, ...]
    #: Seconds a client (its network namespace) keeps its backend once chosen, counted
    #: from its last connect or send to the service; 0: no affinity.
    affinity_s: float = 0.0
    #: Buckets of its Maglev table: a prime, the XDP tier's default unless told.
    table_size: int = DEFAULT_TABLE_SIZE

    @property
    def key(self) -> ServiceKey:
        return (self.address, self.port, self.proto)


def _lowest_free(used: Iterable[int], start: int, stop: int, what: str) -> int:
    taken = set(used)
    for i in range(start, stop):
        if i not in taken:
            return i
    raise SockLbError(f"no free {what} id: at most {stop - start}")


def check_services(services: Sequence[Service]) -> None:
    """Refuse what the maps cannot hold: duplicate services, backends of another family
    than their service, or one endpoint said up by a service and down by another."""
    seen: set[ServiceKey] = set()
    health: dict[Endpoint, bool] = {}
    for svc in services:
        if svc.key in seen:
            raise SockLbError(f"service {Endpoint(svc.address, svc.port)} proto {svc.proto} twice")
        seen.add(svc.key)
        if svc.proto not in (socket.IPPROTO_TCP, socket.IPPROTO_UDP):
            raise SockLbError(f"service {Endpoint(svc.address, svc.port)}: proto {svc.proto}")
        for b in svc.backends:
            if b.endpoint.address.version != svc.address.version:
                raise SockLbError(
                    f"service {Endpoint(svc.address, svc.port)}: backend {b.endpoint} "
                    "is of another address family"
                )
            if health.setdefault(b.endpoint, b.up) != b.up:
                raise SockLbError(f"backend {b.endpoint} is up in one service, down in another")
    if len(seen) > MAX_SERVICES:
        raise SockLbError(f"{len(seen)} services: at most {MAX_SERVICES}")


def plan(
    services: Sequence[Service],
    current_services: Mapping[ServiceKey, int],
    current_backends: Mapping[Endpoint, tuple[int, bool]],
) -> Plan:
    """The maps' contents for ``services``, given the ids in use now (service key -> id;
    endpoint -> (backend id, up)). Ids are kept for what stays, so tables of unchanged
    services come out identical; new ones take the lowest id free now and not held by
    something this plan removes (backend id 0 is never used: a zeroed slot names
    nothing)."""
    check_services(services)
    backend_ids: dict[Endpoint, int] = {}
    health: dict[Endpoint, bool] = {}
    for svc in services:
        for b in svc.backends:
            health[b.endpoint] = b.up
    for ep in sorted(health, key=Endpoint.order):
        if ep in current_backends:
            backend_ids[ep] = current_backends[ep][0]
    # Ids of what goes away are not reused in the same plan: apply clears them last.
    taken = {i for i, _ in current_backends.values()}
    for ep in sorted(health, key=Endpoint.order):
        if ep not in backend_ids:
            backend_ids[ep] = _lowest_free(taken, 1, MAX_BACKENDS, "backend")
            taken.add(backend_ids[ep])

    svc_ids: dict[ServiceKey, int] = {
        s.key: current_services[s.key] for s in services if s.key in current_services
    }
    out: dict[ServiceKey, tuple[int, SvcValue, U32Array | None]] = {}
    svc_taken = set(current_services.values())
    for svc in services:
        if svc.key not in svc_ids:
            svc_ids[svc.key] = _lowest_free(svc_taken, 0, MAX_SERVICES, "service")
            svc_taken.add(svc_ids[svc.key])
        sid = svc_ids[svc.key]
        weights = {str(b.endpoint): b.weight for b in svc.backends if b.up and b.weight > 0}
        ids = {str(b.endpoint): backend_ids[b.endpoint] for b in svc.backends}
        table = maglev.build(weights, svc.table_size).map_ids(ids) if weights else None
        value = SvcValue(sid, svc.table_size, round(svc.affinity_s * 1e9))
        out[svc.key] = (sid, value, table)

    backends = {backend_ids[ep]: BackendValue.of(ep, up) for ep, up in health.items()}
    removed = frozenset(i for ep, (i, _) in current_backends.items() if ep not in backend_ids)
    was_up = {i for i, up in current_backends.values() if up}
    went_down = frozenset(
        i for i in was_up if i in removed or not backends.get(i, BackendValue()).up
    )
    return Plan(
        services=out,
        backends=backends,
        endpoints={i: ep for ep, i in backend_ids.items()},
        removed_services={k: i for k, i in current_services.items() if k not in out},
        removed_backends=removed,
        went_down=went_down,
    )


def apply(lb: SockLb, services: Sequence[Service]) -> ApplyResult:
    """Make ``lb``'s maps hold exactly ``services``: planned against what they hold now
    (ids kept), then written by :meth:`SockLb.apply`."""
    return lb.apply(plan(services, *lb.current()))
