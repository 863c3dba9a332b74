"""The configuration's schema: pydantic models of the YAML file, one per section, and
the enums they use. Every model is frozen and forbids unknown keys; its validators check
what depends on its own fields (the checks that are plain functions are
:mod:`xdplb.config.checks`), raising :class:`~xdplb.config.checks.FieldError` so the
error names the field (:mod:`xdplb.config.load`). The API's request bodies are these
models too.

Validation is strict: ``"3"``, ``true`` or ``3.0`` where an integer is due (``1`` where a
boolean is) is refused, naming the field, not coerced; YAML and JSON give real numbers and
booleans. What JSON and YAML can only spell as text is read from text, and only from text:
addresses, prefixes, paths, and the names of enums (case-insensitive: ``protocol: TCP`` is
``tcp``, which is how it is written back). A list stops at its first bad item
(``fail_fast``): a body of a million bad items costs one error, not a million.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from xdplb.config.checks import (
    MAX_TABLE_SIZE,
    FieldError,
    check_fits,
    check_limit_bounds,
    check_table_size,
)
from xdplb.config.health import HealthCheckConfig
from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress, IPNetwork
from xdplb.core.errors import ConfigError
from xdplb.core.limits import SOCKLB_MAX_BACKENDS, SOCKLB_MAX_SERVICES
from xdplb.core.state import DEFAULT_TIMEOUTS, timeout_ticks


class _Name(StrEnum):
    """An enum of the configuration: its values are lower-case names, read in any case."""

    @classmethod
    def _missing_(cls, value: object) -> _Name | None:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        return None


#: An enum field: its name is text in YAML and JSON, so the field reads text (not strict).
NAME = Field(strict=False)


def _text(parse: Callable[[str], Any], kind: type | tuple[type, ...], what: str) -> BeforeValidator:
    """A value JSON and YAML spell as text: parsed from a string, an instance as it is, and
    anything else (a number, a boolean) refused."""

    def check(value: Any) -> Any:
        if isinstance(value, kind):
            return value
        if not isinstance(value, str):
            raise ValueError(f"must be {what}, as a string")
        try:
            return parse(value)
        except ValueError:
            raise ValueError(f"{value!r} is not {what}") from None

    return BeforeValidator(check)


_V4, _V6 = ipaddress.IPv4Address, ipaddress.IPv6Address
#: An IPv4 or IPv6 address, from its text (``198.18.0.11``, ``fd78::11``).
Address = Annotated[IPAddress, _text(ipaddress.ip_address, (_V4, _V6), "an IPv4 or IPv6 address")]
V4Address = Annotated[ipaddress.IPv4Address, _text(_V4, _V4, "an IPv4 address")]
V6Address = Annotated[ipaddress.IPv6Address, _text(_V6, _V6, "an IPv6 address")]


class Protocol(_Name):
    TCP = "tcp"
    UDP = "udp"

    @property
    def number(self) -> int:
        return abi.IPPROTO_TCP if self is Protocol.TCP else abi.IPPROTO_UDP


class EncapKind(_Name):
    GUE = "gue"
    IPIP = "ipip"

    @property
    def abi(self) -> abi.Encap:
        return abi.Encap.GUE if self is EncapKind.GUE else abi.Encap.IPIP


class HashFields(_Name):
    FIVE_TUPLE = "5tuple"  #: source and destination address and port, protocol
    SOURCE = "source"  #: source address only: every flow of a client to one backend


class TableKindName(_Name):
    MAGLEV = "maglev"  #: one hop per bucket; consistent hashing
    BEAMER = "beamer"  #: first hop + previous owners per bucket; daisy chaining keeps connections

    @property
    def abi(self) -> abi.TableKind:
        return abi.TableKind.MAGLEV if self is TableKindName.MAGLEV else abi.TableKind.BEAMER


#: Buckets of a Beamer table unless the VIP says otherwise (need not be prime).
BEAMER_DEFAULT_SIZE = 65536


class XdpModeName(_Name):
    NATIVE = "native"
    GENERIC = "generic"


class HookName(_Name):
    AUTO = "auto"  #: XDP on a physical NIC, TC on veth and other virtual devices
    XDP = "xdp"
    TC = "tc"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class InterfaceConfig(_Model):
    """An interface the balancer runs on; in YAML its name alone stands for
    ``{name: ..., hook: auto}``."""

    name: str
    hook: Annotated[HookName, NAME] = HookName.AUTO
    """xdp (lb_xdp, in ``xdp_mode``), tc (lb_tc at TC ingress), or auto (docs/operations.md,
    "Which hook")."""

    @field_validator("name")
    @classmethod
    def _ifname(cls, v: str) -> str:
        if not 0 < len(v) < 16 or "/" in v or v.strip() != v:
            raise ValueError(f"{v!r} is not a valid interface name")
        return v

    @model_serializer(mode="wrap")
    def _short(self, handler: SerializerFunctionWrapHandler) -> Any:
        """Written back as it is usually written: the name alone where the hook is auto."""
        return self.name if self.hook is HookName.AUTO else handler(self)


class BackendConfig(_Model):
    """A backend of a VIP: the tunnel endpoint the LB encapsulates to."""

    address: Address
    """Tunnel endpoint; the host runs host_tc and has the VIP on its loopback."""
    weight: Annotated[int, Field(ge=0, le=65535)] = 1
    """Relative share of new flows; 0 keeps the backend configured but out of the table."""
    health: HealthCheckConfig | None = None
    """This backend's own health check, instead of the VIP's."""


class BeamerConfig(_Model):
    """How fast a Beamer table may change (docs/design.md §3)."""

    min_interval: Annotated[float, Field(ge=0, le=86400)] = 60.0
    """Seconds between two changes of this VIP's table: time for connections to drain."""
    max_step: Annotated[float, Field(gt=0, le=1)] = 0.05
    """Largest fraction of the buckets one change may move (small steps to a far target)."""


