"""A cluster lab's LB nodes taken out and brought back (docs/cluster.md), and what the
router and the nodes say about it: shared by the cluster tests and
``bench/cluster_bench.py``.

The events (:class:`Event`), each done to one node of ``Lab(lbs=N, router=True)``:

- ``stop``: SIGTERM to its daemon, which withdraws, drains and exits (``xdplb stop``);
- ``kill``: SIGKILL to its daemon; its BIRD gets SIGTERM (PR_SET_PDEATHSIG) and ends its
  sessions with a Cease;
- ``uplink_down``: its bridge port down. The node loses its carrier (its self-check
  fails), the router sees only silence: BFD's detection;
- ``blackhole``: its bridge port disabled. The switch drops every frame to and from the
  node while both ends keep link and carrier: the node sees nothing wrong, only BFD on
  the router notices.

Which node carries a flow is read from the nodes' session tables: the node whose session
of the flow saw its last packet most recently (:func:`carriers`), not guessed from a hash.

What a flow went through: :class:`UdpFlows` (connected UDP sockets whose echoes name the
backend), :class:`Tally` (stayed, moved, broken); long-lived TCP streams are
:class:`~xdplb.lab.paced.PacedStreams` (``wait_resumed``, ``why_broken``).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Any

from xdplb.cluster.store import table_digests
from xdplb.core import abi
from xdplb.core.closing import Closing
from xdplb.core.errors import LabError
from xdplb.datapath.clock import hz, now_ticks
from xdplb.lab.lbnode import LbNode
from xdplb.lab.router import NODE_ASN, ROUTER_ASN, route_nexthops
from xdplb.lab.topology import Lab
from xdplb.lab.traffic import ExchangeError, open_socket
from xdplb.lab.wait import wait_for

#: Long enough for BGP to come up (connect retry 1 s on both sides, error wait 1 s after
#: a session that BFD took down) and a node's hold-down.
ROUTE_WAIT = 20.0
#: A stopped daemon's drain and exit.
STOP_WAIT = 10.0
#: RT_TABLE_MAIN: the routes BIRD's kernel protocol installs.
_MAIN_TABLE = 254


class Event(enum.Enum):
    """How a node leaves the cluster (the module's docstring)."""

    STOP = "stop"
    KILL = "kill"
    UPLINK_DOWN = "uplink_down"
    BLACKHOLE = "blackhole"


def bgp_section(lab: Lab, *, hold_down: float = 0.5, drain: float = 0.5) -> dict[str, Any]:
    """A node's ``bgp`` configuration: both families' sessions to the lab's router."""
    peers = [{"address": str(lab.addr("rt", fam)), "asn": ROUTER_ASN} for fam in (4, 6)]
    return {"asn": NODE_ASN, "peers": peers, "hold_down": hold_down, "drain": drain}


#: The lab's session sync: its port on every LB node and its shared key (lab only).
SYNC_PORT = 7946
SYNC_KEY = "6c61622d73796e632d6b65792d6f662d74686520786470"  # "lab-sync-key-of-the xdp"


def sync_section(lab: Lab, node: str, peers: Iterable[str], **extra: Any) -> dict[str, Any]:
    """A node's ``sync`` configuration: listening on its segment address, the other LB
    nodes ``peers`` as its peers."""
    return {
        "listen": f"{lab.addr(node, 4)}:{SYNC_PORT}",
        "node": node,
        "key": SYNC_KEY,
        "peers": [
            {"node": p, "address": f"{lab.addr(p, 4)}:{SYNC_PORT}"} for p in peers if p != node
        ],
        **extra,
    }


def _family(prefix: str) -> int:
    return 6 if ":" in prefix else 4


def addrs(lab: Lab, names: Iterable[str], fam: int) -> list[str]:
    """The segment addresses of nodes ``names``, sorted: the next hops ``route_nexthops``
    lists when exactly those nodes announce."""
    return sorted(str(lab.addr(n, fam)) for n in names)


def wait_route(
    lab: Lab, prefixes: Sequence[str], names: Iterable[str], what: str, timeout: float = ROUTE_WAIT
) -> float:
    """Seconds until the router's routes to every prefix go through exactly ``names``."""
    names = list(names)
    t0 = time.monotonic()
    for prefix in prefixes:
        want = addrs(lab, names, _family(prefix))
        wait_for(
            lambda prefix=prefix: route_nexthops(lab, prefix),  # type: ignore[misc]
            f"{what} ({prefix})",
            until=lambda got, want=want: got == want,  # type: ignore[misc]
            timeout=timeout,
            interval=0.01,
        )
    return time.monotonic() - t0


class RouteReader(Closing):
    """The router's kernel routes, read over netlink from inside ``rt``: well under a
    millisecond a read where ``ip route`` (:func:`route_nexthops`) takes a few, which
    is what timing a route change needs."""

    def __init__(self, lab: Lab) -> None:
        from pyroute2 import IPRoute

        self.lab = lab
        with lab.enter("rt"):
            self._ipr = IPRoute()  # its socket stays in rt's namespace

    def nexthops(self, prefix: str) -> list[str]:
        """The next hops of the host route ``prefix`` in the main table, sorted."""
        addr = ipaddress.ip_address(prefix)
        fam = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
        out: list[str] = []
        for m in self._ipr.route("dump", family=fam):
            dst = m.get_attr("RTA_DST")
            if (
                dst is None
                or m["dst_len"] != addr.max_prefixlen
                or m.get_attr("RTA_TABLE") != _MAIN_TABLE
                or ipaddress.ip_address(dst) != addr
            ):
                continue
            if gw := m.get_attr("RTA_GATEWAY"):
                out.append(str(ipaddress.ip_address(gw)))
            for nh in m.get_attr("RTA_MULTIPATH") or []:
                if gw := nh.get_attr("RTA_GATEWAY"):
                    out.append(str(ipaddress.ip_address(gw)))
        return sorted(out)

    def wait_out(
        self, prefixes: Sequence[str], name: str, timeout: float = ROUTE_WAIT
    ) -> dict[str, float]:
        """Read the routes to ``prefixes`` back to back until none lists node ``name``;
        time.monotonic() at the end of the first read of each without it (late by at
        most one read)."""
        gone: dict[str, float] = {}
        hop = {p: str(self.lab.addr(name, _family(p))) for p in prefixes}
        deadline = time.monotonic() + timeout
        while True:
            for prefix in prefixes:
                if prefix not in gone and hop[prefix] not in self.nexthops(prefix):
                    gone[prefix] = time.monotonic()
            if len(gone) == len(prefixes):
                return gone
            if time.monotonic() > deadline:
                left = {p: self.nexthops(p) for p in prefixes if p not in gone}
                raise LabError(f"{name} still in the router's routes after {timeout:g} s: {left}")

    def close(self) -> None:
        self._ipr.close()


def take_out(node: LbNode, event: Event) -> float:
    """Do ``event`` to ``node``; time.monotonic() just before the act (a signal sent, the
    ``ip``/``bridge`` command started, which takes a few ms more to act)."""
    lab, port = node.lab, node.node  # the node's bridge port bears its name
    proc = node.proc
    if event in (Event.STOP, Event.KILL) and (proc is None or proc.poll() is not None):
        raise LabError(f"{node.node}: the daemon is not running")
    t0 = time.monotonic()
    if event is Event.STOP:
        assert proc is not None
        proc.send_signal(signal.SIGTERM)
    elif event is Event.KILL:
        assert proc is not None
        proc.kill()
        proc.wait()
    elif event is Event.UPLINK_DOWN:
        lab.run("sw", ["ip", "link", "set", "dev", port, "down"])
    else:
        lab.run("sw", ["bridge", "link", "set", "dev", port, "state", "0"])  # disabled
    return t0


def bring_back(node: LbNode, event: Event) -> None:
    """Undo ``event`` on ``node`` (restart its daemon, its port up or forwarding again);
    the caller waits for the route (:func:`wait_route`)."""
    lab, port = node.lab, node.node
    if event is Event.STOP:
        # It is draining: wait for its exit (a second SIGTERM, as stop_daemon() would send,
        # can land after its loop gave the signal back to the default action).
        proc = node.proc
        assert proc is not None
        try:
            rc = proc.wait(STOP_WAIT)
        except subprocess.TimeoutExpired:
            raise LabError(f"{node.node}: the daemon did not exit after SIGTERM") from None
        if rc != 0:
            raise LabError(f"{node.node}: the daemon exited with {rc}: {node.log_tail()}")
        node.start()
    elif event is Event.KILL:
        node.start()
    elif event is Event.UPLINK_DOWN:
        lab.run("sw", ["ip", "link", "set", "dev", port, "up"])
    else:
        lab.run("sw", ["bridge", "link", "set", "dev", port, "state", "3"])  # forwarding


def flow_key(lab: Lab, vip: str, sport: int, dport: int, proto: int = socket.IPPROTO_TCP) -> bytes:
    """The session table's key of the client's flow ``sport`` -> ``vip``:``dport``."""
    client = lab.addr("client", _family(vip))
    return bytes(abi.FlowKey.make(client, ipaddress.ip_address(vip), sport, dport, proto))


def session_ages(nodes: Sequence[LbNode], keys: Iterable[bytes]) -> dict[bytes, dict[str, float]]:
    """For each flow key, the seconds since each node's session of it saw a packet there
    (the nodes that have none left out, and those whose session only a peer's session
    sync has written: lb_xdp clears SESS_F_IMPORTED when a packet uses it)."""
    want = set(keys)
    out: dict[bytes, dict[str, float]] = {k: {} for k in want}
    per_tick = 1.0 / hz()
    for node in nodes:
        with node.maps() as maps:
            now = now_ticks()
            for e in maps.conns.iter_entries():
                if e.key in want and not e.flags & abi.SESS_F_IMPORTED:
                    age = e.age(now) * per_tick
                    out[e.key][node.node] = min(age, out[e.key].get(node.node, age))
    return out


def carriers(
    nodes: Sequence[LbNode], keys: Iterable[bytes], max_age: float = 1.0
) -> dict[bytes, str | None]:
    """For each flow key, the node whose session of the flow saw a packet last, if that
    was within ``max_age`` seconds (None: no node saw one so recently).

    Sessions count in jiffies (4 ms at HZ=250): when the newest sessions of a flow on
    several nodes saw it in the same tick, the flow was on each of them at its last
    moment (a flow that broke as its route moved: the data went one way, the ACK the
    other), and their names are joined by ``+``, which names no node."""
    out: dict[bytes, str | None] = {}
    for k, ages in session_ages(nodes, keys).items():
        newest = min(ages.values(), default=None)
        if newest is None or newest > max_age:
            out[k] = None
        else:
            out[k] = "+".join(sorted(n for n, age in ages.items() if age == newest))
    return out


def table_differences(nodes: Sequence[LbNode]) -> list[str]:
    """VIPs whose lookup tables (first and later hops, by backend address: the digests a
    node publishes to the fleet's store) are not the same on every node, or that a node
    lacks: empty when every node maps every flow to the same backends."""
    digests = {}
    for node in nodes:
        with node.maps() as maps:
            digests[node.node] = table_digests(node.config, maps.snapshot())
    first, *others = digests
    return [
        f"{vip}: {other}'s table differs from {first}'s"
        for other in others
        for vip in sorted(digests[first].keys() | digests[other].keys())
        if digests[first].get(vip) != digests[other].get(vip)
    ]


class UdpFlows:
    """``n`` connected UDP sockets of the client to ``vip``:``port`` (the lab's UDP echo,
    which answers with its backend's name), one flow each for their whole life; an
    exchange is a datagram and its echo."""

    def __init__(self, lab: Lab, vip: str, n: int, port: int) -> None:
        self.socks = [open_socket(lab.ns("client"), vip, socket.SOCK_DGRAM, None) for _ in range(n)]
        for s in self.socks:
            s.connect((vip, port))
            s.settimeout(0.5)
        self.ports = [int(s.getsockname()[1]) for s in self.socks]

    def exchange(self, i: int, tries: int = 6) -> str:
        """The backend answering flow ``i`` (a lost datagram is sent again)."""
        payload = os.urandom(64)
        for _ in range(tries):
            self.socks[i].send(payload)
            try:
                data = self.socks[i].recv(2048)
            except TimeoutError:
                continue
            name, _, echoed = data.partition(b"\n")
            if echoed != payload:
                raise ExchangeError(f"UDP flow {i}: bad reply {data[:60]!r}")
            return name.decode()
        raise ExchangeError(f"UDP flow {i}: no reply in {tries} tries")

    def backends(self) -> list[str]:
        """The backend answering each flow (``broken: ...`` for one that got no reply)."""
        out = []
        for i in range(len(self.socks)):
            try:
                out.append(self.exchange(i))
            except ExchangeError as e:
                out.append(f"broken: {e}")
        return out

    def close(self) -> None:
        for s in self.socks:
            s.close()


@dataclasses.dataclass
class Tally:
    """The flows of one VIP and protocol through an event: how many stayed on their node
    and how many moved, and which of each broke (why)."""

    stayed: int = 0
    moved: int = 0
    broken_stayed: list[str] = dataclasses.field(default_factory=list)
    broken_moved: list[str] = dataclasses.field(default_factory=list)

    def add(self, moved: bool, broken: str | None) -> None:
        if moved:
            self.moved += 1
        else:
            self.stayed += 1
        if broken is not None:
            (self.broken_moved if moved else self.broken_stayed).append(broken)

    def __str__(self) -> str:
        return (
            f"stayed {self.stayed} (broken {len(self.broken_stayed)}), "
            f"moved {self.moved} (broken {len(self.broken_moved)})"
        )


def log_since(node: LbNode, offset: int) -> str:
    """The node's log from byte ``offset`` on."""
    with node.log_path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
