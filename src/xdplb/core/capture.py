"""What ``xdplb capture`` asks of lb_xdp and what lb_xdp answers, in plain terms.

This module owns the capture vocabulary above the ABI: :class:`CaptureSettings` (the
points, sampling, rate cap, snap length and destination filter, and the
``lb_cap_cfg`` value they make), :class:`Record` (one ring-buffer record decoded:
point, reason, backend, the frame's first bytes), the comment a record gets in pcapng
(``key=value`` words, so a reader can parse it) and the one-line summary of
``--summary``, with a small decoder of the frame's addresses and ports. Pure.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from xdplb.core import abi
from xdplb.core.addresses import IPAddress

#: Names of the points, as the CLI spells them.
POINT_NAMES: dict[str, abi.CapPoint] = {
    "drop": abi.CapPoint.DROP,
    "forward": abi.CapPoint.FORWARD,
    "pass": abi.CapPoint.PASS,
}
REC_SIZE = ctypes.sizeof(abi.CaptureRec)
_DATA_OFF = abi.CaptureRec.data.offset


def parse_points(text: str) -> abi.CapPoint:
    """``drop,forward`` -> the flags; ValueError naming an unknown point."""
    out = abi.CapPoint(0)
    for word in (w.strip() for w in text.split(",")):
        if word not in POINT_NAMES:
            raise ValueError(
                f"unknown capture point {word!r} (expected some of {', '.join(POINT_NAMES)})"
            )
        out |= POINT_NAMES[word]
    return out


def point_name(point: int) -> str:
    for name, p in POINT_NAMES.items():
        if point == p:
            return name
    return f"point{point}"


@dataclass(frozen=True)
class CaptureSettings:
    """A capture's choices. ``sample``: 1 in N packets of the chosen points, per CPU;
    ``max_per_sec``: records per second per CPU at most (0: no cap); ``dst``: only
    packets to this address (any of its VIPs)."""

    points: abi.CapPoint
    sample: int = 1
    max_per_sec: int = 1000
    snap_len: int = abi.CAP_SNAP_MAX
    dst: IPAddress | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("points: choose at least one of drop, forward, pass")
        if not 1 <= self.sample <= 0xFFFFFFFF:
            raise ValueError(f"sample: {self.sample} is not in 1..{0xFFFFFFFF}")
        if not 0 <= self.max_per_sec <= 0xFFFFFFFF:
            raise ValueError(f"max_per_sec: {self.max_per_sec} is not in 0..{0xFFFFFFFF}")
        if not 1 <= self.snap_len <= abi.CAP_SNAP_MAX:
            raise ValueError(f"snap_len: {self.snap_len} is not in 1..{abi.CAP_SNAP_MAX}")

    def abi_value(self, expires_ns: int) -> abi.CaptureConfig:
        """The ``lb_cap_cfg`` value, on until ``expires_ns`` (CLOCK_MONOTONIC)."""
        cfg = abi.CaptureConfig(
            expires_ns=expires_ns,
            points=int(self.points),
            sample=self.sample,
            max_per_sec=self.max_per_sec,
            snap_len=self.snap_len,
        )
        if self.dst is not None:
            cfg.dst[:] = abi.addr_words(self.dst)
            cfg.dst_family = abi.family_of(self.dst)
        return cfg


@dataclass(frozen=True)
class Record:
    """One capture record. ``ts_ns`` is lb_xdp's clock (CLOCK_MONOTONIC)."""

    ts_ns: int
    point: abi.CapPoint
    reason: int
    ifindex: int
    rx_queue: int
    cpu: int
    pkt_len: int
    frame: bytes
    vip_id: int | None = None
    backend_id: int | None = None
    backend: IPAddress | None = None
    hops: int = 0

    @classmethod
    def from_bytes(cls, raw: bytes) -> Record:
        """A record as lb_xdp wrote it (ValueError if it is shorter than the struct)."""
        if len(raw) < REC_SIZE:
            raise ValueError(f"capture record of {len(raw)} bytes, expected {REC_SIZE}")
        rec = abi.CaptureRec.from_buffer_copy(raw[:REC_SIZE])
        cap_len = min(rec.cap_len, abi.CAP_SNAP_MAX)
        forward = rec.point == abi.CAP_FORWARD and rec.be_family in (4, 6)
        return cls(
            ts_ns=rec.ts_ns,
            point=abi.CapPoint(rec.point),
            reason=rec.reason,
            ifindex=rec.ifindex,
            rx_queue=rec.rx_queue,
            cpu=rec.cpu,
            pkt_len=rec.pkt_len,
            frame=bytes(raw[_DATA_OFF : _DATA_OFF + cap_len]),
            vip_id=rec.vip_id if forward else None,
            backend_id=rec.be_id if forward else None,
            backend=abi.words_addr(rec.be_addr, rec.be_family) if forward else None,
            hops=rec.nhops if forward else 0,
        )

    @property
    def reason_name(self) -> str:
        """The drop reason (as ``lb_drops`` counts it), pass event or forward decision."""
        enums: dict[abi.CapPoint, type[enum.IntEnum]] = {
            abi.CapPoint.DROP: abi.DropReason,
            abi.CapPoint.PASS: abi.Event,
            abi.CapPoint.FORWARD: abi.CapDecision,
        }
        try:
            return enums[self.point](self.reason).name
        except (KeyError, ValueError):
            return str(self.reason)

    def comment(self, vips: Mapping[int, str] | None = None) -> str:
        """``point=drop reason=ACL``; a forward adds the VIP, the backend and its hops."""
        words = [f"point={point_name(self.point)}", f"reason={self.reason_name}"]
        if self.backend is not None:
            name = self._vip(vips)
            if name:
                words.append(f"vip={name}")
            words += [
                f"vip_id={self.vip_id}",
                f"backend={self.backend}",
                f"backend_id={self.backend_id}",
                f"hops={self.hops}",
            ]
        return " ".join(words)

    def _vip(self, vips: Mapping[int, str] | None) -> str | None:
        return None if vips is None or self.vip_id is None else vips.get(self.vip_id)

    def summary(self, vips: Mapping[int, str] | None = None) -> str:
        """One line: point, reason, the packet's flow, lengths, and the backend."""
        head = f"{point_name(self.point):7} {self.reason_name:14} {describe_frame(self.frame)}"
        tail = f"len {self.pkt_len}"
        if self.backend is not None:
            name = self._vip(vips)
            vip = f" vip {name}" if name else ""
            tail += f"{vip} -> backend {self.backend} (id {self.backend_id})"
        return f"{head} {tail}"