class WeightBounds(_Model):
    """The range load feedback may move one backend's weight within."""

    min_weight: Annotated[int, Field(ge=0, le=65535)] = 1
    max_weight: Annotated[int, Field(ge=1, le=65535)] = 65535

    @model_validator(mode="after")
    def _order(self) -> WeightBounds:
        if self.min_weight > self.max_weight:
            raise FieldError("min_weight", "must not be above max_weight")
        return self


_HOST_PORT = r"^(\[[0-9A-Fa-f:.]+\]|[0-9.]+):[0-9]{1,5}$"


def _split_host_port(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class AgentsConfig(_Model):
    """Where the backends' agents (``python -m xdplb.agent``) send their reports: load
    for ``load_feedback``, open connections for graceful drain, host_tc counters."""

    listen: Annotated[str, Field(pattern=_HOST_PORT)]
    """``address:port`` (``[v6]:port``): a management address, since reports are not
    authenticated."""

    @property
    def address(self) -> tuple[str, int]:
        return _split_host_port(self.listen)


class ApiConfig(_Model):
    """The daemon's HTTP API, metrics and status page."""

    listen: str = ""
    """``unix:/path``, ``address:port`` or ``[v6]:port``; empty: the unix socket
    ``/run/xdplb/<instance>.api.sock`` (root only)."""
    token: Annotated[str, Field(min_length=16, max_length=4096)] | None = None
    """Bearer token every request must carry; required unless the API listens on a unix
    socket or a loopback address."""
    token_file: Annotated[Path, Field(strict=False)] | None = None
    """Read the token from this file instead (its first line)."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] | None = None
    """Largest request body read (413 beyond); default: what the largest sensible
    configuration at ``limits`` takes (6 MiB at the default limits)."""
    body_timeout: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Seconds a request's body may take to arrive (408 beyond)."""
    idle_timeout: Annotated[float, Field(gt=0, le=3600)] = 5.0
    """Seconds a connection may stay open without a request, or take to send a request's
    headers, before the daemon closes it."""
    max_connections: Annotated[int, Field(ge=1, le=65535)] = 64
    """Connections (and requests in progress) beyond which a new request gets 503."""

    @model_validator(mode="after")
    def _check(self) -> ApiConfig:
        if self.token is not None and self.token_file is not None:
            raise FieldError("token_file", "give token or token_file, not both")
        if self.listen and not self.listen.startswith("unix:"):
            if not re.match(_HOST_PORT, self.listen):
                raise FieldError("listen", "must be unix:/path, address:port or [v6]:port")
            host, port = _split_host_port(self.listen)
            try:
                addr = ipaddress.ip_address(host)
            except ValueError:
                raise FieldError("listen", f"{host!r} is not an IP address") from None
            if not 0 < port < 65536:
                raise FieldError("listen", f"port {port} is out of range")
            if not addr.is_loopback and self.token is None and self.token_file is None:
                raise FieldError("token", "required when the API listens on a non-loopback address")
        elif self.listen == "unix:":
            raise FieldError("listen", "unix: needs a path")
        return self


class LoadFeedbackConfig(_Model):
    """Load-aware weights (Bilibili's Nickel): ``xdplb.agent`` on each backend reports CPU
    use and request rate; the weights of VIPs with ``load_feedback: true`` move toward
    equal load, damped, within bounds, never faster than ``min_interval`` (nor than a
    Beamer table's own). Off unless this section is present; needs ``agents``."""

    gain: Annotated[float, Field(gt=0, le=1)] = 0.5
    """Fraction of the distance to equal load covered by one change."""
    deadband: Annotated[float, Field(ge=0, lt=1)] = 0.05
    """Relative load difference below which a backend does not move."""
    min_interval: Annotated[float, Field(gt=0, le=86400)] = 60.0
    """Seconds between two weight changes."""
    settle: Annotated[float, Field(ge=0)] = 1.5
    """Reports this soon after a change describe the old weights and are ignored."""
    max_age: Annotated[float, Field(gt=0)] = 5.0
    """Reports older than this are ignored; a backend without one keeps its weight."""
    total_weight: Annotated[int, Field(ge=1, le=65535 * 64)] = 1000
    """Sum of the weights handed out per VIP (weights are relative; 1:1 cannot move)."""
    bounds: WeightBounds = Field(default_factory=WeightBounds)
    """Bounds of every backend not listed in ``backend_bounds``."""
    backend_bounds: dict[Address, WeightBounds] = Field(default_factory=dict)
    """Bounds per backend address (e.g. a small machine that must never take much)."""

    @model_validator(mode="after")
    def _check(self) -> LoadFeedbackConfig:
        if self.settle >= self.min_interval:
            raise FieldError("settle", "must be below min_interval")
        return self


def _prefix(value: Any) -> IPNetwork:
    """A source prefix: ``198.18.7.0/24``, ``fd78::/48`` or a bare address (/32, /128).
    Host bits must be clear, so a typo does not silently widen or move the rule."""
    if isinstance(value, ipaddress.IPv4Network | ipaddress.IPv6Network):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a prefix such as 198.18.7.0/24 or fd78:6470:6c62::/48")
    try:
        return ipaddress.ip_network(value)
    except ValueError:
        pass
    try:
        net = ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 or IPv6 prefix") from None
    raise ValueError(f"{value} has host bits set (the prefix is {net})")


#: A source prefix of an ACL, host bits clear (``198.18.7.0/24``; a bare address is /32).
AclPrefix = Annotated[IPNetwork, BeforeValidator(_prefix)]


class AclConfig(_Model):
    """Source ACL of one scope (global, or one VIP): the longest matching prefix decides.
    A source no rule matches is allowed, unless ``allow`` is not empty: then it is denied
    (an allow list). A denied packet is dropped in XDP (drop reason ``acl``)."""

    allow: list[AclPrefix] = Field(default_factory=list, fail_fast=True)
    """Source prefixes let through."""
    deny: list[AclPrefix] = Field(default_factory=list, fail_fast=True)
    """Source prefixes dropped."""

    @model_validator(mode="after")
    def _distinct(self) -> AclConfig:
        seen: dict[IPNetwork, str] = {}
        for name, prefixes in (("allow", self.allow), ("deny", self.deny)):
            for i, p in enumerate(prefixes):
                if p in seen:
                    where = "listed twice" if seen[p] == name else f"also in {seen[p]}"
                    raise FieldError(f"{name}[{i}]", f"{p} is {where}")
                seen[p] = name
        return self

    @property
    def empty(self) -> bool:
        return not self.allow and not self.deny


class RateLimitConfig(_Model):
    """A token bucket per source prefix for new flows (TCP SYNs, UDP packets without a
    connection-table entry): over it, new flows are dropped (drop reason ``rate_limit``)."""

    new_flows_per_second: Annotated[int, Field(ge=1, le=2**32 - 1)]
    """Sustained new flows per second each source prefix may open."""
    burst: Annotated[int, Field(ge=1, le=2**32 - 1)] | None = None
    """Bucket depth in new flows (default: one second's worth)."""
    prefix_v4: Annotated[int, Field(ge=0, le=32)] = 32
    """Sources are grouped by this IPv4 prefix length (32: each address its own bucket)."""
    prefix_v6: Annotated[int, Field(ge=0, le=128)] = 64
    """And this IPv6 prefix length (64: one bucket per /64, a host's usual allocation)."""

    @property
    def bucket(self) -> int:
        return self.burst if self.burst is not None else self.new_flows_per_second


#: Connection-table inserts per second per CPU unless ``flood.conn_insert_budget`` says.
DEFAULT_INSERT_BUDGET = abi.DEFAULT_FLOOD_MAX * 1_000_000_000 // abi.FLOOD_WINDOW_NS


class FloodConfig(_Model):
    """New-connection flood handling."""

    conn_insert_budget: Annotated[int, Field(ge=0, le=2**32 - 1)] = DEFAULT_INSERT_BUDGET
    """Connection-table inserts per second per CPU (counted per 100 ms window); new flows
    beyond it are balanced by the table but not recorded (event ``conn_flood``). 0: no
    limit."""
    rate_limit: RateLimitConfig | None = None
    """Per-source-prefix rate limit of new flows; absent: off."""

    @property
    def flood_max(self) -> int:
        """Inserts per window per CPU (``struct xdplb_config.flood_max``)."""
        if not self.conn_insert_budget:
            return 0
        per_window = self.conn_insert_budget * abi.FLOOD_WINDOW_NS // 1_000_000_000
        return min(max(1, per_window), 2**32 - 1)


Timeout = Annotated[float, Field(gt=0, le=7 * 86400)]


class SessionsConfig(_Model):
    """The session table: how long an idle session lives, by state (seconds). An expired
    session is a miss: its flow is hashed into the table again (docs/datapath.md)."""

    tcp_timeout: Timeout = DEFAULT_TIMEOUTS[abi.SessState.TCP_EST]
    """An established TCP connection (a segment without SYN seen)."""
    tcp_syn_timeout: Timeout = DEFAULT_TIMEOUTS[abi.SessState.TCP_SYN]
    """A TCP connection of which only the SYN was seen."""
    tcp_fin_timeout: Timeout = DEFAULT_TIMEOUTS[abi.SessState.TCP_FIN]
    """A TCP connection after the client's FIN or RST."""
    udp_timeout: Timeout = DEFAULT_TIMEOUTS[abi.SessState.UDP]
    """A UDP flow. A drained backend keeps its UDP flows until they are idle this long."""

    def ticks(self, hz: int) -> tuple[int, ...]:
        """``xdplb_config.conn_timeout``, indexed by ``abi.SessState``, at ``hz`` ticks a
        second (the kernel's HZ: the session clock is jiffies)."""
        by_state = {
            abi.SessState.UDP: self.udp_timeout,
            abi.SessState.TCP_SYN: self.tcp_syn_timeout,
            abi.SessState.TCP_EST: self.tcp_timeout,
            abi.SessState.TCP_FIN: self.tcp_fin_timeout,
        }
        return tuple(timeout_ticks(by_state[st], hz) for st in abi.SessState)


class VipConfig(_Model):
    """A virtual service: (address, port, protocol) and where its flows go."""

    address: Address
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """0 is the wildcard: every port of the address (for this protocol)."""
    protocol: Annotated[Protocol, NAME] = Protocol.TCP
    encap: Annotated[EncapKind, NAME] = EncapKind.GUE
    hash: Annotated[HashFields, NAME] = HashFields.FIVE_TUPLE
    table: Annotated[TableKindName, NAME] = TableKindName.MAGLEV
    """maglev, or beamer: previous owners per bucket so backends can daisy-chain connections."""
    beamer: BeamerConfig = Field(default_factory=BeamerConfig)
    """Change policy of a Beamer table (ignored for Maglev)."""
    table_size: int | None = None
    """Buckets in this VIP's table: a prime for Maglev (default: the global table_size),
    any size for Beamer (default 65,536)."""
    load_feedback: bool = False
    """Let the backends' reported load move their weights (needs the top-level
    ``load_feedback`` section)."""
    sync: bool = True
    """With ``sync`` configured: this VIP's sessions are sent to and taken from the other
    nodes; false: its flows rely on consistent hashing alone."""
    icmp_echo: bool = False
    """Answer ICMP/ICMPv6 echo requests to this VIP's address in lb_xdp (set on any VIP of
    an address, it applies to the address)."""
    fragments: bool = False
    """This VIP gets the IP fragments to its address and protocol (their port is
    unknown). Default: the port-0 VIP of the address and protocol, else its only VIP;
    with several and no choice, fragments are dropped."""
    udp_drain_idle: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """UDP: seconds without a packet from lb_xdp to a drained backend after which its
    drain is done (its agent must also count no connected socket); TCP VIPs ignore it."""
    health: HealthCheckConfig | None = None
    """Health check of every backend of this VIP (a backend may have its own); none:
    the backends count as up. A backend that fails leaves the table until it recovers."""
    backends: list[BackendConfig] = Field(default_factory=list, fail_fast=True)
    acl: AclConfig = Field(default_factory=AclConfig)
    """This VIP's own source ACL, checked after the global one."""

    @model_validator(mode="after")
    def _check_ports(self) -> VipConfig:
        if self.port:
            return self
        checks = [("health", self.health)]
        checks += [(f"backends[{i}].health", b.health) for i, b in enumerate(self.backends)]
        for where, hc in checks:
            if hc is not None and hc.checker.kind != "command" and hc.checker.check_port is None:
                raise FieldError(
                    f"{where}.checker.{hc.checker.kind}.check_port",
                    "required: the VIP is a wildcard (port 0)",
                )
        return self

    @model_validator(mode="after")
    def _size(self) -> VipConfig:
        if self.table_size is None:
            return self
        if self.table is TableKindName.MAGLEV:
            try:
                check_table_size(self.table_size)
            except ValueError as e:
                raise FieldError("table_size", str(e)) from None
        elif not 1 <= self.table_size <= MAX_TABLE_SIZE:
            raise FieldError("table_size", f"must be between 1 and {MAX_TABLE_SIZE}")
        return self

    @field_validator("backends")
    @classmethod
    def _unique_backends(cls, v: list[BackendConfig]) -> list[BackendConfig]:
        seen: set[IPAddress] = set()
        for b in v:
            if b.address in seen:
                raise ValueError(f"backend {b.address} is listed twice")
            seen.add(b.address)
        return v

    @property
    def key(self) -> tuple[IPAddress, int, Protocol]:
        return (self.address, self.port, self.protocol)

    @property
    def name(self) -> str:
        addr = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{addr}:{self.port}/{self.protocol}"


class TunnelConfig(_Model):
    """Outer headers of the tunnels from the LB to the backends."""

    source_v4: V4Address | None = None
    """Outer source address for IPv4 backends (the LB's own address)."""
    source_v6: V6Address | None = None
    """Outer source address for IPv6 backends."""
    gue_port: Annotated[int, Field(ge=1, le=65535)] = abi.GUE_PORT
    """UDP destination port of GUE; host_tc on the backends must use the same."""
    icmp_too_big: bool = False
    """A client packet too big for the tunnel (egress MTU) is answered with ICMP
    "fragmentation needed" (IPv4 with DF) / ICMPv6 "packet too big" naming the MTU the
    client must use, instead of being dropped silently."""


class LimitsConfig(_Model):
    """Sizes of lb_xdp's and hc_tc's maps, fixed when the maps are created: changing one
    needs a fresh start (``xdplb stop``, which drops the connection table). Which maps
    each field sizes, what a full map does and the kernel memory each takes are in
    docs/operations.md ("Limits and memory")."""

    vips: int = abi.MAX_VIPS
    """VIPs (``lb_tables``, ``lb_btables``, ``lb_vip_stats``, ``lb_vip_addrs``; ``lb_vips``
    has twice as many entries, for a plan that replaces every VIP). A VIP whose table
    changes size or kind moves to a free VIP id, so leave room."""
    backends: int = abi.MAX_BACKENDS
    """Backend slots (``lb_backends``, ``lb_be_stats``); slot 0 is never a backend, so at
    most ``backends - 1`` distinct backend addresses, Beamer later hops included."""
    conn_table: int = abi.CONN_ENTRIES
    """Connections the connection table holds (``lb_conns``): a power of 2, in sets of
    4 (validated, not rounded)."""
    hc_targets: int = abi.MAX_HC_TARGETS
    """Distinct tunnelled health-check targets (``hc_targets``): (backend, encapsulation,
    hash) triples."""
    acl_rules: int = 16384
    """Prefixes of the source ACLs, per family (``lb_acl4``, ``lb_acl6``)."""
    rate_limit_sources: int = 65536
    """Source prefixes the new-flow rate limit tracks at once (``lb_rate``, LRU)."""

    @model_validator(mode="after")
    def _check(self) -> LimitsConfig:
        check_limit_bounds(self)
        return self

    @property
    def conn_sets(self) -> int:
        """Sets of the connection table."""
        return self.conn_table // abi.CONN_WAYS

    @property
    def conn_mask(self) -> int:
        """``lb_config.conn_mask``: a flow's set is its hash AND this."""
        return self.conn_sets - 1

    @property
    def vip_index_mask(self) -> int:
        """``lb_config.vip_index_mask``: ``lb_vip_index`` has 8 slots per VIP, a power of
        2 (``lb_vips`` holds up to two keys a VIP during a plan: a quarter full at most)."""
        return (1 << (8 * self.vips - 1).bit_length()) - 1


class BgpPeerConfig(_Model):
    """A BGP neighbor of this node: a router that takes its VIPs."""

    address: Address
    """The router's address; the session carries the VIPs of this family."""
    asn: Annotated[int, Field(ge=1, le=4294967295)]
    """The router's AS (eBGP: another AS than ``bgp.asn``)."""
    bfd: bool = True
    """Run BFD with it (BIRD's ``bfd on``): a node whose link loses every packet is
    withdrawn after ``bfd_interval_ms`` x ``bfd_multiplier``, not the hold time."""


class BgpConfig(_Model):
    """Announce the VIPs over BGP from this node, with BIRD 2 as the speaker
    (docs/cluster.md): only while the node's self-check passes, withdrawn on stop."""

    asn: Annotated[int, Field(ge=1, le=4294967295)]
    """This node's AS: the same on every node of a cluster (a router merges only paths
    of equal AS-path length, origin, MED and local preference)."""
    router_id: V4Address | None = None
    """BGP router id; default: ``tunnel.source_v4``."""
    peers: list[BgpPeerConfig] = Field(min_length=1)
    hold_time: Annotated[int, Field(ge=3, le=65535)] = 3
    """BGP hold time, seconds (keepalives every third of it)."""
    bfd_interval_ms: Annotated[int, Field(ge=10, le=10000)] = 100
    bfd_multiplier: Annotated[int, Field(ge=1, le=255)] = 3
    self_check_interval: Annotated[float, Field(ge=0.05, le=60)] = 0.5
    """Seconds between self-checks; a failure withdraws every VIP at once."""
    hold_down: Annotated[float, Field(ge=0, le=3600)] = 2.0
    """Seconds the self-check must pass again before a withdrawn node announces again."""
    drain: Annotated[float, Field(ge=0, le=300)] = 1.0
    """Seconds between the withdrawal and the daemon's exit on SIGTERM or ``xdplb stop``:
    the routers move the flows meanwhile, and the programs still serve them."""
    bird: str = "bird"
    """The BIRD 2 binary (looked up in PATH and /usr/sbin)."""
    uplink_down: list[Annotated[str, Field(min_length=1, max_length=15)]] = []
    """Interfaces the daemon sets down when its self-check starts failing, besides
    withdrawing (MGW's fence: a router sees its link go at once, even when BGP could not
    tell it). It never sets them up again: an operator does, once the node is fixed. Set
    ``net.ipv6.conf.<if>.keep_addr_on_down=1`` on them, or their IPv6 addresses go too."""

    @field_validator("peers")
    @classmethod
    def _distinct(cls, v: list[BgpPeerConfig]) -> list[BgpPeerConfig]:
        addrs = [p.address for p in v]
        if len(set(addrs)) != len(addrs):
            raise ValueError("a peer is listed twice")
        return v


class ClusterConfig(_Model):
    """Where the fleet's configuration lives (docs/cluster.md, "Fleet state"): the nodes
    read the fleet's part of their configuration (:data:`FLEET_FIELDS`) from etcd,
    apply each revision, and publish what they serve under a lease."""

    store: Annotated[str, Field(pattern=r"^etcd://[^/:]+(:\d+)?$")]
    """``etcd://host:port`` (port default 2379)."""
    prefix: Annotated[str, Field(pattern=r"^/[^\s]*[^/\s]$")] = "/xdplb"
    """Keys: ``<prefix>/config`` (the fleet's document), ``<prefix>/nodes/<node>``."""
    node: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] | None = None
    """This node's name in the store; default: the instance name."""
    lease_ttl: Annotated[int, Field(ge=2, le=300)] = 5
    """Seconds a node's published state outlives it."""

    @property
    def endpoint(self) -> tuple[str, int]:
        host, _, port = self.store.removeprefix("etcd://").partition(":")
        return host, int(port or 2379)


