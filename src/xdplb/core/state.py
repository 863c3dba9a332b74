"""What lb_xdp's maps hold, as plain values: one vocabulary for the planner (its input
and output), the datapath layer (what it reads and writes) and the reference model (its
state). Each type knows its C struct (``abi_key``/``abi_value``), so the bytes written to
a map are made in one place.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, hashing
from xdplb.core.acl import AclKey
from xdplb.core.addresses import IPAddress

U32Array = npt.NDArray[np.uint32]


@dataclass(frozen=True)
class Vip:
    """An ``lb_vips`` key: (address, port, protocol); ``port == 0`` is the wildcard."""

    addr: IPAddress
    #: Host order; 0 matches every port of (addr, proto) that has no exact entry.
    port: int
    #: ``IPPROTO_TCP`` or ``IPPROTO_UDP``.
    proto: int

    def abi_key(self) -> abi.VipKey:
        """The C key, for writing this VIP into the real map."""
        return abi.VipKey.make(self.addr, self.port, self.proto)

    @classmethod
    def from_abi(cls, key: abi.VipKey) -> Vip:
        return cls(abi.words_addr(key.addr, key.family), socket.ntohs(key.port), key.proto)


@dataclass(frozen=True)
class VipParams:
    """An ``lb_vips`` value (``struct xdplb_vip_info``)."""

    #: Index into ``lb_tables`` (Maglev) or ``lb_btables`` (Beamer), and ``lb_vip_stats``.
    vip_id: int
    #: ``abi.VIP_F_*``; ``VIP_F_SRC_HASH`` hashes the source address only.
    flags: int = 0
    #: Buckets of the VIP's table: the hash is taken modulo this, not modulo the
    #: inner map's real size (a bucket beyond the inner map is "missing"); 0 counts
    #: as "no table".
    table_size: int = abi.DEFAULT_TABLE_SIZE
    encap: abi.Encap = abi.Encap.GUE
    table_kind: abi.TableKind = abi.TableKind.MAGLEV

    def abi_value(self) -> abi.VipInfo:
        return abi.VipInfo(self.vip_id, self.flags, self.table_size, self.encap, self.table_kind)

    @classmethod
    def from_abi(cls, info: abi.VipInfo) -> VipParams:
        return cls(
            info.vip_id,
            info.flags,
            info.table_size,
            abi.Encap(info.encap),
            abi.TableKind(info.table_kind),
        )


@dataclass(frozen=True)
class BackendState:
    """An ``lb_backends`` slot (``struct xdplb_backend``)."""

    #: Tunnel endpoint; its family is the outer header's family.
    addr: IPAddress
    #: ``XDPLB_BACKEND_F_ACTIVE``: an inactive slot is never chosen by a table nor sent
    #: to as a later hop; its TCP sessions still reach it (its address stays).
    active: bool = True
    #: Bumped (mod 256) each time the slot is given to another address: a session
    #: recorded under another gen names someone else's slot and is stale.
    gen: int = 0

    def abi_value(self) -> abi.Backend:
        return abi.Backend.make(self.addr, abi.BACKEND_F_ACTIVE if self.active else 0, self.gen)

    @classmethod
    def from_abi(cls, be: abi.Backend) -> BackendState:
        return cls(
            abi.words_addr(be.addr, be.family), bool(be.flags & abi.BACKEND_F_ACTIVE), be.gen
        )


@dataclass(frozen=True, eq=False)
class LookupTable:
    """A VIP's lookup table: bucket i holds the hops ``(first[i], *rest[i])``.

    In the maps a Maglev table is an inner map of ``lb_tables`` holding ``first`` only
    (``__u32`` per bucket, :meth:`first_hops`), a Beamer table an inner map of
    ``lb_btables`` (``struct xdplb_bucket``, ``abi.MAX_HOPS`` ids, :meth:`buckets`).

    ``first`` is where new flows go.  ``rest`` (shape ``(B, MAX_HOPS - 1)``) holds the
    later hops of a Beamer table -- the bucket's previous first hops, most recent first
    -- with 0 for "none", as in C; it is None when no bucket has one (Maglev), and a
    ``rest`` given with no non-zero entry is stored as None, so tables compare by
    content.  A ``rest`` of shape ``(B,)`` or ``(B, k)`` with ``k < MAX_HOPS - 1`` is
    padded with zeros.  The arrays are made read-only: tables are replaced, never
    edited (docs/datapath.md), and the model may be shared.
    """

    first: U32Array
    rest: U32Array | None = None

    def __post_init__(self) -> None:
        first = np.ascontiguousarray(self.first, dtype=np.uint32)
        first.flags.writeable = False
        object.__setattr__(self, "first", first)
        if self.rest is None:
            return
        rest = np.asarray(self.rest, dtype=np.uint32)
        if rest.ndim == 1:
            rest = rest[:, None]
        width = abi.MAX_HOPS - 1
        if rest.ndim != 2 or rest.shape[0] != first.shape[0] or not 1 <= rest.shape[1] <= width:
            raise ValueError(
                f"later hops {rest.shape} do not match first hops {first.shape} "
                f"(at most {width} per bucket)"
            )
        if not rest.any():
            object.__setattr__(self, "rest", None)
            return
        padded = np.zeros((first.shape[0], width), dtype=np.uint32)
        padded[:, : rest.shape[1]] = rest
        padded.flags.writeable = False
        object.__setattr__(self, "rest", padded)

    def __len__(self) -> int:
        return int(self.first.shape[0])

    @classmethod
    def from_buckets(cls, buckets: U32Array) -> LookupTable:
        """From an inner map's ``(size, MAX_HOPS)`` contents; ``rest`` None if all 0."""
        return cls(buckets[:, 0], buckets[:, 1:])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupTable):
            return NotImplemented
        if (self.rest is None) != (other.rest is None):
            return False
        same_rest = self.rest is None or other.rest is None or np.array_equal(self.rest, other.rest)
        return bool(np.array_equal(self.first, other.first) and same_rest)

    __hash__ = None  # type: ignore[assignment]

    def hop_ids(self) -> set[int]:
        """Every backend id the table names, at any hop."""
        ids = set(np.unique(self.first).tolist())
        if self.rest is not None:
            ids |= set(np.unique(self.rest).tolist())
        ids.discard(0)
        return ids

    def hops(self, bucket: int) -> tuple[int, ...]:
        """Bucket ``bucket``'s hops as stored: the first, then the non-zero later ones."""
        first = int(self.first[bucket])
        if self.rest is None:
            return (first,)
        return (first, *(int(h) for h in self.rest[bucket] if h))

    def counts(self) -> dict[int, int]:
        """Buckets per first-hop backend id: each backend's share of new flows."""
        ids, counts = np.unique(self.first, return_counts=True)
        return {int(i): int(c) for i, c in zip(ids, counts, strict=True)}

    def first_hops(self) -> bytes:
        """A Maglev inner map's contents (``lb_tables``): ``__u32[]`` of first hops.

        A Maglev table has no later hops (:meth:`contents` refuses one that has)."""
        return self.first.astype("<u4", copy=False).tobytes()

    def buckets(self) -> bytes:
        """A Beamer inner map's contents (``lb_btables``) as ``struct xdplb_bucket[]``."""
        out = np.zeros((len(self), abi.MAX_HOPS), dtype="<u4")
        out[:, 0] = self.first
        if self.rest is not None:
            out[:, 1:] = self.rest
        return out.tobytes()

    def contents(self, kind: abi.TableKind) -> bytes:
        """The inner map's contents for a table of ``kind`` (one batch update)."""
        if kind is abi.TableKind.BEAMER:
            return self.buckets()
        if self.rest is not None:
            raise ValueError("a Maglev table has no later hops")
        return self.first_hops()

    @classmethod
    def from_contents(cls, kind: abi.TableKind, raw: bytes) -> LookupTable:
        """From an inner map's contents, as :meth:`contents` writes them."""
        if kind is abi.TableKind.BEAMER:
            return cls.from_buckets(np.frombuffer(raw, dtype="<u4").reshape(-1, abi.MAX_HOPS))
        return cls(np.frombuffer(raw, dtype="<u4"))


