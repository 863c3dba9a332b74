"""The lab: one Ethernet segment in network namespaces, for tests and the demo.

::

    client ─┐                     198.18.0.0/24, fd78:6470:6c62::/64
    lb ─────┤
    (rt) ───┼── br0 (namespace "sw")
    b1..bN ─┘                     VIPs: 198.18.100.0/24, fd78:6470:6c62:100::/64

Each node is a namespace with one veth, ``eth0``, whose peer is a port of the
bridge named after the node. The client routes the VIP prefixes via the LB; the
backends hold the VIPs on their loopback and reply straight to the client (direct
server return). With ``reply_mtu`` a router ``rt`` (.3, ::3) carries the backends'
replies to the client over a path with that smaller MTU, so path MTU discovery
through the balancer can be shown (:meth:`Lab.__init__`). Only 198.18.0.0/15 (RFC
2544 benchmarking) and fd78:6470:6c62::/48 (ULA) are ever configured: a typo cannot
touch a real network.

Every instance has its own prefix (``xl<pid><letter>``, from :mod:`~xdplb.lab.registry`)
on namespace names and bpffs pin directories, so parallel and leftover runs never
collide. Teardown removes every namespace, process and pin the instance made, also on
error (context manager) and at interpreter exit (the registry's atexit);
:func:`~xdplb.lab.registry.cleanup_stale` removes what dead processes left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from xdplb.core import paths
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import LabError
from xdplb.lab import netns, registry

if TYPE_CHECKING:
    from xdplb.cluster.bird import Bird
    from xdplb.lab.host import HostAttachment

LAB_NET4 = ipaddress.IPv4Network("198.18.0.0/15")
LAB_NET6 = ipaddress.IPv6Network("fd78:6470:6c62::/48")
SEGMENT4 = ipaddress.IPv4Network("198.18.0.0/24")
SEGMENT6 = ipaddress.IPv6Network("fd78:6470:6c62::/64")
VIP_NET4 = ipaddress.IPv4Network("198.18.100.0/24")
VIP_NET6 = ipaddress.IPv6Network("fd78:6470:6c62:100::/64")
DEFAULT_VIPS: tuple[IPAddress, ...] = (
    ipaddress.IPv4Address("198.18.100.1"),
    ipaddress.IPv6Address("fd78:6470:6c62:100::1"),
)

#: A GUE-encapsulated packet grows by 20 (IPv4) or 40 (IPv6) + 8 (UDP) + 8 (GUE) + 4 or
#: 16 per hop: 40 bytes (IPv4, one hop) to 72 (IPv6, one hop), up to 120 with four IPv6
#: hops (Beamer). With the client at 1400, a full-size client packet fits the 1500-byte
#: links from the LB to the backends except with IPv6 backends and four hops.
CLIENT_MTU = 1400
LINK_MTU = 1500

#: Host number of each role on the segment (.1, ::1); backends count up from .11. The
#: LB nodes of a cluster lab: ``lb`` (.2), then ``lb2`` .. ``lb8`` (.4 .. .10).
MAX_LBS = 8
_HOST_NUMBERS = {"client": 1, "lb": 2, "rt": 3, **{f"lb{k}": k + 2 for k in range(2, MAX_LBS + 1)}}
#: The smallest MTU an IPv6 link may have (RFC 8200 5): ``reply_mtu`` for IPv6 is at
#: least this, a packet-too-big below it is ignored by the receiver.
IPV6_MIN_MTU = 1280
_FIRST_BACKEND = 11

SWITCH = "sw"
BRIDGE = "br0"
IFNAME = "eth0"


def check_lab_address(addr: IPAddress) -> None:
    """Refuse any address outside the lab's own ranges."""
    net = LAB_NET4 if addr.version == 4 else LAB_NET6
    if addr not in net:
        raise LabError(f"{addr} is outside the lab ranges {LAB_NET4} and {LAB_NET6}")