#: A node's name on the sync wire (docs/sync.md: 16 bytes in every message's header).
SYNC_NODE = r"^[A-Za-z0-9._-]{1,16}$"


class SyncPeerConfig(_Model):
    """Another balancer node this one takes sessions from (and serves them to)."""

    node: Annotated[str, Field(pattern=SYNC_NODE)]
    """Its node name (``sync.node`` of its own configuration): every message it sends
    carries it."""
    address: Annotated[str, Field(pattern=_HOST_PORT)]
    """Its ``sync.listen``: ``address:port`` (``[v6]:port``)."""

    @property
    def endpoint(self) -> tuple[str, int]:
        return _split_host_port(self.address)


class SyncConfig(_Model):
    """Session sync between balancer nodes (docs/sync.md, MGW's): new sessions stream to
    every peer as they are made; a starting node first takes a full copy from every peer
    and announces (``bgp``) only once each copy's count and digest matched."""

    listen: Annotated[str, Field(pattern=_HOST_PORT)]
    """``address:port`` (``[v6]:port``) where peers subscribe: a private address of the
    balancers (messages are authenticated, not encrypted)."""
    node: Annotated[str, Field(pattern=SYNC_NODE)] | None = None
    """This node's name on the wire; default: ``cluster.node``, else the instance name
    (either must then fit: 1 to 16 of ``A-Z a-z 0-9 . _ -``)."""
    key: Annotated[str, Field(pattern=r"^([0-9A-Fa-f]{2}){16,64}$")] | None = None
    """The shared key of every message's HMAC-SHA256, hex (16 to 64 bytes): the same on
    every node."""
    key_file: Annotated[Path, Field(strict=False)] | None = None
    """Read the key from this file instead (hex, its first line)."""
    peers: list[SyncPeerConfig] = Field(default_factory=list, fail_fast=True)
    """The other nodes. With ``cluster``, the live nodes of the fleet's store that publish
    a sync address are peers too."""
    batch_delay_ms: Annotated[int, Field(ge=1, le=1000)] = 10
    """New sessions wait at most this long to be sent, batched."""
    refresh_interval: Annotated[float, Field(ge=0.1, le=3600)] = 5.0
    """Seconds between two scans that send every session that saw a packet since the
    last one, so that a peer's copy of a live session does not expire and a dead one
    expires everywhere (within this much of each other)."""
    copy_timeout: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Seconds a peer's full copy may take (subscribe to END) before it is asked again."""
    unreachable_after: Annotated[float, Field(ge=0, le=3600)] = 5.0
    """Seconds a starting node tries to reach a peer before it stops waiting for its copy
    (a peer that answers and then delays its END is waited for)."""

    @model_validator(mode="after")
    def _check(self) -> SyncConfig:
        if (self.key is None) == (self.key_file is None):
            raise FieldError("key", "give key or key_file (one of them)")
        names = [p.node for p in self.peers]
        if len(set(names)) != len(names):
            raise FieldError("peers", "a node is listed twice")
        return self

    @property
    def address(self) -> tuple[str, int]:
        return _split_host_port(self.listen)

    def secret(self) -> bytes:
        """The key's bytes (``key``, or ``key_file``'s first line); ConfigError naming the
        field if it cannot be read."""
        if self.key is not None:
            return bytes.fromhex(self.key)
        assert self.key_file is not None
        try:
            text = self.key_file.read_text().splitlines()[0].strip()
            raw = bytes.fromhex(text)
        except (OSError, IndexError, ValueError) as e:
            raise ConfigError(
                "sync.key_file", f"{self.key_file}: no hex key on its first line ({e})"
            ) from None
        if not 16 <= len(raw) <= 64:
            raise ConfigError("sync.key_file", f"{self.key_file}: the key must be 16 to 64 bytes")
        return raw


