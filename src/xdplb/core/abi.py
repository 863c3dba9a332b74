"""Python mirror of ``bpf/include/xdplb_abi.h``.

Every struct here has the same size and field offsets as its C twin; that is
checked mechanically against the BTF of the built objects (tests/bpf/test_abi.py),
not by eye. Addresses and ports are kept in network order, as in C; the helpers
below convert from ``ipaddress`` objects.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import socket
from typing import ClassVar

from xdplb.core.addresses import IPAddress

#: The layout version of lb_xdp's pinned maps (``enum xdplb_abi``): pins live under
#: ``<pin root>/abi-<N>`` (docs/operations.md, "Upgrades").
ABI_VERSION = 3
MAX_VIPS = 512
MAX_BACKENDS = 4096
MAX_HOPS = 4
CONN_ENTRIES = 262144
CONN_WAYS = 4
CONN_SETS = CONN_ENTRIES // CONN_WAYS
DEFAULT_TABLE_SIZE = 65537
GUE_PORT = 19523
SESS_KEYS = 10  # the session hash's multipliers, one per flow key word
MAX_HOST_ADDRS = 64
MAX_VIP_ADDRS = MAX_VIPS
MAX_HC_TARGETS = 8192

IPPROTO_TCP = socket.IPPROTO_TCP
IPPROTO_UDP = socket.IPPROTO_UDP


class Family(enum.IntEnum):
    V4 = 4
    V6 = 6


class Encap(enum.IntEnum):
    GUE = 0
    IPIP = 1


class TableKind(enum.IntEnum):
    MAGLEV = 0
    BEAMER = 1


VIP_F_SRC_HASH = 1 << 0
BACKEND_F_ACTIVE = 1 << 0
HC_F_SRC_HASH = 1 << 0
CFG_F_PTB = 1 << 0
CFG_F_ACL_DENY = 1 << 1
CFG_F_EXPORT = 1 << 3
SESS_F_USED = 1 << 0
SESS_F_IMPORTED = 1 << 1
EXPORT_RING_SIZE = 4 << 20
MEMBERS_PER_WORD = 32
VIP_FILTER_BITS = 16
VIP_FILTER_WORDS = (1 << VIP_FILTER_BITS) // 64
VIP_PROBES = 16
FLOOD_WINDOW_NS = 100_000_000
DEFAULT_FLOOD_MAX = 12500


class DropReason(enum.IntEnum):
    """Index of ``lb_drops``: why lb_xdp dropped a packet."""

    FRAGMENT = 0
    MALFORMED_L4 = enum.auto()
    NO_TABLE = enum.auto()
    NO_BACKEND = enum.auto()
    NO_CONFIG = enum.auto()
    ENCAP = enum.auto()
    FIB = enum.auto()
    TOO_BIG = enum.auto()
    ACL = enum.auto()
    RATE_LIMIT = enum.auto()
    ICMP = enum.auto()


class Event(enum.IntEnum):
    """Index of ``lb_events``: what lb_xdp did, besides drops."""

    PASS_NOT_IP = 0
    PASS_MALFORMED = enum.auto()
    PASS_NOT_VIP = enum.auto()
    CONN_HIT = enum.auto()
    CONN_MISS = enum.auto()
    CONN_STALE = enum.auto()
    TX = enum.auto()
    REDIRECT = enum.auto()
    FIB_PASS = enum.auto()
    CONN_FLOOD = enum.auto()
    LOCAL = enum.auto()
    ICMP_ERROR = enum.auto()
    ICMP_ECHO = enum.auto()
    ICMP_PTB = enum.auto()
    FRAGMENT = enum.auto()
    CONN_INSERT = enum.auto()
    CONN_BUSY = enum.auto()
    CONN_EVICT = enum.auto()
    CONN_EXPIRED = enum.auto()
    CONN_GEN_MISS = enum.auto()
    EXPORT_DROP = enum.auto()


class SessState(enum.IntEnum):
    """``enum xdplb_sess_state``: where a session is in its life (its timeout's index)."""

    UDP = 0
    TCP_SYN = enum.auto()
    TCP_EST = enum.auto()
    TCP_FIN = enum.auto()


class MemberState(enum.IntEnum):
    """``enum xdplb_member_state``: a backend's state in one VIP (``lb_members``)."""

    NONE = 0
    ACTIVE = enum.auto()
    DRAINING = enum.auto()
    DOWN = enum.auto()


class ExportType(enum.IntEnum):
    """``enum xdplb_export_type``: what an export record says of its session."""

    NEW = 1
    UPDATE = enum.auto()


class HostEvent(enum.IntEnum):
    """Index of ``host_events``: what host_tc did."""

    PASS = 0
    DECAP_GUE = enum.auto()
    DECAP_IPIP = enum.auto()
    DROP_MALFORMED = enum.auto()
    DROP_DECAP = enum.auto()
    # Daisy chaining: one per parsed GUE packet, decided before decapsulation.
    ACCEPT_NOT_TCP = enum.auto()
    ACCEPT_SYN = enum.auto()
    ACCEPT_OWNED = enum.auto()
    ACCEPT_SYNCOOKIE = enum.auto()
    ACCEPT_LAST_RESORT = enum.auto()
    ACCEPT_LOOP = enum.auto()
    FORWARD = enum.auto()
    FORWARD_FAILED = enum.auto()


class HcEvent(enum.IntEnum):
    """Index of ``hc_events``: what hc_tc did with a health-check packet."""

    REDIRECT = 0
    REDIRECT_NEIGH = enum.auto()
    DROP_UNKNOWN_MARK = enum.auto()
    DROP_UNSUPPORTED = enum.auto()
    DROP_NO_CONFIG = enum.auto()
    DROP_SELF = enum.auto()
    DROP_ENCAP = enum.auto()
    DROP_FIB = enum.auto()
    DROP_TOO_BIG = enum.auto()


class AbiStruct(ctypes.Structure):
    """A mirror of a C struct of an ABI header (its C name ``c_name``, for the BTF
    checks): byte conversion."""

    c_name: ClassVar[str]

    def pack(self) -> bytes:
        return bytes(self)

    @classmethod
    def layout(cls) -> tuple[int, list[tuple[str, int, int]]]:
        """The size and the fields as (name, byte offset, byte size), to compare with
        :meth:`xdplb.core.btf.Btf.struct_layout` of the C struct."""
        fields = [(f[0], int(getattr(cls, f[0]).offset), ctypes.sizeof(f[1])) for f in cls._fields_]
        return ctypes.sizeof(cls), fields

    @classmethod
    def unpack(cls, data: bytes) -> AbiStruct:
        return cls.from_buffer_copy(data[: ctypes.sizeof(cls)])


def addr_words(addr: IPAddress) -> tuple[int, int, int, int]:
    """An address as the four ``__u32`` words of a C key (network order in memory)."""
    raw = addr.packed.ljust(16, b"\0")
    w = tuple(int.from_bytes(raw[i : i + 4], "little") for i in range(0, 16, 4))
    return (w[0], w[1], w[2], w[3])


def words_addr(words: ctypes.Array[ctypes.c_uint32], family: int) -> IPAddress:
    raw = b"".join(int(w).to_bytes(4, "little") for w in words)
    if family == Family.V4:
        return ipaddress.IPv4Address(raw[:4])
    return ipaddress.IPv6Address(raw)


def family_of(addr: IPAddress) -> Family:
    return Family.V4 if addr.version == 4 else Family.V6


class VipKey(AbiStruct):
    c_name = "xdplb_vip_key"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
    ]

    @classmethod
    def make(cls, addr: IPAddress, port: int, proto: int) -> VipKey:
        return cls(addr_words(addr), socket.htons(port), proto, family_of(addr))