@dataclasses.dataclass(frozen=True)
class Node:
    """One host of the segment."""

    #: Short name: ``client``, ``lb``, ``b1`` ... (also its bridge port's name).
    name: str
    #: Full network namespace name (``<prefix>-<name>``).
    ns: str
    #: Address on ``eth0`` in 198.18.0.0/24.
    v4: ipaddress.IPv4Address
    #: Address on ``eth0`` in fd78:6470:6c62::/64.
    v6: ipaddress.IPv6Address


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


class Lab:
    """The lab topology. ``with Lab() as lab:`` builds it and always tears it down."""

    def __init__(
        self,
        backends: int = 3,
        vips: Sequence[IPAddress | str] = DEFAULT_VIPS,
        *,
        colocated: bool = False,
        reply_mtu: int | None = None,
        lbs: int = 1,
        router: bool = False,
    ) -> None:
        """``backends``: how many backend hosts (b1..bN, .11, .12, ...). ``vips``: the
        addresses put on every backend's loopback.
        ``colocated``: every backend is also a balancer (Unimog, Nickel): the client
        spreads VIP traffic over the backends by ECMP, and the backends forward like
        the LB does (the ``lb`` node is still there, unused).
        ``reply_mtu``: add a router ``rt`` that the backends route the client through;
        its route to the client has this MTU, locked (IPv6: at least 1280), so a
        full-size reply makes it send "fragmentation needed" / "packet too big" to the
        reply's source, a VIP, which it routes via the LB (as the Internet would).
        ``lbs``: LB nodes (``lb``, ``lb2`` ...; more than one needs ``router``).
        ``router``: ``rt`` runs BIRD (:mod:`xdplb.lab.router`), peers with every LB node
        and routes the VIPs over the ones that announce them (ECMP); the client routes
        the VIPs through it."""
        if not 1 <= backends <= 50:
            raise LabError(f"backends must be 1..50, not {backends}")
        if reply_mtu is not None and not 576 <= reply_mtu < CLIENT_MTU:
            raise LabError(f"reply_mtu must be 576..{CLIENT_MTU - 1}, not {reply_mtu}")
        if reply_mtu is not None and colocated:
            raise LabError("reply_mtu needs the dedicated LB topology (not colocated)")
        if not 1 <= lbs <= MAX_LBS:
            raise LabError(f"lbs must be 1..{MAX_LBS}, not {lbs}")
        if lbs > 1 and not router:
            raise LabError("more than one LB node needs the router (router=True)")
        if router and (reply_mtu is not None or colocated):
            raise LabError("the router lab has neither reply_mtu nor colocated backends")
        self.router = router
        self.reply_mtu = reply_mtu
        self.vips: list[IPAddress] = []
        for v in vips:
            addr = ipaddress.ip_address(v)
            check_lab_address(addr)
            self.vips.append(addr)
        self.colocated = colocated
        self.prefix = registry.new_prefix()
        names = ["client", "lb"] + [f"lb{k}" for k in range(2, lbs + 1)]
        names += ["rt"] if reply_mtu or router else []
        names += [f"b{i}" for i in range(1, backends + 1)]
        self.nodes: dict[str, Node] = {}
        for name in names:
            if name in _HOST_NUMBERS:
                host = _HOST_NUMBERS[name]
            else:
                host = _FIRST_BACKEND + int(name[1:]) - 1
            self.nodes[name] = Node(
                name=name,
                ns=f"{self.prefix}-{name}",
                v4=SEGMENT4.network_address + host,
                # ::11 for host 11, as the address plan reads: hex digits = decimal.
                v6=ipaddress.IPv6Address(f"{SEGMENT6.network_address}{host}"),
            )
        self.backends: list[str] = [n for n in names if n.startswith("b")]
        #: The LB nodes: ``lb``, ``lb2`` ...
        self.lbs: list[str] = [n for n in names if re.fullmatch(r"lb\d*", n)]
        #: The router's BIRD, when ``router`` (started by :meth:`build`).
        self.router_bird: Bird | None = None
        #: host_tc attachments by backend name, filled by :func:`xdplb.lab.host.attach_host`.
        self.hosts: dict[str, HostAttachment] = {}
        self._created_ns: list[str] = []
        self._pin_roots: list[Path] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._closers: list[Callable[[], None]] = []
        self._built = False
        self._torn_down = False

    # -- names and lookups -------------------------------------------------------------

    def ns(self, name: str) -> str:
        """Full namespace name of node ``name`` (``client``, ``lb``, ``b1``, ``sw``)."""
        if name == SWITCH:
            return f"{self.prefix}-{SWITCH}"
        if name in self.nodes:
            return self.nodes[name].ns
        if name.startswith(self.prefix + "-"):
            return name
        raise LabError(f"no node {name!r} in this lab: {sorted(self.nodes)} or {SWITCH!r}")

    def addr(self, name: str, family: int = 4) -> IPAddress:
        """Address of node ``name`` on the segment; ``family`` is 4 or 6."""
        node = self.nodes[name]
        if family == 4:
            return node.v4
        if family == 6:
            return node.v6
        raise LabError(f"family must be 4 or 6, not {family}")

    def pin_root(self, name: str) -> Path:
        """A pin directory for this instance (``/sys/fs/bpf/xdplb/<prefix>-<name>``),
        removed at teardown."""
        path = paths.pin_root(f"{self.prefix}-{name}")  # a plain name, directly under the root
        if path not in self._pin_roots:
            self._pin_roots.append(path)
        return path

    def on_teardown(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` at teardown, before the namespaces go (last registered, first)."""
        self._closers.append(fn)

    # -- running things inside -----------------------------------------------------------

    def run(
        self, ns: str, argv: Sequence[str], check: bool = True, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` to completion in node ``ns``; output captured as text."""
        return netns.run(self.ns(ns), argv, check=check, **kw)

    def popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in node ``ns``; it is killed at teardown if still running."""
        proc = netns.popen(self.ns(ns), argv, **kw)
        self._procs.append(proc)
        return proc

    def start_servers(
        self, *args: str, timeout: float = 5.0, names: Sequence[str] | None = None
    ) -> list[subprocess.Popen[str]]:
        """Start :mod:`xdplb.lab.apps` (servers that say who they are) on every backend
        (or those ``names``), with extra ``args`` (e.g. ``"--udp", "53"``); returns once
        each is listening."""
        procs = []
        names = self.backends if names is None else list(names)
        for name in names:
            argv = [sys.executable, "-m", "xdplb.lab.apps", "--name", name, *args]
            procs.append(self.popen(name, argv, stdout=subprocess.PIPE, text=True))
        for name, proc in zip(names, procs, strict=True):
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            if not ready or proc.stdout.readline().strip() != "ready":
                raise LabError(f"the servers on {name} did not start")
        return procs

    def enter(self, ns: str) -> contextlib.AbstractContextManager[None]:
        """Context manager: this thread is in node ``ns``'s namespace inside the block."""
        return netns.enter(self.ns(ns))

    def ifindex(self, ns: str, ifname: str = IFNAME) -> int:
        with self.enter(ns):
            return socket.if_nametoindex(ifname)

    def mac(self, ns: str, ifname: str = IFNAME) -> str:
        out = _ip("-n", self.ns(ns), "-j", "link", "show", "dev", ifname).stdout
        return str(json.loads(out)[0]["address"])

    # -- building -------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    def build(self) -> None:
        if self._built:
            raise LabError("lab already built")
        self._built = True
        registry.register(self)
        sw = self.ns(SWITCH)
        for ns in [sw] + [n.ns for n in self.nodes.values()]:
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            # No DAD at all, also for link-local addresses (nodad covers only ours): a
            # neighbour solicitation is sent from the link-local address, and none is
            # sent while it is tentative, so the first reply from a VIP would wait for
            # the 1 s retransmit.
            with netns.enter(ns):
                for key in ("all", "default"):
                    Path(f"/proc/sys/net/ipv6/conf/{key}/accept_dad").write_text("0\n")
                    Path(f"/proc/sys/net/ipv6/conf/{key}/dad_transmits").write_text("0\n")
        _ip("-n", sw, "link", "set", "lo", "up")
        # No STP, no forwarding delay, no multicast snooping: ports forward at once and
        # neighbour discovery floods like on a plain switch.
        _ip(
            "-n",
            sw,
            "link",
            "add",
            BRIDGE,
            "type",
            "bridge",
            "stp_state",
            "0",
            "forward_delay",
            "0",
            "mcast_snooping",
            "0",
        )
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        for node in self.nodes.values():
            self._plug(node)
        self._setup_client()
        for name in self.lbs:
            self._setup_forwarding(name)
        for name in self.backends:
            self._setup_backend(self.nodes[name])
        if self.reply_mtu is not None:
            self._setup_reply_router(self.reply_mtu)
        if self.router:
            self._setup_router()

    def _sysctl(self, name: str, settings: dict[str, str | int]) -> None:
        with self.enter(name):
            for key, value in settings.items():
                Path("/proc/sys", key.replace(".", "/")).write_text(f"{value}\n")

    def _plug(self, node: Node) -> None:
        sw = self.ns(SWITCH)
        _ip(
            "-n",
            sw,
            "link",
            "add",
            node.name,
            "type",
            "veth",
            "peer",
            "name",
            IFNAME,
            "netns",
            node.ns,
        )
        _ip("-n", sw, "link", "set", node.name, "master", BRIDGE, "up")
        mtu = CLIENT_MTU if node.name == "client" else LINK_MTU
        _ip("-n", node.ns, "link", "set", "lo", "up")
        _ip("-n", node.ns, "link", "set", IFNAME, "mtu", str(mtu), "up")
        _ip("-n", node.ns, "addr", "add", f"{node.v4}/{SEGMENT4.prefixlen}", "dev", IFNAME)
        _ip("-n", node.ns, "addr", "add", f"{node.v6}/{SEGMENT6.prefixlen}", "dev", IFNAME, "nodad")

    def _setup_client(self) -> None:
        client, lb = self.nodes["client"], self.nodes["lb"]
        if self.colocated:
            # ECMP over the backends, hashed on the 5-tuple as a router would.
            for net, fam in ((VIP_NET4, 4), (VIP_NET6, 6)):
                hops = [
                    arg for b in self.backends for arg in ("nexthop", "via", str(self.addr(b, fam)))
                ]
                _ip("-n", client.ns, "route", "add", str(net), *hops)
            self._sysctl(
                "client",
                {"net.ipv4.fib_multipath_hash_policy": 1, "net.ipv6.fib_multipath_hash_policy": 1},
            )
        else:
            via = self.nodes["rt"] if self.router else lb
            _ip("-n", client.ns, "route", "add", str(VIP_NET4), "via", str(via.v4))
            _ip("-n", client.ns, "route", "add", str(VIP_NET6), "via", str(via.v6))
        # Offloads stay at veth's defaults (checksum offload, TSO on), as on a user's
        # machine: the balancer runs at TC on veth (hook auto), which keeps them.
        self._sysctl(
            "client",
            {
                "net.ipv4.conf.all.accept_redirects": 0,
                "net.ipv6.conf.all.accept_redirects": 0,
                f"net.ipv6.conf.{IFNAME}.accept_redirects": 0,
            },
        )

    def _setup_forwarding(self, name: str) -> None:
        self._sysctl(
            name,
            {
                "net.ipv4.ip_forward": 1,
                "net.ipv6.conf.all.forwarding": 1,
                # Client, LB and backends share one segment: never tell the client to
                # bypass the LB.
                "net.ipv4.conf.all.send_redirects": 0,
                f"net.ipv4.conf.{IFNAME}.send_redirects": 0,
                # A frame lb_xdp encapsulates but hands to the kernel (no neighbour yet)
                # carries the LB's own source address: forward it rather than call it a
                # martian.
                "net.ipv4.conf.all.accept_local": 1,
                f"net.ipv4.conf.{IFNAME}.accept_local": 1,
                "net.ipv4.conf.all.rp_filter": 0,
                f"net.ipv4.conf.{IFNAME}.rp_filter": 0,
            },
        )
        self._clamp_to_client(name)

    def _clamp_to_client(self, name: str) -> None:
        # A veth drops frames larger than its receiving end's MTU, silently: packets to
        # the client must not exceed its 1400 bytes.
        client = self.nodes["client"]
        ns = self.ns(name)
        _ip("-n", ns, "route", "add", f"{client.v4}/32", "dev", IFNAME, "mtu", str(CLIENT_MTU))
        _ip("-n", ns, "route", "add", f"{client.v6}/128", "dev", IFNAME, "mtu", str(CLIENT_MTU))

    def _setup_backend(self, node: Node) -> None:
        for vip in self.vips:
            self._add_vip(node, vip)
        self._sysctl(
            node.name,
            {
                # The decapsulated packet arrives on eth0 for an address on lo, with a
                # client source: strict reverse-path filtering must not judge it.
                "net.ipv4.conf.all.rp_filter": 0,
                "net.ipv4.conf.default.rp_filter": 0,
                f"net.ipv4.conf.{IFNAME}.rp_filter": 0,
                "net.ipv4.conf.lo.rp_filter": 0,
                # Direct server return: every backend holds the VIPs, only the LB may answer
                # ARP for them (and it does not: the client routes VIPs via the LB).
                "net.ipv4.conf.all.arp_ignore": 1,
                "net.ipv4.conf.all.arp_announce": 2,
            },
        )
        # Backends forward too: host_tc passes packets of connections they do not have
        # to the next hop (daisy chaining), and bpf_fib_lookup() refuses unless the
        # device forwards. Co-located, they also balance like the LB.
        self._setup_forwarding(node.name)

    def _setup_reply_router(self, mtu: int) -> None:
        """``rt`` forwards the backends' replies to the client with a locked route MTU
        (forwarding honours a route's MTU, the device's would be 1500), answers bigger
        packets with ICMP to their source, the VIP, via the LB, and never redirects the
        backends: they must keep sending through it."""
        rt, lb, client = self.nodes["rt"], self.nodes["lb"], self.nodes["client"]
        self._sysctl(
            "rt",
            {
                "net.ipv4.ip_forward": 1,
                "net.ipv6.conf.all.forwarding": 1,
                "net.ipv4.conf.all.send_redirects": 0,
                f"net.ipv4.conf.{IFNAME}.send_redirects": 0,
                "net.ipv4.conf.all.rp_filter": 0,
                f"net.ipv4.conf.{IFNAME}.rp_filter": 0,
                # One error per too-big packet: a test's retransmission is not held back
                # by the per-destination token bucket (1 s, burst 6 by default).
                "net.ipv4.icmp_ratelimit": 0,
                "net.ipv6.icmp.ratelimit": 0,
            },
        )
        for net, via in ((VIP_NET4, lb.v4), (VIP_NET6, lb.v6)):
            _ip("-n", rt.ns, "route", "add", str(net), "via", str(via))
        for dst, m in ((f"{client.v4}/32", mtu), (f"{client.v6}/128", max(mtu, IPV6_MIN_MTU))):
            _ip("-n", rt.ns, "route", "add", dst, "dev", IFNAME, "mtu", "lock", str(m))
        # The backends' route to the client goes via rt; its MTU stays the client's and
        # unlocked, so a learnt path MTU can lower it.
        for name in self.backends:
            ns = self.ns(name)
            for dst, via in ((f"{client.v4}/32", rt.v4), (f"{client.v6}/128", rt.v6)):
                route = [dst, "via", str(via), "dev", IFNAME, "mtu", str(CLIENT_MTU)]
                _ip("-n", ns, "route", "replace", *route)

    def _setup_router(self) -> None:
        """``rt`` forwards the VIPs over the LB nodes that announce them, hashing flows on
        their ports, and runs BIRD (its files in a directory removed at teardown)."""
        from xdplb.lab.router import start_router

        self._setup_forwarding("rt")
        self._sysctl(
            "rt",
            {"net.ipv4.fib_multipath_hash_policy": 1, "net.ipv6.fib_multipath_hash_policy": 1},
        )
        directory = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-rt-"))
        self.on_teardown(lambda: shutil.rmtree(directory, ignore_errors=True))
        self.router_bird = start_router(self, directory)

    def _add_vip(self, node: Node, vip: IPAddress) -> None:
        plen = 32 if vip.version == 4 else 128
        extra = ["nodad"] if vip.version == 6 else []
        _ip("-n", node.ns, "addr", "add", f"{vip}/{plen}", "dev", "lo", *extra)

    def add_vip_to_backends(self, addr: IPAddress | str) -> None:
        """Put one more VIP on every backend's loopback."""
        vip = ipaddress.ip_address(addr)
        check_lab_address(vip)
        for name in self.backends:
            self._add_vip(self.nodes[name], vip)
        self.vips.append(vip)

    def peer_xdp(self, node: str) -> Callable[[], None]:
        """Attach xdp_pass to the bridge-side port of ``node``'s veth, so that frames
        ``node`` sends with XDP_TX are delivered (a veth drops them unless the receiving
        peer runs XDP; with GRO on instead, 6.18 did not deliver them either). Returns the
        detach; teardown detaches in any case.

        Only while an XDP program on ``node`` transmits: with a program on the port, veth
        runs every skb through it and takes the node's GSO packets apart on the way (bulk
        TCP of every mode capped at about 2 Gbit/s in ``make bench-hooks``, 8 without).
        """
        from xdplb.datapath import BpfObject, XdpMode, attach_xdp

        obj = BpfObject.load(paths.bpf_object("xdp_pass"))
        try:
            with self.enter(SWITCH):
                link = attach_xdp(
                    obj.program("xdp_pass"), socket.if_nametoindex(node), XdpMode.NATIVE
                )
        except BaseException:
            obj.close()
            raise
        done = False

        def detach() -> None:
            nonlocal done
            if not done:
                done = True
                link.close()
                obj.close()

        self.on_teardown(detach)
        return detach

    # -- teardown ------------------------------------------------------------------------

    def teardown(self) -> None:
        """Kill started processes, run teardown hooks, delete namespaces and pins.

        Every step runs even if an earlier one failed; failures are reported together.
        """
        if self._torn_down:
            return
        self._torn_down = True
        errors: list[str] = []
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        for fn in reversed(self._closers):
            try:
                fn()
            except Exception as exc:
                errors.append(f"teardown hook {fn!r}: {exc}")
        for ns in reversed(self._created_ns):
            try:
                netns.delete(ns)
            except LabError as exc:
                errors.append(str(exc))
        pins = set(self._pin_roots)
        if paths.BPFFS_ROOT.is_dir():
            pins.update(paths.BPFFS_ROOT.glob(f"{self.prefix}-*"))
        for pin in pins:
            try:
                if pin.exists():
                    shutil.rmtree(pin)
            except OSError as exc:
                errors.append(f"rm -r {pin}: {exc}")
        registry.unregister(self)
        if errors:
            raise LabError("lab teardown incomplete: " + "; ".join(errors))

    def leftovers(self) -> list[str]:
        """Namespaces and pins of this instance that still exist (empty after teardown)."""
        left = [
            str(netns.ns_path(n))
            for n in netns.list_namespaces()
            if n.startswith(self.prefix + "-")
        ]
        if paths.BPFFS_ROOT.is_dir():
            left += [str(p) for p in paths.BPFFS_ROOT.glob(f"{self.prefix}-*")]
        return left

    def wait_reachable(self, src: str, dst: str, timeout: float = 5.0) -> None:
        """Ping ``dst``'s segment addresses from ``src`` until both answer."""
        deadline = time.monotonic() + timeout
        for family in (4, 6):
            target = str(self.addr(dst, family))
            while True:
                done = self.run(src, ["ping", "-c1", "-W1", target], check=False)
                if done.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise LabError(f"{src} cannot reach {dst} at {target}")
                time.sleep(0.05)

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"Lab({self.prefix!r}, nodes={sorted(self.nodes)})"