def vip_name(addr: IPAddress, port: int, proto: int) -> str:
    host = f"[{addr}]" if addr.version == 6 else str(addr)
    return f"{host}:{port}/{_proto_name(proto)}"


def _proto_name(proto: int) -> str:
    return {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp", 1: "icmp", 58: "icmpv6"}.get(
        proto, f"proto{proto}"
    )


def describe_frame(frame: bytes) -> str:
    """``198.18.5.1:40000 > 198.19.1.1:80 tcp``, or what stops the decoding."""
    if len(frame) < 14:
        return f"runt ({len(frame)} bytes)"
    (ethertype,) = struct.unpack_from("!H", frame, 12)
    off = 14
    if ethertype in (0x8100, 0x88A8) and len(frame) >= 18:
        (ethertype,) = struct.unpack_from("!H", frame, 16)
        off = 18
    src: IPAddress
    dst: IPAddress
    if ethertype == 0x0800 and len(frame) >= off + 20 and frame[off] >> 4 == 4:
        ihl = (frame[off] & 0xF) * 4
        proto = frame[off + 9]
        src = ipaddress.IPv4Address(frame[off + 12 : off + 16])
        dst = ipaddress.IPv4Address(frame[off + 16 : off + 20])
        frag = struct.unpack_from("!H", frame, off + 6)[0] & 0x3FFF
        l4 = off + max(ihl, 20) if not frag else None
    elif ethertype == 0x86DD and len(frame) >= off + 40 and frame[off] >> 4 == 6:
        proto = frame[off + 6]
        src = ipaddress.IPv6Address(frame[off + 8 : off + 24])
        dst = ipaddress.IPv6Address(frame[off + 24 : off + 40])
        l4 = off + 40
    elif ethertype in (0x0800, 0x86DD):
        return f"{'IPv4' if ethertype == 0x0800 else 'IPv6'} (malformed)"
    else:
        return f"ethertype 0x{ethertype:04x}"
    name = _proto_name(proto)
    ported = proto in (socket.IPPROTO_TCP, socket.IPPROTO_UDP)
    if l4 is not None and ported and len(frame) >= l4 + 4:
        sport, dport = struct.unpack_from("!HH", frame, l4)
        return f"{_hostport(src, sport)} > {_hostport(dst, dport)} {name}"
    return f"{src} > {dst} {name}"


def _hostport(addr: IPAddress, port: int) -> str:
    return f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}"