class SocketLbConfig(_Model):
    """Socket-level balancing (sock_lb) of VIPs for the processes of a cgroup: their
    connect() and sendmsg() to a VIP go straight to one of its backends, chosen by the
    same weights, tables and health as the XDP tier (docs: sock_lb). A backend is
    reached at its address and the VIP's port."""

    cgroup: Annotated[Path, Field(strict=False)]
    """The cgroup v2 directory whose processes (and its descendants') are balanced;
    fixed while the daemon runs."""
    vips: list[str] | None = None
    """VIPs by name (``10.96.0.10:80/tcp``, ``[fd00::10]:53/udp``); none: every VIP with a
    port (a port-0 VIP names no port to rewrite)."""
    affinity_seconds: Annotated[float, Field(ge=0, le=86400)] = 0.0
    """A client (its network namespace) keeps its backend while it calls the VIP again
    within this many seconds; 0: every socket is balanced on its own."""

    @field_validator("cgroup")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        if not v.is_absolute():
            raise ValueError(f"must be an absolute path, got {v}")
        return v

    def selected(self, vips: list[VipConfig]) -> list[VipConfig]:
        """The VIPs balanced at the socket, of ``vips``."""
        if self.vips is None:
            return [v for v in vips if v.port]
        names = set(self.vips)
        return [v for v in vips if v.name in names]


