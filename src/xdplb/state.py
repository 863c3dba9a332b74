"""What lb_xdp's maps hold, as plain values: one vocabulary for the planner (its input
and output), the datapath layer (what it reads and writes) and the reference model (its
state). Each type knows its C struct (``abi_key``/``abi_value``), so the bytes written to
a map are made in one place.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from xdplb import abi

IPAddress = abi.IPAddress
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

    #: Index into ``lb_tables`` and ``lb_vip_stats``.
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
    #: ``XDPLB_BACKEND_F_ACTIVE``: an inactive slot is never chosen by the table and
    #: turns a connection-table hit into ``CONN_STALE``.
    active: bool = True

    def abi_value(self) -> abi.Backend:
        return abi.Backend.make(self.addr, abi.BACKEND_F_ACTIVE if self.active else 0)

    @classmethod
    def from_abi(cls, be: abi.Backend) -> BackendState:
        return cls(abi.words_addr(be.addr, be.family), bool(be.flags & abi.BACKEND_F_ACTIVE))


@dataclass(frozen=True, eq=False)
class LookupTable:
    """A VIP's inner table of ``lb_tables``: bucket i holds ``(first[i], second[i])``.

    ``second`` is None for a table with no second hops (Maglev); a second hop of 0
    means "none" in C too.  The arrays are made read-only: tables are replaced,
    never edited (docs/datapath.md), and the model may be shared.
    """

    first: U32Array
    second: U32Array | None = None

    def __post_init__(self) -> None:
        first = np.ascontiguousarray(self.first, dtype=np.uint32)
        first.flags.writeable = False
        object.__setattr__(self, "first", first)
        if self.second is not None:
            second = np.ascontiguousarray(self.second, dtype=np.uint32)
            if second.shape != first.shape:
                raise ValueError(
                    f"second hops {second.shape} do not match first hops {first.shape}"
                )
            second.flags.writeable = False
            object.__setattr__(self, "second", second)

    def __len__(self) -> int:
        return int(self.first.shape[0])

    @classmethod
    def from_buckets(cls, buckets: U32Array) -> LookupTable:
        """From an inner map's ``(size, MAX_HOPS)`` contents; no second hop if none is set."""
        second = buckets[:, 1]
        return cls(buckets[:, 0], second if second.any() else None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LookupTable):
            return NotImplemented
        if (self.second is None) != (other.second is None):
            return False
        same_second = (
            self.second is None or other.second is None or np.array_equal(self.second, other.second)
        )
        return bool(np.array_equal(self.first, other.first) and same_second)

    __hash__ = None  # type: ignore[assignment]

    def hop_ids(self) -> set[int]:
        """Every backend id the table names, first or second hop."""
        ids = set(np.unique(self.first).tolist())
        if self.second is not None:
            ids |= set(np.unique(self.second).tolist())
        ids.discard(0)
        return ids

    def counts(self) -> dict[int, int]:
        """Buckets per first-hop backend id: each backend's share of new flows."""
        ids, counts = np.unique(self.first, return_counts=True)
        return {int(i): int(c) for i, c in zip(ids, counts, strict=True)}

    def buckets(self) -> bytes:
        """The inner map's contents as ``struct xdplb_bucket[]`` (one batch update)."""
        second = self.second if self.second is not None else np.zeros_like(self.first)
        return np.stack([self.first, second], axis=1).astype("<u4").tobytes()


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

    def abi_value(self) -> abi.Config:
        cfg = abi.Config()
        if self.src4 is not None:
            cfg.src4 = abi.addr_words(self.src4)[0]
        if self.src6 is not None:
            cfg.src6[:] = abi.addr_words(self.src6)
        cfg.gue_port = socket.htons(self.gue_port)
        cfg.hash_seed = self.seed
        return cfg

    @classmethod
    def from_abi(cls, cfg: abi.Config) -> LbConfig:
        src4 = ipaddress.IPv4Address(cfg.src4.to_bytes(4, "little")) if cfg.src4 else None
        src6 = ipaddress.IPv6Address(bytes(cfg.src6)) if any(cfg.src6) else None
        return cls(src4, src6, socket.ntohs(cfg.gue_port), cfg.hash_seed)


@dataclass(frozen=True)
class ConnEntry:
    """An entry of ``lb_conns`` (one way of a ``struct xdplb_conn_set``;
    ``xdplb.datapath.conns`` translates the sets to and from key -> entry)."""

    backend_id: int
    #: The flow hash computed when the entry was made: reused for the GUE source port.
    hash: int


@dataclass
class Snapshot:
    """Every map of lb_xdp but the connection table: what the planner plans against."""

    #: ``lb_vips``.
    vips: dict[Vip, VipParams] = field(default_factory=dict)
    #: ``lb_backends``: id -> slot; slots never used are absent.
    backends: dict[int, BackendState] = field(default_factory=dict)
    #: ``lb_tables``: vip id -> inner table.
    tables: dict[int, LookupTable] = field(default_factory=dict)
    #: ``lb_vip_addrs``: address -> number of VIPs on it.
    vip_addrs: dict[IPAddress, int] = field(default_factory=dict)
    #: ``lb_config[0]``.
    config: LbConfig = field(default_factory=lambda: LbConfig(None, None))
