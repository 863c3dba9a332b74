"""The agent's report as it travels: one JSON datagram over UDP, checked field by field.

::

    {"v": 2, "backend": "198.18.0.11", "cpu": 0.42, "rps": 812.0, "seq": 1718000000123,
     "conns": [["198.18.100.1", 80, 3, 1], ["fd78:6470:6c62:100::1", 443, 1, 0]],
     "udp": [["198.18.100.1", 53, 2]],
     "chain": {"pass": 1200, "forward": 12, ...}}

``v`` is the format's version. Version 2 (this agent's) writes each ``conns`` entry as
``[address, port, connections, of which not ESTABLISHED]`` and adds ``udp``, the
connected UDP sockets per served (address, port) (:mod:`xdplb.agent.serverconns`).
Version 1 (no ``v``: agents before it) wrote ``[address, port, connections]`` and no
``udp``; a receiver takes both, and a version-1 report leaves those counts unknown.

``seq`` counts up by one per report and starts at the wall clock in milliseconds, so a
restarted agent starts above anything its previous run sent (at under one report per ms).
``conns`` and ``udp`` hold non-zero entries only, the largest :data:`MAX_CONNS` of them
together; when there were more, ``"conns_truncated": true`` says so (an entry missing is
then unknown, not 0).
An agent always sends ``conns``, if empty: a report without it comes from an agent that
does not count (older), which a drain must not read as "no connections left". ``chain``
is absent when host_tc is not pinned.

Reports are not authenticated: bind the :class:`~xdplb.agent.receiver.ReportReceiver` to a
management address. :func:`decode_report` treats every datagram as untrusted and names the
field at fault.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from xdplb.core.addresses import IPAddress, unmap
from xdplb.core.reports import ConnKey, LoadReport

#: Largest report datagram accepted. The largest valid report (a 253-character name of
#: 4-byte UTF-8 characters, MAX_CONNS IPv6 entries, MAX_CHAIN counters) takes under 8 KiB
#: (tests/unit/test_agent.py checks it); a usual one is under 1 KiB.
MAX_DATAGRAM = 8192
#: The format this module writes; it reads 1 and 2.
WIRE_VERSION = 2
#: Longest backend identity (a DNS name's length).
MAX_NAME = 253
#: Most (address, port) entries in ``conns`` and ``udp`` together; the agent sends the
#: largest ones.
MAX_CONNS = 64
#: Largest connection count of one entry.
MAX_CONN_COUNT = 2**32 - 1
#: Most counters in ``chain``, and the form of their names (lower-case HostEvent names).
MAX_CHAIN = 32
CHAIN_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_COUNTER = 2**64 - 1
#: Longest address text in ``conns`` (a full IPv6 address in IPv4-mapped form).
_MAX_ADDR_TEXT = 45
MAX_SEQ = 2**63 - 1


@dataclass(frozen=True, slots=True)
class WireReport:
    """One report as it travels: what the agent measured, without a receive time."""

    backend: str
    """Identity of the backend, as the controller's configuration names it."""
    cpu: float
    """Cpu utilisation over the interval, 0..1."""
    rps: float
    """New TCP connections per second over the interval."""
    seq: int
    """Report number, counting up by one; the receiver drops those out of order."""
    conns: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Server-side connections per (local address, port), non-zero entries only, at most
    :data:`MAX_CONNS`; IPv4-mapped addresses are stored as IPv4. None: not counted."""
    conns_truncated: bool = False
    """There were more entries than ``conns`` holds (it has the largest)."""
    chain: Mapping[str, int] | None = field(default=None, hash=False)
    """host_tc's event counters by lower-case name; None: host_tc not pinned."""
    conns_inactive: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Of ``conns``, the connections not ESTABLISHED, non-zero entries only; None: not
    counted (a version-1 report)."""
    udp: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Connected UDP sockets per served (address, port), non-zero entries only; None: not
    counted (a version-1 report)."""

    def __post_init__(self) -> None:
        check_backend(self.backend)
        _check_number("cpu", self.cpu, 0.0, 1.0)
        _check_number("rps", self.rps, 0.0, math.inf)
        s = self.seq
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEQ:
            raise ValueError(f"seq: must be an integer in 0..{MAX_SEQ}, got {s!r}")
        if self.conns is not None:
            object.__setattr__(self, "conns", MappingProxyType(_checked_conns(self.conns)))
        if not isinstance(self.conns_truncated, bool):
            raise ValueError(
                f"conns_truncated: must be true or false, got {self.conns_truncated!r}"
            )
        if self.conns_truncated and self.conns is None:
            raise ValueError("conns_truncated: set without conns")
        if self.chain is not None:
            object.__setattr__(self, "chain", MappingProxyType(_checked_chain(self.chain)))
        if (self.conns_inactive is None) != (self.udp is None) or (
            self.udp is not None and self.conns is None
        ):
            raise ValueError("conns_inactive, udp: both or neither, and only with conns")
        if self.conns_inactive is not None and self.conns is not None:
            inactive = _checked_conns(self.conns_inactive, "conns_inactive")
            for key, n in inactive.items():
                if n > self.conns.get(key, 0):
                    raise ValueError(f"conns_inactive[{key!r}]: {n}, more than conns has")
            object.__setattr__(self, "conns_inactive", MappingProxyType(inactive))
        if self.udp is not None and self.conns is not None:
            udp = _checked_conns(self.udp, "udp")
            if len(udp) + len(self.conns) > MAX_CONNS:
                raise ValueError(f"udp: with conns, more than {MAX_CONNS} entries")
            object.__setattr__(self, "udp", MappingProxyType(udp))

    @property
    def version(self) -> int:
        """The wire format that carries this report (1: no inactive or UDP counts)."""
        return 1 if self.udp is None else WIRE_VERSION

    def received(self, at: float) -> LoadReport:
        return LoadReport(
            self.backend,
            self.cpu,
            self.rps,
            at,
            self.conns,
            self.conns_truncated,
            self.chain,
            self.conns_inactive,
            self.udp,
        )