#: The fields of a configuration that the fleet's document in the store sets for every
#: node; the rest (interfaces, addresses, API, BGP, map sizes) stays each node's own.
FLEET_FIELDS = ("hash_seed", "table_size", "load_feedback", "acl", "flood", "sessions", "vips")


class Config(_Model):
    """The whole desired state of one LB instance."""

    instance: Annotated[str, Field(json_schema_extra={"pattern": paths.INSTANCE_PATTERN})] = (
        "default"
    )
    """Name of this instance: its pins live in /sys/fs/bpf/xdplb/<instance>."""
    interfaces: list[InterfaceConfig] = Field(default_factory=list, fail_fast=True)
    """Interfaces the balancer runs on, each at its hook (a name alone: ``auto``)."""
    xdp_mode: Annotated[XdpModeName, NAME] = XdpModeName.NATIVE
    """native (driver) XDP; generic only as an explicit fallback."""
    hash_seed: Annotated[int, Field(ge=0, le=2**32 - 1)] = 0
    """Seed of the flow hash; every LB node of a cluster must use the same."""
    table_size: int = abi.DEFAULT_TABLE_SIZE
    """Default number of buckets of a Maglev table (a prime, > 100 x backends for <1% imbalance)."""
    tunnel: TunnelConfig = Field(default_factory=TunnelConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    agents: AgentsConfig | None = None
    """Reports from the backends' agents; absent: none are received."""
    load_feedback: LoadFeedbackConfig | None = None
    """Load-aware weights; absent: weights are exactly those configured."""
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    """Map sizes (fixed while the instance's maps exist)."""
    acl: AclConfig = Field(default_factory=AclConfig)
    """Source ACL of every VIP address (any port, any protocol), checked first."""
    flood: FloodConfig = Field(default_factory=FloodConfig)
    """Connection-table insert budget and the new-flow rate limit."""
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    """Idle timeouts of the session table."""
    bgp: BgpConfig | None = None
    """Announce the VIPs over BGP; absent: something else routes them here."""
    cluster: ClusterConfig | None = None
    """The fleet's configuration from a store (etcd); none: this file is all of it."""
    sync: SyncConfig | None = None
    """Session sync with the other balancer nodes; absent: flows that move between nodes
    rely on consistent hashing alone."""
    socket_lb: SocketLbConfig | None = None
    """Socket-level balancing of VIPs for a cgroup's processes; absent: none."""
    vips: list[VipConfig] = Field(default_factory=list, fail_fast=True)

    @field_validator("table_size")
    @classmethod
    def _prime(cls, v: int) -> int:
        check_table_size(v)
        return v

    @field_validator("instance")
    @classmethod
    def _instance(cls, v: str) -> str:
        return paths.instance_name(v)  # the one rule for every name that becomes a path

    @field_validator("interfaces", mode="before")
    @classmethod
    def _names_alone(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"name": i} if isinstance(i, str) else i for i in v]
        return v

    @field_validator("interfaces")
    @classmethod
    def _ifnames(cls, v: list[InterfaceConfig]) -> list[InterfaceConfig]:
        names = [i.name for i in v]
        if len(set(names)) != len(names):
            raise ValueError("an interface is listed twice")
        return v

    @property
    def ifnames(self) -> list[str]:
        return [i.name for i in self.interfaces]

    @field_validator("vips")
    @classmethod
    def _vips(cls, v: list[VipConfig]) -> list[VipConfig]:
        seen: set[tuple[IPAddress, int, Protocol]] = set()
        frag: dict[tuple[IPAddress, Protocol], str] = {}
        for vip in v:
            if vip.key in seen:
                raise ValueError(f"VIP {vip.name} is listed twice")
            seen.add(vip.key)
            if vip.fragments:
                other = frag.setdefault((vip.address, vip.protocol), vip.name)
                if other != vip.name:
                    raise ValueError(
                        f"VIPs {other} and {vip.name} both ask for the fragments of "
                        f"{vip.address}/{vip.protocol}"
                    )
        return v

    @property
    def sync_node(self) -> str | None:
        """This node's name on the sync wire (None without ``sync``)."""
        if self.sync is None:
            return None
        return self.sync.node or (self.cluster.node if self.cluster else None) or self.instance

    @model_validator(mode="after")
    def _sync_node(self) -> Config:
        name = self.sync_node
        if name is not None and not re.match(SYNC_NODE, name):
            raise FieldError(
                "sync.node",
                f"required: the default name {name!r} (cluster.node or instance) does not "
                "fit 1 to 16 of A-Z a-z 0-9 . _ -",
            )
        if self.sync is not None and name in {p.node for p in self.sync.peers}:
            raise FieldError("sync.peers", f"lists this node ({name}) itself")
        return self

    @model_validator(mode="after")
    def _tunnel_sources(self) -> Config:
        for i, vip in enumerate(self.vips):
            for j, b in enumerate(vip.backends):
                if b.address.version == 4 and self.tunnel.source_v4 is None:
                    raise FieldError(
                        f"vips[{i}].backends[{j}].address",
                        "an IPv4 backend needs tunnel.source_v4",
                    )
                if b.address.version == 6 and self.tunnel.source_v6 is None:
                    raise FieldError(
                        f"vips[{i}].backends[{j}].address",
                        "an IPv6 backend needs tunnel.source_v6",
                    )
        if self.load_feedback is not None and self.agents is None:
            raise FieldError("load_feedback", "needs the agents section (where reports arrive)")
        for i, vip in enumerate(self.vips):
            if vip.load_feedback and self.load_feedback is None:
                raise FieldError(
                    f"vips[{i}].load_feedback", "needs the top-level load_feedback section"
                )
        self._check_bgp()
        self._check_limits()
        self._check_socket_lb()
        return self

    def _check_socket_lb(self) -> None:
        """Every VIP named exists and has a port; a balanced VIP's backends are of its
        family (a socket cannot connect across families; the tunnel could)."""
        if self.socket_lb is None:
            return
        by_name = {v.name: v for v in self.vips}
        for i, name in enumerate(self.socket_lb.vips or ()):
            vip = by_name.get(name)
            if vip is None:
                raise FieldError(f"socket_lb.vips[{i}]", f"no VIP {name!r} in vips")
            if not vip.port:
                raise FieldError(f"socket_lb.vips[{i}]", f"VIP {name} has no port to rewrite")
        balanced = self.socket_lb.selected(self.vips)
        where = "socket_lb.vips" if self.socket_lb.vips is not None else "socket_lb"
        if len(balanced) > SOCKLB_MAX_SERVICES:
            raise FieldError(
                where,
                f"{len(balanced)} VIPs balanced at the socket: sock_lb holds at most "
                f"{SOCKLB_MAX_SERVICES} (name the ones to balance in socket_lb.vips)",
            )
        endpoints = {(b.address, v.port) for v in balanced for b in v.backends}
        if len(endpoints) > SOCKLB_MAX_BACKENDS:
            raise FieldError(
                where,
                f"{len(endpoints)} backend endpoints (address, port) balanced at the "
                f"socket: sock_lb holds at most {SOCKLB_MAX_BACKENDS}",
            )
        selected = {id(v) for v in balanced}
        for i, vip in enumerate(self.vips):
            if id(vip) not in selected:
                continue
            for j, b in enumerate(vip.backends):
                if b.address.version != vip.address.version:
                    raise FieldError(
                        f"vips[{i}].backends[{j}].address",
                        f"socket_lb balances VIP {vip.name}: its backends must be "
                        f"IPv{vip.address.version} too",
                    )

    def _check_bgp(self) -> None:
        if self.bgp is None:
            return
        if self.bgp.router_id is None and self.tunnel.source_v4 is None:
            raise FieldError("bgp.router_id", "needed when tunnel.source_v4 is not set")
        families = {p.address.version for p in self.bgp.peers}
        for i, vip in enumerate(self.vips):
            if vip.address.version not in families:
                raise FieldError(
                    f"vips[{i}].address",
                    f"an IPv{vip.address.version} VIP needs an IPv{vip.address.version} "
                    "peer in bgp.peers to be announced",
                )

    @property
    def bgp_router_id(self) -> IPAddress | None:
        """The BGP router id this node uses (None without bgp)."""
        if self.bgp is None:
            return None
        return self.bgp.router_id or self.tunnel.source_v4

    def _check_limits(self) -> None:
        """What the configuration needs fits the maps ``limits`` sizes."""
        acls = (self.acl, *(v.acl for v in self.vips))
        check_fits(
            self.limits,
            vips=len(self.vips),
            backends=len(self.backend_addresses()),
            hc_targets=len(tunnelled_hc_targets(self)),
            acl_rules={
                version: sum(
                    1 for acl in acls for p in (*acl.allow, *acl.deny) if p.version == version
                )
                for version in (4, 6)
            },
        )

    def backend_addresses(self) -> set[IPAddress]:
        return {b.address for vip in self.vips for b in vip.backends}

    def vip_table_size(self, vip: VipConfig) -> int:
        if vip.table_size is not None:
            return vip.table_size
        return self.table_size if vip.table is TableKindName.MAGLEV else BEAMER_DEFAULT_SIZE


def tunnelled_hc_targets(cfg: Config) -> set[tuple[IPAddress, EncapKind, HashFields]]:
    """The distinct (backend, encapsulation, hash) triples health checks go through the
    tunnel to: one ``hc_targets`` entry each (xdplb.health.targets)."""
    out = set()
    for vip in cfg.vips:
        for b in vip.backends:
            check = b.health or vip.health
            if check is not None and check.via == "tunnel" and check.checker.kind != "command":
                out.add((b.address, vip.encap, vip.hash))
    return out
