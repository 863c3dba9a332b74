"""Health checks that travel the way real traffic does: through the tunnel, to the VIP.

A check that connects to a backend's own address proves little: a backend whose
decapsulation is broken (host_tc detached, GUE port wrong, VIP missing on lo) still
answers it. So, as Katran does, the checker connects to the *VIP* with a firewall mark on
its socket (``SO_MARK = mark_for(i)``), and the packet goes where lb_xdp would send it:

- a policy rule ``fwmark HC_MARK_BASE/HC_MARK_MASK lookup <table>`` (IPv4 and IPv6) sends
  marked traffic to a table whose default routes are ``dev xhc-<hash> src <tunnel
  source>``, so the inner source is the LB's tunnel address;
- ``xhc-<hash>`` is an ``ifb`` device (the kernels here have no ``dummy`` driver; ifb is
  the in-tree device that, like dummy, is NOARP and drops whatever the stack makes it
  transmit); ``hc_tc`` (bpf/hc_tc.bpf.c) runs at its clsact egress, looks the mark up in
  ``hc_targets``, puts on the outer headers lb_xdp would write, and redirects the result
  to the next hop from ``bpf_fib_lookup``;
- the backend's host_tc decapsulates, its server answers from the VIP straight to the
  tunnel source, and lb_xdp passes that reply (not addressed to a VIP) to the socket.

Checksums and GSO (measured here, kernel 6.18): TCP hands the device GSO packets with
CHECKSUM_PARTIAL whatever its features say (with every ``tx-*`` offload off, a 100 kB
request still reached hc_tc as 64 kB packets), and hc_tc runs before the device would
segment or checksum them. So hc_tc does not count on complete packets: it encapsulates
with ``bpf_skb_adjust_room``'s ENCAP flags, which record the inner headers and mark the
skb encapsulated, and the real egress device (or the kernel's software fallback) then
segments and checksums the *inner* packet; a GSO packet is checked against the MTU by
segment, not by length. The device's ``tx-*`` offloads are off all the same: UDP then
computes its checksum itself, and nothing relies on the NIC's checksum offload for
tunnelled packets. The device's MTU is :data:`HC_MTU`, so that a segment plus the
largest tunnel overhead (72 bytes, GUE over IPv6) fits a 1500-byte path. Forwarding is
on for the device (hc_tc's route lookup is an input-style one from it); its IPv6
link-local address is not generated, so it sends nothing of its own.

What a real deployment needs besides (nothing here changes host-wide sysctls):

- Replies arrive on the LB's real interface with a VIP as source. Strict reverse-path
  filtering (``net.ipv4.conf.<if>.rp_filter = 1``) drops them unless the route back to
  the VIP leaves through that interface (a default route on it will do); loose mode
  (``2``) needs any route to the VIP, ``0`` none. ``src_valid_mark`` does not help: the
  reply itself carries no mark. IPv6 has no rp_filter (beware an ``rpfilter`` rule in
  nftables).
- The LB must not hold the VIP on a local interface (the reply's source would be a
  martian) and must forward IP (lb_xdp's own route lookups need it anyway).
- One mark range per network namespace: two instances in one namespace would share the
  rule, so a second one is refused.
- Co-located (the backend is this very host): not tunnelled, counted as ``drop_self``.

Cleanup: :meth:`HealthTunnel.close` closes descriptors only; the device, its TC filter
(which holds the program), the rules, the routes and the pinned maps stay, and the next
:class:`HealthTunnel` of the same instance reuses all of them (a daemon restart keeps
checks running). :func:`destroy_health_tunnel` removes all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.core.closing import Closing
from xdplb.core.errors import XdplbError
from xdplb.datapath import layout
from xdplb.datapath.links import tc_attach
from xdplb.datapath.maps import Map
from xdplb.datapath.objects import BpfObject, PinnedSizeError

#: Marks of health-check sockets: ``HC_MARK_BASE | index``, index in the low 16 bits.
HC_MARK_BASE = 0x58430000  # "XC"
HC_MARK_MASK = 0xFFFF0000
#: Highest target index a mark can carry.
HC_MAX_INDEX = ~HC_MARK_MASK & 0xFFFFFFFF
#: Priority of the fwmark rules: ahead of ``main`` (32766), behind ``local`` (0).
HC_RULE_PRIORITY = 100
#: Routing tables are ``HC_TABLE_BASE`` + 16 bits of the instance's hash.
HC_TABLE_BASE = 0x58430000
#: MTU of the device: a probe plus the largest tunnel overhead (72) fits 1500 bytes.
HC_MTU = 1400
#: Device names: this prefix + 8 hex digits of the instance's hash (12 <= IFNAMSIZ - 1).
HC_IFNAME_PREFIX = "xhc-"
MAP_NAMES = ("hc_targets", "hc_config", "hc_events")

_ZERO = struct.pack("<I", 0)
_IFB = "ifb"
#: Features that must read back off (the ``tx-*`` ones turned off also cover the rest).
_MUST_BE_OFF = (
    "tx-checksum-ip-generic",
    "tx-scatter-gather",
    "tx-generic-segmentation",
    "tx-tcp-segmentation",
    "tx-tcp6-segmentation",
)


class HealthTunnelError(XdplbError):
    """The health-check tunnel could not be set up as asked."""


class HcTarget(NamedTuple):
    """Where the packets of one mark go: a backend, the VIP's encapsulation and, for a
    VIP that hashes on the source only, ``src_hash`` (the GUE source port is then the one
    lb_xdp would pick for that VIP)."""

    address: IPAddress
    encap: abi.Encap
    src_hash: bool = False


def _digest(instance: str) -> bytes:
    return hashlib.sha256(instance.encode()).digest()


def ifname_for(instance: str) -> str:
    """The device of an instance: ``xhc-`` + 8 hex digits of its hash."""
    return HC_IFNAME_PREFIX + _digest(instance)[:4].hex()


def table_for(instance: str) -> int:
    """The routing table of an instance (never 0 or one of the reserved 253..255)."""
    return HC_TABLE_BASE + int.from_bytes(_digest(instance)[4:6], "big")


def pin_dir(instance: str, version: int | None = None) -> Path:
    """Where hc_tc's maps are pinned: ``hc`` in the directory of lb_xdp's layout
    ``version`` (default: this xdplb's), so that an upgrade replaces them with lb_xdp's."""
    v = layout.current_version() if version is None else version
    return paths.layout_dir(instance, v) / "hc"


def _check_mark(mark: int) -> None:
    if mark & HC_MARK_MASK != HC_MARK_BASE:
        raise ValueError(
            f"mark {mark:#x} is outside {HC_MARK_BASE:#x}/{HC_MARK_MASK:#x}: "
            "the policy rule would not send it to the tunnel"
        )


def _write_sysctl(key: str, value: int) -> None:
    # /proc/sys/net is the calling thread's network namespace.
    Path("/proc/sys", key.replace(".", "/")).write_text(f"{value}\n")


def _iproute() -> Any:
    from pyroute2 import IPRoute

    return IPRoute()


def _hc_rules(ipr: Any, family: int) -> Iterator[Any]:
    """The rules of ``family`` that match exactly our mark range."""
    for rule in ipr.get_rules(family=family):
        if (
            rule.get_attr("FRA_FWMARK") == HC_MARK_BASE
            and rule.get_attr("FRA_FWMASK") == HC_MARK_MASK
        ):
            yield rule


def _rule_table(rule: Any) -> int:
    table = rule.get_attr("FRA_TABLE")
    return int(table if table is not None else rule["table"])


def _disable_offloads(ifname: str) -> None:
    """``ethtool -K <ifname>`` every ``tx-*`` feature off, through the ioctl (pyroute2)."""
    from pyroute2.ethtool import Ethtool

    eth = Ethtool()
    try:
        features = eth.get_features(ifname)
        changed = False
        for name, feature in features.features.items():
            if name.startswith("tx-") and feature.available and feature.enable:
                feature.enable = False
                changed = True
        if changed:
            eth.set_features(ifname, features)
        now = eth.get_features(ifname).features
        still_on = [n for n in _MUST_BE_OFF if n in now and now[n].enable]
    finally:
        eth.close()
    if still_on:
        raise HealthTunnelError(f"{ifname}: could not turn off {', '.join(still_on)}")


def _ensure_device(ipr: Any, ifname: str) -> int:
    """The instance's ifb device, made if missing, configured, up; its ifindex."""
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        ipr.link("add", ifname=ifname, kind=_IFB)
        found = ipr.link_lookup(ifname=ifname)
    (index,) = found
    info = ipr.get_links(index)[0].get_attr("IFLA_LINKINFO")
    kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
    if kind != _IFB:
        raise HealthTunnelError(f"{ifname} exists and is a {kind or 'plain'} device, not ifb")
    # Before the device goes up: no link-local address, so no router solicitations or
    # MLD reports of its own (they would only be counted as unknown marks).
    _write_sysctl(f"net.ipv6.conf.{ifname}.addr_gen_mode", 1)
    # hc_tc's bpf_fib_lookup() is an input-style lookup from this device: it answers
    # FWD_DISABLED unless the device forwards. Nothing ever arrives on it to forward.
    _write_sysctl(f"net.ipv4.conf.{ifname}.forwarding", 1)
    _write_sysctl(f"net.ipv6.conf.{ifname}.forwarding", 1)
    _disable_offloads(ifname)
    ipr.link("set", index=index, mtu=HC_MTU, state="up")
    return int(index)


def _ensure_routes(
    ipr: Any, table: int, index: int, source_v4: IPAddress | None, source_v6: IPAddress | None
) -> None:
    """Default routes of ``table`` through the device, from the tunnel sources. A family
    without a source gets ``unreachable``: its checks fail at once instead of falling
    through to the main table (and reaching the VIP some other way)."""
    for family, dst, src in (
        (socket.AF_INET, "0.0.0.0/0", source_v4),
        (socket.AF_INET6, "::/0", source_v6),
    ):
        if src is None:
            ipr.route("replace", family=family, dst=dst, table=table, type="unreachable")
        else:
            ipr.route("replace", family=family, dst=dst, table=table, oif=index, prefsrc=str(src))


def _ensure_rules(ipr: Any, table: int) -> None:
    for family in (socket.AF_INET, socket.AF_INET6):
        tables = {_rule_table(r) for r in _hc_rules(ipr, family)}
        if tables - {table}:
            raise HealthTunnelError(
                f"fwmark {HC_MARK_BASE:#x}/{HC_MARK_MASK:#x} already leads to table(s) "
                f"{sorted(tables - {table})}: another instance's health checks use this "
                "network namespace"
            )
        if not tables:
            ipr.rule(
                "add",
                family=family,
                fwmark=HC_MARK_BASE,
                fwmask=HC_MARK_MASK,
                table=table,
                priority=HC_RULE_PRIORITY,
            )


def _hc_config(
    source_v4: IPAddress | None, source_v6: IPAddress | None, gue_port: int, hash_seed: int
) -> abi.Config:
    cfg = abi.Config(gue_port=socket.htons(gue_port), hash_seed=hash_seed)
    if source_v4 is not None:
        cfg.src4 = abi.addr_words(source_v4)[0]
    if source_v6 is not None:
        cfg.src6 = (ctypes.c_uint32 * 4)(*abi.addr_words(source_v6))
    return cfg


def hc_events(events: Map) -> dict[str, int]:
    """``hc_events`` summed over CPUs, by lower-case event name (``redirect``,
    ``drop_unknown_mark``, ...)."""
    return {
        ev.name.lower(): sum(
            struct.unpack("<Q", v[:8])[0] for v in events.lookup_percpu(struct.pack("<I", ev))
        )
        for ev in abi.HcEvent
    }


class HealthTunnel(Closing):
    """The health-check tunnel of one LB instance, in the calling thread's network
    namespace: the device, its policy routing, hc_tc attached at its egress, and hc_tc's
    maps pinned under :func:`pin_dir`. Making one again reuses all of it."""

    def __init__(
        self,
        instance: str,
        source_v4: ipaddress.IPv4Address | None,
        source_v6: ipaddress.IPv6Address | None,
        gue_port: int,
        *,
        hash_seed: int = 0,
        max_targets: int = abi.MAX_HC_TARGETS,
    ) -> None:
        """``source_v4`` / ``source_v6`` and ``gue_port`` mean what they mean in lb_xdp's
        configuration (outer sources, GUE destination port), and so does ``hash_seed``
        (the GUE source port is the flow hash's). The sources are also the checks' inner
        source addresses; a family without one cannot be checked."""
        if source_v4 is None and source_v6 is None:
            raise HealthTunnelError("a health-check tunnel needs at least one source address")
        if source_v4 is not None and source_v4.version != 4:
            raise HealthTunnelError(f"source_v4 {source_v4} is not an IPv4 address")
        if source_v6 is not None and source_v6.version != 6:
            raise HealthTunnelError(f"source_v6 {source_v6} is not an IPv6 address")
        if not 1 <= gue_port <= 0xFFFF:
            raise HealthTunnelError(f"gue_port must be 1..65535, not {gue_port}")
        self.instance = instance
        self.ifname = ifname_for(instance)
        self.table = table_for(instance)
        self.pin_dir = pin_dir(instance)
        with _iproute() as ipr:
            self.ifindex = _ensure_device(ipr, self.ifname)
            _ensure_routes(ipr, self.table, self.ifindex, source_v4, source_v6)
            _ensure_rules(ipr, self.table)
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        for d in (self.pin_dir.parent, paths.pin_root(instance)):
            os.chmod(d, 0o700)  # pins are root's business only
        #: hc_targets' size (config ``limits.hc_targets``).
        self.max_targets = max_targets
        try:
            self.obj = BpfObject.load(
                paths.bpf_object("hc_tc"),
                pin_root=self.pin_dir,
                max_entries={"hc_targets": max_targets},
            )
        except PinnedSizeError as e:
            name, pinned, wanted = e.mismatches[0]
            raise HealthTunnelError(
                f"pinned {name} has {pinned} entries, {wanted} asked for "
                f"(limits.hc_targets); `xdplb stop` removes the pins"
            ) from None
        try:
            self.maps = {n: self.obj.map(n) for n in MAP_NAMES}
            cfg = _hc_config(source_v4, source_v6, gue_port, hash_seed)
            self.maps["hc_config"].update(_ZERO, cfg.pack())
            # Replaces a previous run's filter in place: no moment without hc_tc.
            tc_attach(self.obj.program("hc_tc"), self.ifindex, ingress=False)
        except BaseException:
            self.obj.close()
            raise

    @staticmethod
    def mark_for(index: int) -> int:
        """The socket mark of target ``index`` (0..HC_MAX_INDEX)."""
        if not 0 <= index <= HC_MAX_INDEX:
            raise ValueError(f"target index must be 0..{HC_MAX_INDEX}, not {index}")
        return HC_MARK_BASE | index

    def set_targets(self, targets: Mapping[int, tuple[IPAddress, abi.Encap] | HcTarget]) -> None:
        """Exactly ``targets`` (mark -> (backend, encapsulation)): new and changed ones are
        written first, then stale ones deleted, so an unchanged mark never misses."""
        if len(targets) > self.max_targets:
            raise ValueError(f"at most {self.max_targets} targets, not {len(targets)}")
        wanted: dict[bytes, bytes] = {}
        for mark, target in targets.items():
            _check_mark(mark)
            tgt = HcTarget(*target)
            flags = abi.HC_F_SRC_HASH if tgt.src_hash else 0
            entry = abi.HcTarget.make(tgt.address, abi.Encap(tgt.encap), flags)
            wanted[struct.pack("<I", mark)] = entry.pack()
        table = self.maps["hc_targets"]
        for key, value in wanted.items():
            table.update(key, value)
        for key in list(table.keys()):
            if key not in wanted:
                table.delete(key)

    def targets(self) -> dict[int, HcTarget]:
        """What ``hc_targets`` holds now."""
        out = {}
        for key, raw in self.maps["hc_targets"].items():
            t = abi.HcTarget.from_buffer_copy(raw)
            out[struct.unpack("<I", key)[0]] = HcTarget(
                abi.words_addr(t.addr, t.family),
                abi.Encap(t.encap),
                bool(t.flags & abi.HC_F_SRC_HASH),
            )
        return out

    def counters(self) -> dict[str, int]:
        """hc_tc's forwards and named drops, summed over CPUs."""
        return hc_events(self.maps["hc_events"])

    def close(self) -> None:
        """Close descriptors only: device, filter, rules, routes and pins stay."""
        self.obj.close()


def destroy_health_tunnel(instance: str) -> None:
    """Remove an instance's tunnel from the calling thread's namespace: its fwmark rules
    (v4 and v6), its table's routes, its device (with the TC filter and so the program)
    and its pins. Whatever is already gone is skipped."""
    from pyroute2.netlink.exceptions import NetlinkError

    table = table_for(instance)
    with _iproute() as ipr:
        for family in (socket.AF_INET, socket.AF_INET6):
            for rule in list(_hc_rules(ipr, family)):
                if _rule_table(rule) == table:
                    ipr.rule(
                        "del",
                        family=family,
                        fwmark=HC_MARK_BASE,
                        fwmask=HC_MARK_MASK,
                        table=table,
                        priority=rule.get_attr("FRA_PRIORITY"),
                    )
            for route in list(ipr.get_routes(family=family, table=table)):
                with contextlib.suppress(NetlinkError):  # gone with the device meanwhile
                    ipr.route("del", **_route_key(route, family, table))
        for index in ipr.link_lookup(ifname=ifname_for(instance)):
            ipr.link("del", index=index)
    hc = pin_dir(instance)
    shutil.rmtree(hc, ignore_errors=True)
    for d in (hc.parent, paths.pin_root(instance)):
        with contextlib.suppress(OSError):  # only if nothing else of the instance is pinned
            d.rmdir()


def _route_key(route: Any, family: int, table: int) -> dict[str, Any]:
    """What identifies a dumped route for deletion."""
    dst = route.get_attr("RTA_DST")
    default = "0.0.0.0" if family == socket.AF_INET else "::"
    return {
        "family": family,
        "table": table,
        "dst": f"{dst or default}/{route['dst_len']}",
        "type": route["type"],
    }