class VipInfo(AbiStruct):
    c_name = "xdplb_vip_info"
    _fields_ = [
        ("vip_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("table_size", ctypes.c_uint32),
        ("encap", ctypes.c_uint8),
        ("table_kind", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 2),
    ]


class VipSlot(AbiStruct):
    """One slot of ``lb_vip_index``'s table: a VIP key (family 0: empty) and its value."""

    c_name = "xdplb_vip_slot"
    _fields_ = [("key", VipKey), ("info", VipInfo)]


class Backend(AbiStruct):
    c_name = "xdplb_backend"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("family", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("gen", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]

    @classmethod
    def make(cls, addr: IPAddress, flags: int = BACKEND_F_ACTIVE, gen: int = 0) -> Backend:
        return cls(addr_words(addr), family_of(addr), flags, gen)


class FlowKey(AbiStruct):
    c_name = "xdplb_flow_key"
    _fields_ = [
        ("src", ctypes.c_uint32 * 4),
        ("dst", ctypes.c_uint32 * 4),
        ("sport", ctypes.c_uint16),  # network order
        ("dport", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]

    @classmethod
    def make(cls, src: IPAddress, dst: IPAddress, sport: int, dport: int, proto: int) -> FlowKey:
        return cls(
            addr_words(src), addr_words(dst), socket.htons(sport), socket.htons(dport), proto
        )


class ConnMeta(AbiStruct):
    """A session-table set's first cache line (``struct xdplb_conn_meta``)."""

    c_name = "xdplb_conn_meta"
    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("tag", ctypes.c_uint32 * CONN_WAYS),
        ("last_seen", ctypes.c_uint32 * CONN_WAYS),
        ("gen", ctypes.c_uint16 * CONN_WAYS),
        ("state", ctypes.c_uint8 * CONN_WAYS),
        ("flags", ctypes.c_uint8 * CONN_WAYS),
        ("pad2", ctypes.c_uint8 * 8),
    ]


class ConnEntry(AbiStruct):
    """One way of a session-table set (``struct xdplb_conn_entry``): the flow (ports in
    network order, as in the flow key) and where it goes."""

    c_name = "xdplb_conn_entry"
    _fields_ = [
        ("src", ctypes.c_uint32 * 4),
        ("dst", ctypes.c_uint32 * 4),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("be_gen", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
        ("hop", ctypes.c_uint16 * MAX_HOPS),
        ("hash", ctypes.c_uint32),
        ("nat", ctypes.c_uint32 * 3),
    ]


class ConnSet(AbiStruct):
    """One set of the session table (``lb_conns`` value)."""

    c_name = "xdplb_conn_set"
    _fields_ = [("meta", ConnMeta), ("way", ConnEntry * CONN_WAYS)]


class Session(AbiStruct):
    """A session as one record (``struct xdplb_session``): what the export ring carries
    and an import takes."""

    c_name = "xdplb_session"
    _fields_ = [
        ("last_seen", ctypes.c_uint32),
        ("gen", ctypes.c_uint16),
        ("state", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("entry", ConnEntry),
    ]


class ExportRec(AbiStruct):
    """One ``lb_sess_export`` record: a session lb_xdp recorded or moved on."""

    c_name = "xdplb_export_rec"
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("set", ctypes.c_uint32),
        ("way", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("sess", Session),
    ]


class Bucket(AbiStruct):
    c_name = "xdplb_bucket"
    _fields_ = [("hop", ctypes.c_uint32 * MAX_HOPS)]


class Config(AbiStruct):
    c_name = "xdplb_config"
    _fields_ = [
        ("src4", ctypes.c_uint32),
        ("src6", ctypes.c_uint32 * 4),
        ("gue_port", ctypes.c_uint16),  # network order
        ("conn_gen", ctypes.c_uint16),
        ("hash_seed", ctypes.c_uint32),
        ("conn_mask", ctypes.c_uint32),
        ("flood_max", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("rl_rate", ctypes.c_uint32),
        ("rl_burst", ctypes.c_uint32),
        ("rl_prefix4", ctypes.c_uint8),
        ("rl_prefix6", ctypes.c_uint8),
        ("pad2", ctypes.c_uint16),
        ("conn_timeout", ctypes.c_uint32 * len(SessState)),
        ("vip_index_mask", ctypes.c_uint32),
        ("hz", ctypes.c_uint32),
        ("probe_key", ctypes.c_uint32),
        ("sess_key", ctypes.c_uint64 * SESS_KEYS),  # hashing.sess_keys(hash_seed)
    ]


class Stats(AbiStruct):
    c_name = "xdplb_stats"
    _fields_ = [
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("new_flows", ctypes.c_uint64),
    ]


class HostConfig(AbiStruct):
    c_name = "xdplb_host_config"
    _fields_ = [("gue_port", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class Addr(AbiStruct):
    """Key of lb_vip_addrs and host_addrs."""

    c_name = "xdplb_addr"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]

    @classmethod
    def make(cls, addr: IPAddress) -> Addr:
        return cls(addr_words(addr), family_of(addr))


class HcTarget(AbiStruct):
    """Value of hc_targets (the key is the socket mark, a ``__u32``)."""

    c_name = "xdplb_hc_target"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("family", ctypes.c_uint8),
        ("encap", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]

    @classmethod
    def make(cls, addr: IPAddress, encap: Encap, flags: int = 0) -> HcTarget:
        return cls(addr_words(addr), family_of(addr), encap, flags)


# --- ICMP and fragments (bpf/lib/lb_icmp.h) ---

VIP_ADDR_F_FRAG_TCP = 1 << 0
VIP_ADDR_F_FRAG_UDP = 1 << 1
VIP_ADDR_F_ECHO = 1 << 2
MAX_EXTHDRS = 4


class VipAddrInfo(AbiStruct):
    """Value of lb_vip_addrs: the VIP count, fragments' VIP ports, echo."""

    c_name = "xdplb_vip_addr_info"
    _fields_ = [
        ("nvips", ctypes.c_uint32),
        ("frag_port", ctypes.c_uint16 * 2),  # network order: [0] TCP, [1] UDP
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


# --- Source ACLs and the new-flow rate limit (bpf/lib/lb_acl.h) ---

ACL_GLOBAL = 0xFFFFFFFF
ACL_ENTRIES = 16384
CFG_F_ACL = 1 << 2
VIP_F_ACL = 1 << 1
VIP_F_ACL_DENY = 1 << 2
RATE_ENTRIES = 65536
RATE_ONE = 1_000_000_000


class AclList(enum.IntEnum):
    """What an ACL rule says, and the list a hit is counted under (``lb_acl_hits``)."""

    ALLOW = 0
    DENY = enum.auto()
    DEFAULT = enum.auto()  #: no rule matched and the scope has an allow list


#: ``lb_acl_hits`` size: a slot per VIP id plus the global one, each with every list.
ACL_HITS = (MAX_VIPS + 1) * len(AclList)
#: The global scope's slot in ``lb_acl_hits``.
ACL_GLOBAL_SLOT = 0  # a VIP's slot is its id + 1


class AclKey4(AbiStruct):
    """``lb_acl4`` key; ``prefixlen`` counts the 32 bits of ``scope`` too."""

    c_name = "xdplb_acl_key4"
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("scope", ctypes.c_uint32),
        ("addr", ctypes.c_uint32),  # network order
    ]


class AclKey6(AbiStruct):
    c_name = "xdplb_acl_key6"
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("scope", ctypes.c_uint32),
        ("addr", ctypes.c_uint32 * 4),
    ]


class AclRule(AbiStruct):
    c_name = "xdplb_acl_rule"
    _fields_ = [("action", ctypes.c_uint8), ("pad", ctypes.c_uint8 * 3)]


class Rate(AbiStruct):
    """``lb_rate`` value: a source prefix's token bucket (key: ``Addr``, masked)."""

    c_name = "xdplb_rate"
    _fields_ = [("tokens", ctypes.c_uint64), ("stamp", ctypes.c_uint64)]


# --- packet capture (bpf/lib/capture.h) -----------------------------------------------------

CAP_DROP = 1 << 0
CAP_FORWARD = 1 << 1
CAP_PASS = 1 << 2
CAP_SNAP_MAX = 256
CAP_RING_SIZE = 1 << 20


class CapPoint(enum.IntFlag):
    """Capture points: bits of ``CaptureConfig.points``; a record names one."""

    DROP = CAP_DROP
    FORWARD = CAP_FORWARD
    PASS = CAP_PASS


class CapDecision(enum.IntEnum):
    """How a forwarded packet's backend was chosen (a FORWARD record's ``reason``)."""

    CONN_HIT = 0
    TABLE = enum.auto()
    FRAGMENT = enum.auto()
    ICMP_ERROR = enum.auto()


class CaptureConfig(AbiStruct):
    """``lb_cap_cfg[0]``: ``expires_ns`` (CLOCK_MONOTONIC) 0 is off."""

    c_name = "xdplb_capture_config"
    _fields_ = [
        ("expires_ns", ctypes.c_uint64),
        ("points", ctypes.c_uint32),
        ("sample", ctypes.c_uint32),
        ("max_per_sec", ctypes.c_uint32),
        ("snap_len", ctypes.c_uint32),
        ("dst", ctypes.c_uint32 * 4),
        ("dst_family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 7),
    ]


class CaptureState(AbiStruct):
    """``lb_cap_state`` (per CPU): the sampler, and what it could not record."""

    c_name = "xdplb_capture_state"
    _fields_ = [
        ("window_ns", ctypes.c_uint64),
        ("in_window", ctypes.c_uint32),
        ("seen", ctypes.c_uint32),
        ("records", ctypes.c_uint64),
        ("capped", ctypes.c_uint64),
        ("ring_full", ctypes.c_uint64),
    ]


class CaptureRec(AbiStruct):
    """One ``lb_capture`` ring-buffer record; ``data[:cap_len]`` is the frame's start."""

    c_name = "xdplb_capture_rec"
    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("point", ctypes.c_uint32),
        ("reason", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("rx_queue", ctypes.c_uint32),
        ("pkt_len", ctypes.c_uint32),
        ("cap_len", ctypes.c_uint32),
        ("vip_id", ctypes.c_uint32),
        ("be_id", ctypes.c_uint32),
        ("be_addr", ctypes.c_uint32 * 4),
        ("be_family", ctypes.c_uint8),
        ("nhops", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
        ("cpu", ctypes.c_uint32),
        ("data", ctypes.c_uint8 * CAP_SNAP_MAX),
    ]


STRUCTS: tuple[type[AbiStruct], ...] = (
    VipKey,
    VipInfo,
    VipSlot,
    Backend,
    FlowKey,
    ConnMeta,
    ConnEntry,
    ConnSet,
    Session,
    ExportRec,
    Bucket,
    Config,
    Stats,
    HostConfig,
    Addr,
    HcTarget,
    VipAddrInfo,
    AclKey4,
    AclKey6,
    AclRule,
    Rate,
    CaptureConfig,
    CaptureState,
    CaptureRec,
)
