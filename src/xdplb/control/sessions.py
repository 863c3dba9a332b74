"""The session table as operators read it: ``xdplb list -c`` and ``GET /api/v1/connections``.

This module owns the listing of ``lb_conns`` entries (one :class:`Connection` per flow:
protocol, client, VIP, backend, and where the entry sits) with its filters
(:class:`ConnectionQuery`: VIP, backend, client prefix), the pages it is served in
(:class:`ConnectionPage`, resumed by a cursor), and the per-(VIP, backend) entry counts
that ``xdplb list`` shows where no agent counts connections. Every walk goes through
:meth:`~xdplb.datapath.conns.ConnTable.iter_entries`, a chunk of sets at a time, and
filters as it goes: nothing here holds the table. The daemon serves it from its maps, the
CLI (``--offline``) from the pins, with the same models.
"""

from __future__ import annotations

import ctypes
import ipaddress
import re
from collections import Counter
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from xdplb.control.status import vip_name
from xdplb.core import abi
from xdplb.core.addresses import IPAddress, IPNetwork
from xdplb.core.errors import ConfigError
from xdplb.core.state import DEFAULT_HZ, Snapshot
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import WAYS, ConnTable, Entry

#: Sets one page scans at most, matches or not: a request stays a few milliseconds.
PAGE_SETS = 8192
#: Entries one page holds at most.
MAX_PAGE = 10000

_PROTOCOLS = {abi.IPPROTO_TCP: "tcp", abi.IPPROTO_UDP: "udp"}


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class Connection(_Out):
    """One entry of the session table: a flow and the backend lb_xdp sends it to."""

    protocol: str
    """``tcp`` or ``udp`` (another number, as text, for an entry no VIP explains)."""
    client: str
    """The client's address (the flow's source)."""
    client_port: int
    vip: str | None
    """The VIP's name (``198.18.100.1:80/tcp``); None: no VIP of the maps has the flow's
    destination any more (the entry outlived it)."""
    destination: str
    """The flow's destination address (the VIP's address)."""
    destination_port: int
    """The flow's destination port (a wildcard VIP's flows have their own)."""
    backend: str | None
    """The backend's address; None: its id is not in ``lb_backends`` any more."""
    backend_id: int
    later_hops: list[str]
    """A Beamer flow met mid-connection: the bucket's later hops it was recorded with,
    in order (daisy chaining). Empty for the rest."""
    state: str
    """``udp``, ``syn`` (only the SYN seen), ``established`` or ``closing`` (the
    client's FIN or RST seen): it picks the session's idle timeout."""
    idle: float
    """Seconds since the flow's last packet (at the session clock's tick)."""
    set: int
    """Where the entry is: its set of ``lb_conns`` and its way in it."""
    way: int


class ConnectionPage(_Out):
    """A page of :class:`Connection` entries, in table order."""

    connections: list[Connection]
    next: int | None
    """Cursor of the next page (``?cursor=``); None: the walk reached the table's end."""
    scanned_sets: int
    """Sets this page read."""
    sets: int
    """Sets of the table."""


class SessionCount(_Out):
    """Entries of the session table of one (VIP, backend)."""

    vip: str
    backend: str
    entries: int


@dataclass(frozen=True)
class ConnectionQuery:
    """The filters of a listing; None matches everything."""

    vip: tuple[IPAddress, int, str] | None = None
    """(address, port, protocol) of the VIP, as its name says it."""
    backend: IPAddress | None = None
    client: IPNetwork | None = None


_VIP = re.compile(
    r"^(?:\[(?P<v6>[^\]]+)\]|(?P<v4>[0-9.]+)):(?P<port>[0-9]{1,5})(?:/(?P<proto>tcp|udp))?$"
)


def parse_query(
    vip: str | None = None, backend: str | None = None, client: str | None = None
) -> ConnectionQuery:
    """The filters as the API's query (and the CLI's options) write them: ``vip`` an
    ``ADDRESS:PORT[/PROTOCOL]`` name, ``backend`` an address, ``client`` a prefix or an
    address. ConfigError names the parameter that does not parse."""
    q_vip = None
    if vip:
        m = _VIP.match(vip)
        try:
            addr = ipaddress.ip_address((m["v6"] or m["v4"]) if m else "")
        except ValueError:
            m = None
        if m is None or (m["v6"] is not None) != (addr.version == 6) or int(m["port"]) > 65535:
            raise ConfigError("vip", f"{vip!r} is not ADDRESS:PORT[/tcp|udp]")
        q_vip = (addr, int(m["port"]), m["proto"] or "tcp")
    q_backend = None
    if backend:
        try:
            q_backend = ipaddress.ip_address(backend.strip("[]"))
        except ValueError:
            raise ConfigError("backend", f"{backend!r} is not an IP address") from None
    q_client = None
    if client:
        try:
            q_client = ipaddress.ip_network(client, strict=False)
        except ValueError:
            raise ConfigError("client", f"{client!r} is not an address or prefix") from None
    return ConnectionQuery(vip=q_vip, backend=q_backend, client=q_client)