#: Default idle timeouts by session state (UDP, TCP after SYN, established, closing), in
#: seconds: IPVS's udp, syn_recv, established and fin_wait.
DEFAULT_TIMEOUTS = (300.0, 60.0, 900.0, 120.0)


def session_age(last_seen: int, now: int) -> int:
    """Ticks since ``last_seen`` at ``now`` (both ``__u32`` jiffies): a signed difference,
    so that ticks wrap and a stamp ahead of ``now`` (another CPU's, an import's) counts
    as just seen, as lb_sess_age() in bpf/lib/lb_conns.h."""
    return max(0, ((now - last_seen + 0x80000000) & 0xFFFFFFFF) - 0x80000000)


#: The kernel's HZ where none was measured (the session clock ticks in jiffies): Debian's.
DEFAULT_HZ = 250


def timeout_ticks(seconds: float, hz: int) -> int:
    """A timeout in session-table ticks (jiffies, ``hz`` a second), rounded up."""
    return min(-(-round(seconds * hz * 1000) // 1000), 0x7FFFFFFF)


DEFAULT_TIMEOUT_TICKS = tuple(timeout_ticks(s, DEFAULT_HZ) for s in DEFAULT_TIMEOUTS)


@dataclass(frozen=True)
class LbConfig:
    """``lb_config[0]`` (``struct xdplb_config``)."""

    #: Outer source for IPv4 tunnels; None (all zero in C) makes them drop ``NO_CONFIG``.
    src4: ipaddress.IPv4Address | None
    #: Outer source for IPv6 tunnels; None likewise.
    src6: ipaddress.IPv6Address | None
    #: GUE destination UDP port, host order.
    gue_port: int = abi.GUE_PORT
    #: The flow hash's seed (``hash_seed``).
    seed: int = 0
    #: ``lb_conns``' set count - 1 (a power of 2, minus one).
    conn_mask: int = abi.CONN_SETS - 1
    #: Connection-table inserts per CPU per ``FLOOD_WINDOW_NS``; 0: no limit.
    flood_max: int = abi.DEFAULT_FLOOD_MAX
    #: ``CFG_F_*``.
    flags: int = 0
    #: New flows per second per source prefix (0: off), the bucket's depth, and the
    #: prefix lengths the limit keys on.
    rl_rate: int = 0
    rl_burst: int = 0
    rl_prefix4: int = 32
    rl_prefix6: int = 64
    #: The session generation: sessions of another one are misses (a flush moves it on).
    conn_gen: int = 0
    #: Idle timeout of a session by its state (``abi.SessState``), in ticks.
    conn_timeouts: tuple[int, ...] = DEFAULT_TIMEOUT_TICKS
    #: ``lb_vip_index``'s slots - 1.
    vip_index_mask: int = 8 * abi.MAX_VIPS - 1
    #: Ticks a second (the kernel's HZ), so user space can read ages and timeouts.
    hz: int = DEFAULT_HZ
    #: What the self-check's probe packet carries (``xdplb.cluster.probe``); 0: no
    #: packet is a probe. The maps' own, like ``conn_gen``: plans keep it.
    probe_key: int = 0

    def abi_value(self) -> abi.Config:
        cfg = abi.Config()
        if self.src4 is not None:
            cfg.src4 = abi.addr_words(self.src4)[0]
        if self.src6 is not None:
            cfg.src6[:] = abi.addr_words(self.src6)
        cfg.gue_port = socket.htons(self.gue_port)
        cfg.hash_seed = self.seed
        cfg.sess_key[:] = hashing.sess_keys(self.seed)
        cfg.conn_mask = self.conn_mask
        cfg.flood_max = self.flood_max
        cfg.flags = self.flags
        cfg.rl_rate = self.rl_rate
        cfg.rl_burst = self.rl_burst
        cfg.rl_prefix4 = self.rl_prefix4
        cfg.rl_prefix6 = self.rl_prefix6
        cfg.conn_gen = self.conn_gen
        cfg.conn_timeout[:] = self.conn_timeouts
        cfg.vip_index_mask = self.vip_index_mask
        cfg.hz = self.hz
        cfg.probe_key = self.probe_key
        return cfg

    @classmethod
    def from_abi(cls, cfg: abi.Config) -> LbConfig:
        src4 = ipaddress.IPv4Address(cfg.src4.to_bytes(4, "little")) if cfg.src4 else None
        src6 = ipaddress.IPv6Address(bytes(cfg.src6)) if any(cfg.src6) else None
        return cls(
            src4,
            src6,
            socket.ntohs(cfg.gue_port),
            cfg.hash_seed,
            cfg.conn_mask,
            cfg.flood_max,
            cfg.flags,
            cfg.rl_rate,
            cfg.rl_burst,
            cfg.rl_prefix4,
            cfg.rl_prefix6,
            cfg.conn_gen,
            tuple(cfg.conn_timeout),
            cfg.vip_index_mask,
            cfg.hz,
            cfg.probe_key,
        )


@dataclass(frozen=True)
class ConnEntry:
    """A session of ``lb_conns`` (``struct xdplb_session``; ``xdplb.datapath.conns``
    reads and writes the real ones)."""

    backend_id: int
    #: The table hash computed when the session was made: reused for the GUE source port.
    hash: int
    #: Later hops (Beamer) recorded with it: a mid-connection TCP flow's bucket hops.
    later: tuple[int, ...] = ()
    state: abi.SessState = abi.SessState.UDP
    #: The backend slot's gen when recorded.
    be_gen: int = 0
    #: The session generation it was written in.
    gen: int = 0
    #: Ticks of its last packet; None: fresh whatever the clock.
    last_seen: int | None = None


@dataclass(frozen=True)
class VipAddrInfo:
    """An ``lb_vip_addrs`` value (``struct xdplb_vip_addr_info``): what lb_xdp knows of a
    VIP address for packets whose port it cannot use (fragments, ICMP)."""

    #: VIPs on the address.
    nvips: int = 1
    #: The port of the TCP VIP that gets the address's TCP fragments (0: the wildcard),
    #: None: no TCP VIP does (they drop ``FRAGMENT``).
    frag_tcp: int | None = None
    #: Likewise for UDP.
    frag_udp: int | None = None
    #: Echo requests to the address are answered by lb_xdp.
    echo: bool = False

    def frag_port(self, proto: int) -> int | None:
        """The VIP port of ``proto``'s fragments, or None."""
        return self.frag_tcp if proto == abi.IPPROTO_TCP else self.frag_udp

    def abi_value(self) -> abi.VipAddrInfo:
        info = abi.VipAddrInfo(self.nvips)
        if self.frag_tcp is not None:
            info.flags |= abi.VIP_ADDR_F_FRAG_TCP
            info.frag_port[0] = socket.htons(self.frag_tcp)
        if self.frag_udp is not None:
            info.flags |= abi.VIP_ADDR_F_FRAG_UDP
            info.frag_port[1] = socket.htons(self.frag_udp)
        if self.echo:
            info.flags |= abi.VIP_ADDR_F_ECHO
        return info

    @classmethod
    def from_abi(cls, info: abi.VipAddrInfo) -> VipAddrInfo:
        tcp = info.flags & abi.VIP_ADDR_F_FRAG_TCP
        udp = info.flags & abi.VIP_ADDR_F_FRAG_UDP
        return cls(
            info.nvips,
            socket.ntohs(info.frag_port[0]) if tcp else None,
            socket.ntohs(info.frag_port[1]) if udp else None,
            bool(info.flags & abi.VIP_ADDR_F_ECHO),
        )


def fragment_vip(vips: Iterable[Vip], chosen: Iterable[Vip] = ()) -> Vip | None:
    """Which of one address's VIPs of one protocol gets its fragments (their port is
    unknown): the one ``chosen`` (the config's ``fragments: true``), else the port-0
    wildcard, else the only one; None when several VIPs leave it open."""
    vips = list(vips)
    picked = [v for v in chosen if v in vips]
    if picked:
        return picked[0]
    wild = [v for v in vips if v.port == 0]
    if wild:
        return wild[0]
    return vips[0] if len(vips) == 1 else None


def vip_addr_infos(
    vips: Iterable[Vip], *, chosen: Iterable[Vip] = (), echo: Iterable[IPAddress] = ()
) -> dict[IPAddress, VipAddrInfo]:
    """``lb_vip_addrs`` for a set of VIPs: one entry per address, with its fragments'
    VIP per protocol (:func:`fragment_vip`) and echo when the address is in ``echo``."""
    by_addr: dict[IPAddress, list[Vip]] = {}
    for v in vips:
        by_addr.setdefault(v.addr, []).append(v)
    chosen, echo = list(chosen), set(echo)
    out = {}
    for addr, on in by_addr.items():
        tcp = fragment_vip([v for v in on if v.proto == abi.IPPROTO_TCP], chosen)
        udp = fragment_vip([v for v in on if v.proto == abi.IPPROTO_UDP], chosen)
        out[addr] = VipAddrInfo(
            len(on),
            tcp.port if tcp is not None else None,
            udp.port if udp is not None else None,
            addr in echo,
        )
    return out


def member_words(states: Mapping[int, abi.MemberState], words: int) -> npt.NDArray[np.uint64]:
    """An ``lb_members`` inner map's contents: two bits per backend id, ``words`` words."""
    out = np.zeros(words, dtype=np.uint64)
    for bid, st in states.items():
        w, b = divmod(bid, abi.MEMBERS_PER_WORD)
        if st and w < words:
            out[w] |= np.uint64(int(st) << (2 * b))
    return out


def member_states(raw: bytes) -> dict[int, abi.MemberState]:
    """The states an ``lb_members`` inner map holds (NONE left out)."""
    out = {}
    for w, word in enumerate(np.frombuffer(raw, dtype="<u8")):
        word = int(word)
        while word:
            low = (word & -word).bit_length() - 1
            b = low // 2
            st = (word >> (2 * b)) & 3
            out[w * abi.MEMBERS_PER_WORD + b] = abi.MemberState(st)
            word &= ~(3 << (2 * b))
    return out


class VipIndexFull(ValueError):
    """A VIP key found no free slot within ``VIP_PROBES`` of its home in lb_vip_index."""


def vip_index_slots(vips: Mapping[Vip, VipParams], slots: int) -> bytes:
    """``lb_vip_index``'s table for these VIPs: ``slots`` (a power of 2) ``struct
    xdplb_vip_slot``, each key at the first free slot from its home on (linear probing,
    as lb_vip_find() searches)."""
    table = (abi.VipSlot * slots)()
    for vip, params in sorted(vips.items(), key=lambda kv: bytes(kv[0].abi_key())):
        key = vip.abi_key()
        words = np.frombuffer(bytes(key), dtype="<u4")
        home = hashing.vip_slot_hash((int(w) for w in words[:4]), int(words[4]))
        for i in range(abi.VIP_PROBES):
            slot = table[(home + i) & (slots - 1)]
            if not slot.key.family:
                slot.key = key
                slot.info = params.abi_value()
                break
        else:
            raise VipIndexFull(f"no free slot for {vip} within {abi.VIP_PROBES} of its home")
    return bytes(table)


def filter_bits(addrs: Iterable[IPAddress]) -> frozenset[int]:
    """The ``lb_vip_filter`` bits of a set of VIP addresses."""
    return frozenset(hashing.addr_filter_bit(a.packed) for a in addrs)


def filter_words(bits: Iterable[int]) -> npt.NDArray[np.uint64]:
    """``lb_vip_filter``'s contents with exactly ``bits`` set."""
    out = np.zeros(abi.VIP_FILTER_WORDS, dtype=np.uint64)
    for b in bits:
        out[b // 64] |= np.uint64(1 << (b % 64))
    return out


@dataclass
class Snapshot:
    """Every map of lb_xdp but the connection table: what the planner plans against."""

    #: ``lb_vips``.
    vips: dict[Vip, VipParams] = field(default_factory=dict)
    #: ``lb_backends``: id -> slot; slots never used are absent.
    backends: dict[int, BackendState] = field(default_factory=dict)
    #: ``lb_tables`` and ``lb_btables`` together: vip id -> inner table (vip ids are
    #: unique across both; the VIP's ``table_kind`` says which map holds it).
    tables: dict[int, LookupTable] = field(default_factory=dict)
    #: ``lb_vip_addrs``: address -> what lb_xdp knows of it.
    vip_addrs: dict[IPAddress, VipAddrInfo] = field(default_factory=dict)
    #: ``lb_config[0]``.
    config: LbConfig = field(default_factory=lambda: LbConfig(None, None))
    #: ``lb_acl4`` and ``lb_acl6``: every scope's source prefix rules.
    acl: dict[AclKey, abi.AclList] = field(default_factory=dict)
    #: ``lb_members``: vip id -> backend id -> its state in the VIP (NONE left out).
    members: dict[int, dict[int, abi.MemberState]] = field(default_factory=dict)
    #: ``lb_vip_filter``: the bits set (``hashing.addr_filter_bit`` of VIP addresses).
    vip_filter: frozenset[int] = frozenset()