def check_backend(v: object) -> None:
    """ValueError unless ``v`` is a backend identity: printable, 1..MAX_NAME characters."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"backend: must be a non-empty string, got {v!r}")
    if len(v) > MAX_NAME or not v.isprintable():
        raise ValueError(f"backend: must be at most {MAX_NAME} printable characters")


def _check_number(name: str, v: object, lo: float, hi: float) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"{name}: must be a number, got {v!r}")
    if not (math.isfinite(v) and lo <= v <= hi):
        raise ValueError(f"{name}: must be a finite number in {lo}..{hi}, got {v!r}")


def _check_int(where: str, v: object, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{where}: must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _checked_conns(conns: Mapping[ConnKey, int], name: str = "conns") -> dict[ConnKey, int]:
    """A normalised copy (IPv4-mapped keys as IPv4); every key and count checked."""
    if len(conns) > MAX_CONNS:
        raise ValueError(f"{name}: {len(conns)} entries, more than {MAX_CONNS}")
    out: dict[ConnKey, int] = {}
    for key, count in conns.items():
        where = f"{name}[{key!r}]"
        if not (isinstance(key, tuple) and len(key) == 2):
            raise ValueError(f"{where}: key must be (address, port)")
        addr, port = key
        if not isinstance(addr, ipaddress.IPv4Address | ipaddress.IPv6Address):
            raise ValueError(f"{where}: not an IP address")
        if isinstance(addr, ipaddress.IPv6Address) and addr.scope_id is not None:
            raise ValueError(f"{where}: an address with a zone is not a VIP")
        _check_int(f"{where} port", port, 1, 65535)
        _check_int(where, count, 1, MAX_CONN_COUNT)
        k = (unmap(addr), port)
        if k in out:
            raise ValueError(f"{where}: given twice (IPv4-mapped and not)")
        out[k] = count
    return out


def _checked_chain(chain: Mapping[str, int]) -> dict[str, int]:
    if len(chain) > MAX_CHAIN:
        raise ValueError(f"chain: {len(chain)} counters, more than {MAX_CHAIN}")
    out: dict[str, int] = {}
    for name, n in chain.items():
        if not isinstance(name, str) or not CHAIN_NAME.fullmatch(name):
            raise ValueError(f"chain: {str(name)[:40]!r} is not a counter name ([a-z][a-z0-9_]*)")
        out[name] = _check_int(f"chain.{name}", n, 0, MAX_COUNTER)
    return out


_FIELDS = ("backend", "cpu", "rps", "seq")
_OPTIONAL = ("v", "conns", "conns_truncated", "chain", "udp")


def conn_order(item: tuple[ConnKey, int]) -> tuple[int, int, int]:
    """The order of ``conns`` entries: IPv4 first, then by address and port."""
    (addr, port), _ = item
    return addr.version, int(addr), port


def encode_report(report: WireReport) -> bytes:
    doc: dict[str, object] = {} if report.version == 1 else {"v": report.version}
    doc |= {"backend": report.backend, "cpu": report.cpu, "rps": report.rps, "seq": report.seq}
    inactive = report.conns_inactive
    if report.conns is not None:
        doc["conns"] = [
            [str(a), p, n] if inactive is None else [str(a), p, n, inactive.get((a, p), 0)]
            for (a, p), n in sorted(report.conns.items(), key=conn_order)
        ]
    if report.udp is not None:
        doc["udp"] = [[str(a), p, n] for (a, p), n in sorted(report.udp.items(), key=conn_order)]
    if report.conns_truncated:
        doc["conns_truncated"] = True
    if report.chain is not None:
        doc["chain"] = dict(report.chain)
    # UTF-8 rather than \u escapes: a name's characters take at most 4 bytes, not 12.
    return json.dumps(doc, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()


def _parse_address(where: str, v: object) -> IPAddress:
    if not isinstance(v, str) or len(v) > _MAX_ADDR_TEXT or "%" in v:
        raise ValueError(f"{where}: address must be an IP address, got {str(v)[:50]!r}")
    try:
        return ipaddress.ip_address(v)
    except ValueError:
        raise ValueError(f"{where}: address must be an IP address, got {v!r}") from None


def _decode_conns(
    v: object, name: str = "conns", inactive: dict[ConnKey, int] | None = None
) -> dict[ConnKey, int]:
    """``[[address, port, count], ...]`` (with ``inactive`` given, ``[address, port,
    count, inactive]``, the fourth numbers put there), each checked and named by its index."""
    if not isinstance(v, list):
        raise ValueError(f"{name}: must be a list, got {type(v).__name__}")
    if len(v) > MAX_CONNS:
        raise ValueError(f"{name}: {len(v)} entries, more than {MAX_CONNS}")
    out: dict[ConnKey, int] = {}
    width = 3 if inactive is None else 4
    for i, entry in enumerate(v):
        where = f"{name}[{i}]"
        if not (isinstance(entry, list) and len(entry) == width):
            shape = "count" if width == 3 else "count, inactive"
            raise ValueError(f"{where}: must be [address, port, {shape}]")
        addr = unmap(_parse_address(where, entry[0]))
        port = _check_int(f"{where} port", entry[1], 1, 65535)
        count = _check_int(f"{where} count", entry[2], 1, MAX_CONN_COUNT)
        if (addr, port) in out:
            raise ValueError(f"{where}: {addr} port {port} given twice")
        out[addr, port] = count
        if inactive is not None:
            n = _check_int(f"{where} inactive", entry[3], 0, count)
            if n:
                inactive[addr, port] = n
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"datagram: {name} is not a number JSON allows")


def decode_report(data: bytes) -> WireReport:
    """Parse and check an untrusted datagram; ValueError names the field at fault."""
    if len(data) > MAX_DATAGRAM:
        raise ValueError(f"datagram: {len(data)} bytes, more than {MAX_DATAGRAM}")
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ValueError("datagram: not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"datagram: not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"datagram: must be a JSON object, got {type(doc).__name__}")
    for key in doc:
        if key not in _FIELDS and key not in _OPTIONAL:
            raise ValueError(f"{str(key)[:40]}: unknown field")
    for key in _FIELDS:
        if key not in doc:
            raise ValueError(f"{key}: missing")
    version = doc.get("v", 1)
    if version not in (1, WIRE_VERSION) or isinstance(version, bool):
        raise ValueError(f"v: version {str(version)[:20]} is not one this receiver reads (1, 2)")
    inactive: dict[ConnKey, int] | None = None
    udp: dict[ConnKey, int] | None = None
    conns = None
    if version == 1:
        if "udp" in doc:
            raise ValueError("udp: a version-1 report has none (send v: 2)")
        if "conns" in doc:
            conns = _decode_conns(doc["conns"])
    else:
        if "conns" not in doc:
            raise ValueError("conns: missing (a version-2 report counts connections)")
        inactive = {}
        conns = _decode_conns(doc["conns"], inactive=inactive)
        udp = _decode_conns(doc.get("udp", []), "udp")
    truncated = doc.get("conns_truncated", False)
    if not isinstance(truncated, bool):
        raise ValueError(f"conns_truncated: must be true or false, got {truncated!r}")
    chain = doc.get("chain")
    if "chain" in doc and not isinstance(chain, dict):
        raise ValueError(f"chain: must be an object, got {json.dumps(chain)[:40]}")
    return WireReport(
        doc["backend"], doc["cpu"], doc["rps"], doc["seq"], conns, truncated, chain, inactive, udp
    )