class _Vips:
    """The VIPs of a snapshot by the key words a flow key holds."""

    def __init__(self, snap: Snapshot) -> None:
        self.by_key = {(abi.addr_words(v.addr), v.port, v.proto): v.addr for v in snap.vips}
        self.backends = {i: b.addr for i, b in snap.backends.items()}

    def vip_of(self, key: abi.FlowKey) -> tuple[IPAddress | None, int]:
        """The flow's VIP address (None: no VIP) and that VIP's port (0: a wildcard)."""
        words = tuple(key.dst)
        dport = _port(key.dport)
        for port in (dport, 0):
            addr = self.by_key.get((words, port, key.proto))
            if addr is not None:
                return addr, port
        return None, dport


_KEY_SIZE = ctypes.sizeof(abi.FlowKey)


def _flow_key(raw: bytes) -> abi.FlowKey:
    return abi.FlowKey.from_buffer_copy(raw[:_KEY_SIZE])


def _address(words: ctypes.Array[ctypes.c_uint32], v4: bool) -> IPAddress:
    return abi.words_addr(words, abi.Family.V4 if v4 else abi.Family.V6)


def _port(net: int) -> int:
    """A port as the key holds it (network order in a ``__u16``), in host order."""
    return int.from_bytes(net.to_bytes(2, "little"), "big")


_STATES = {
    abi.SessState.UDP: "udp",
    abi.SessState.TCP_SYN: "syn",
    abi.SessState.TCP_EST: "established",
    abi.SessState.TCP_FIN: "closing",
}


def _connection(vips: _Vips, e: Entry, now: int, hz: int) -> Connection:
    key = _flow_key(e.key)
    vip_addr, vip_port = vips.vip_of(key)
    if vip_addr is not None:
        v4 = vip_addr.version == 4
    else:  # no VIP to tell the family: an IPv4 key has 12 zero bytes after its address
        v4 = not any(key.dst[1:]) and not any(key.src[1:])
    proto = _PROTOCOLS.get(key.proto, str(key.proto))
    bid = e.backend_id
    backend = vips.backends.get(bid)
    later = [vips.backends.get(h) for h in e.hops[1:]]
    return Connection(
        protocol=proto,
        client=str(_address(key.src, v4)),
        client_port=_port(key.sport),
        vip=vip_name(vip_addr, vip_port, proto) if vip_addr is not None else None,
        destination=str(_address(key.dst, v4)),
        destination_port=_port(key.dport),
        backend=str(backend) if backend is not None else None,
        backend_id=bid,
        later_hops=[str(h) for h in later if h is not None],
        state=_STATES[e.state],
        idle=round(e.age(now) / hz, 3),
        set=e.set,
        way=e.way,
    )


def matches(c: Connection, q: ConnectionQuery) -> bool:
    if q.vip is not None:
        addr, port, proto = q.vip
        if c.vip != vip_name(addr, port, proto):
            return False
    if q.backend is not None and (
        c.backend is None or ipaddress.ip_address(c.backend) != q.backend
    ):
        return False
    return q.client is None or ipaddress.ip_address(c.client) in q.client


def page(
    table: ConnTable,
    snap: Snapshot,
    query: ConnectionQuery,
    *,
    cursor: int = 0,
    limit: int = 1000,
    max_sets: int = PAGE_SETS,
) -> ConnectionPage:
    """Live sessions matching ``query`` from entry position ``cursor`` (set x ways +
    way) on: at most ``limit`` of them, reading at most ``max_sets`` sets (a page may
    then be empty with a ``next``). ConfigError names a cursor or limit out of range."""
    end = table.sets_count * WAYS
    if not 0 <= cursor <= end:
        raise ConfigError("cursor", f"must be within 0..{end}, got {cursor}")
    if not 1 <= limit <= MAX_PAGE:
        raise ConfigError("limit", f"must be within 1..{MAX_PAGE}, got {limit}")
    vips = _Vips(snap)
    cfg = snap.config
    now = now_ticks()
    first = cursor // WAYS
    stop = min(table.sets_count, first + max_sets)
    out: list[Connection] = []
    for e in table.iter_entries(first, chunk=min(max_sets, 1024)):
        if e.set >= stop:
            break
        pos = e.set * WAYS + e.way
        if pos < cursor or not e.live(cfg.conn_gen, cfg.conn_timeouts, now):
            continue
        c = _connection(vips, e, now, cfg.hz or DEFAULT_HZ)
        if not matches(c, query):
            continue
        out.append(c)
        if len(out) == limit:
            return ConnectionPage(
                connections=out,
                next=pos + 1 if pos + 1 < end else None,
                scanned_sets=e.set - first + 1,
                sets=table.sets_count,
            )
    return ConnectionPage(
        connections=out,
        next=stop * WAYS if stop < table.sets_count else None,
        scanned_sets=stop - first,
        sets=table.sets_count,
    )


def counts(table: ConnTable, snap: Snapshot) -> list[SessionCount]:
    """Live sessions per (VIP, backend) over the whole table, read a chunk at a time
    (the counts are all that is kept)."""
    vips = _Vips(snap)
    cfg = snap.config
    now = now_ticks()
    seen: Counter[tuple[str, str]] = Counter()
    for e in table.iter_entries():
        if not e.live(cfg.conn_gen, cfg.conn_timeouts, now):
            continue
        key = _flow_key(e.key)
        addr, port = vips.vip_of(key)
        backend = vips.backends.get(e.backend_id)
        if addr is None or backend is None:
            continue
        seen[vip_name(addr, port, _PROTOCOLS.get(key.proto, str(key.proto))), str(backend)] += 1
    return [SessionCount(vip=v, backend=b, entries=n) for (v, b), n in sorted(seen.items())]
