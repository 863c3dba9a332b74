"""The load agent on each backend, and the receiver of its reports on the controller side.

Every ``interval`` the agent measures, over the interval just ended,

- cpu: the machine's cpu utilisation, 0..1, from the ``cpu`` line of /proc/stat (busy
  jiffies over all jiffies, summed over cpus; iowait counts as idle);
- rps: new TCP connections accepted per second, from ``Tcp: PassiveOpens`` in
  /proc/net/snmp. An L4 balancer does not see requests, it sees connections: a new flow is
  what the lookup table assigns, so that is the "request" it balances. The counter is per
  network namespace: run the agent in the namespace that terminates the VIP's connections.

and, at the end of the interval, right before sending,

- conns: the server-side TCP connections open per (local address, port), from sock_diag
  (:mod:`xdplb.serverconns`): what a drain waits on, as under direct server return only
  the backend sees connections end;
- chain: host_tc's event counters (second-hop forwards and the rest), when host_tc is
  pinned on this host under ``--host-instance``.

It sends one JSON datagram to the controller over UDP::

    {"backend": "198.18.0.11", "cpu": 0.42, "rps": 812.0, "seq": 1718000000123,
     "conns": [["198.18.100.1", 80, 3], ["fd78:6470:6c62:100::1", 443, 1]],
     "chain": {"pass": 1200, "forward": 12, ...}}

``seq`` counts up by one per report and starts at the wall clock in milliseconds, so a
restarted agent starts above anything its previous run sent (at under one report per ms).
``conns`` holds non-zero entries only, the largest :data:`MAX_CONNS` of them; when there
were more, ``"conns_truncated": true`` says so (an entry missing is then unknown, not 0).
An agent always sends ``conns``, if empty: a report without it comes from an agent that
does not count (older), which a drain must not read as "no connections left". ``chain``
is absent when host_tc is not pinned.

Reports are not authenticated: bind the :class:`ReportReceiver` to a management address.
:func:`decode_report` treats every datagram as untrusted and names the field at fault.

Command line (exit codes: 0 stopped by SIGINT/SIGTERM, 1 runtime failure, 2 usage)::

    python -m xdplb.agent --name 198.18.0.11 --to 198.18.0.2:19700 --interval 1 \
        [--host-instance host]

``--name`` is the backend's address as the LB's configuration writes it: load feedback
and drains find the backend by it.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import math
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, MappingProxyType, TracebackType
from typing import Any

from xdplb.agent.serverconns import ConnectionCounter
from xdplb.core import paths
from xdplb.core.addresses import IPAddress, unmap
from xdplb.core.errors import XdplbError
from xdplb.core.reports import ConnKey, LoadReport

log = logging.getLogger("xdplb.agent")

PROC_STAT = Path("/proc/stat")
PROC_SNMP = Path("/proc/net/snmp")
#: Largest report datagram accepted. The largest valid report (a 253-character name of
#: 4-byte UTF-8 characters, MAX_CONNS IPv6 entries, MAX_CHAIN counters) takes under 7 KiB
#: (tests/unit/test_agent.py checks it); a usual one is under 1 KiB.
MAX_DATAGRAM = 8192
#: Longest backend identity (a DNS name's length).
MAX_NAME = 253
#: Most (address, port) entries in ``conns``; the agent sends the largest ones.
MAX_CONNS = 64
#: Largest connection count of one entry.
MAX_CONN_COUNT = 2**32 - 1
#: Most counters in ``chain``, and the form of their names (lower-case HostEvent names).
MAX_CHAIN = 32
CHAIN_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_COUNTER = 2**64 - 1
#: Longest address text in ``conns`` (a full IPv6 address in IPv4-mapped form).
_MAX_ADDR_TEXT = 45
#: A report whose seq is at most this far behind the last one of its backend arrived out
#: of order (or twice) and is dropped; further behind is an agent that started over.
REORDER_WINDOW = 64
MAX_SEQ = 2**63 - 1
DEFAULT_PORT = 19700

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative cpu time of the machine since boot, in jiffies (USER_HZ)."""

    busy: int
    """user + nice + system + irq + softirq + steal."""
    total: int
    """busy + idle + iowait."""


def read_cpu_times(path: Path | str = PROC_STAT) -> CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat.

    Fields: user nice system idle iowait irq softirq steal guest guest_nice; guest time is
    already counted in user (and guest_nice in nice), so it is left out of the sum.
    """
    with open(path, encoding="ascii") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] == "cpu":
                break
        else:
            raise ValueError(f"{path}: no 'cpu' line")
    try:
        values = [int(v) for v in fields[1:9]]
    except ValueError:
        raise ValueError(f"{path}: 'cpu' line is not numbers: {line.strip()!r}") from None
    if len(values) < 4:  # pre-2.6 kernels had 4 fields; absent ones are zero
        raise ValueError(f"{path}: 'cpu' line has {len(values)} fields, expected at least 4")
    values += [0] * (8 - len(values))
    user, nice, system, idle, iowait, irq, softirq, steal = values
    busy = user + nice + system + irq + softirq + steal
    return CpuTimes(busy=busy, total=busy + idle + iowait)


def read_passive_opens(path: Path | str = PROC_SNMP) -> int:
    """``Tcp: PassiveOpens`` of /proc/net/snmp: connections accepted since boot (per netns).

    The file pairs a header line and a value line per protocol, both prefixed ``Tcp:``.
    """
    with open(path, encoding="ascii") as f:
        tcp = [line.split()[1:] for line in f if line.startswith("Tcp:")]
    if len(tcp) < 2:
        raise ValueError(f"{path}: no 'Tcp:' header and value lines")
    header, values = tcp[0], tcp[1]
    if "PassiveOpens" not in header or len(values) != len(header):
        raise ValueError(f"{path}: no 'PassiveOpens' in the 'Tcp:' lines")
    try:
        return int(values[header.index("PassiveOpens")])
    except ValueError:
        raise ValueError(f"{path}: 'PassiveOpens' is not a number") from None


@dataclass(frozen=True, slots=True)
class Sample:
    """The cumulative counters at one instant."""

    at: float
    """Monotonic clock, seconds."""
    cpu: CpuTimes
    passive_opens: int


def take_sample(
    clock: Callable[[], float] = time.monotonic,
    proc_stat: Path | str = PROC_STAT,
    proc_snmp: Path | str = PROC_SNMP,
) -> Sample:
    return Sample(clock(), read_cpu_times(proc_stat), read_passive_opens(proc_snmp))


def rates(prev: Sample, cur: Sample) -> tuple[float, float]:
    """(cpu utilisation 0..1, passive opens per second) between two samples.

    A counter that went backwards (a reset, or a namespace that was recreated) counts as
    no activity rather than as a negative rate. ``cur`` must be later than ``prev``.
    """
    dt = cur.at - prev.at
    if not dt > 0:
        raise ValueError(f"samples are not in time order: {prev.at} then {cur.at}")
    d_total = cur.cpu.total - prev.cpu.total
    d_busy = cur.cpu.busy - prev.cpu.busy
    cpu = min(max(d_busy / d_total, 0.0), 1.0) if d_total > 0 else 0.0
    rps = max(cur.passive_opens - prev.passive_opens, 0) / dt
    return cpu, rps


class Sampler:
    """Feeds samples one after another; each after the first gives the rates since the last."""

    def __init__(self) -> None:
        self._prev: Sample | None = None

    def feed(self, sample: Sample) -> tuple[float, float] | None:
        """(cpu, rps) since the previous sample; None for the first one."""
        prev, self._prev = self._prev, sample
        return None if prev is None else rates(prev, sample)


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

    def __post_init__(self) -> None:
        _check_backend(self.backend)
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

    def received(self, at: float) -> LoadReport:
        return LoadReport(
            self.backend, self.cpu, self.rps, at, self.conns, self.conns_truncated, self.chain
        )


def _check_backend(v: object) -> None:
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


def _checked_conns(conns: Mapping[ConnKey, int]) -> dict[ConnKey, int]:
    """A normalised copy (IPv4-mapped keys as IPv4); every key and count checked."""
    if len(conns) > MAX_CONNS:
        raise ValueError(f"conns: {len(conns)} entries, more than {MAX_CONNS}")
    out: dict[ConnKey, int] = {}
    for key, count in conns.items():
        where = f"conns[{key!r}]"
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
_OPTIONAL = ("conns", "conns_truncated", "chain")


def _conn_order(item: tuple[ConnKey, int]) -> tuple[int, int, int]:
    (addr, port), _ = item
    return addr.version, int(addr), port


def encode_report(report: WireReport) -> bytes:
    doc: dict[str, object] = {
        "backend": report.backend,
        "cpu": report.cpu,
        "rps": report.rps,
        "seq": report.seq,
    }
    if report.conns is not None:
        doc["conns"] = [
            [str(a), p, n] for (a, p), n in sorted(report.conns.items(), key=_conn_order)
        ]
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


def _decode_conns(v: object) -> dict[ConnKey, int]:
    """``[[address, port, count], ...]``, each checked and named by its index."""
    if not isinstance(v, list):
        raise ValueError(f"conns: must be a list, got {type(v).__name__}")
    if len(v) > MAX_CONNS:
        raise ValueError(f"conns: {len(v)} entries, more than {MAX_CONNS}")
    out: dict[ConnKey, int] = {}
    for i, entry in enumerate(v):
        where = f"conns[{i}]"
        if not (isinstance(entry, list) and len(entry) == 3):
            raise ValueError(f"{where}: must be [address, port, count]")
        addr = unmap(_parse_address(where, entry[0]))
        port = _check_int(f"{where} port", entry[1], 1, 65535)
        count = _check_int(f"{where} count", entry[2], 1, MAX_CONN_COUNT)
        if (addr, port) in out:
            raise ValueError(f"{where}: {addr} port {port} given twice")
        out[addr, port] = count
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
    conns = _decode_conns(doc["conns"]) if "conns" in doc else None
    truncated = doc.get("conns_truncated", False)
    if not isinstance(truncated, bool):
        raise ValueError(f"conns_truncated: must be true or false, got {truncated!r}")
    chain = doc.get("chain")
    if "chain" in doc and not isinstance(chain, dict):
        raise ValueError(f"chain: must be an object, got {json.dumps(chain)[:40]}")
    return WireReport(doc["backend"], doc["cpu"], doc["rps"], doc["seq"], conns, truncated, chain)


@dataclass(slots=True)
class ReceiverStats:
    """What the receiver did with the datagrams it read."""

    received: int = 0
    """Reports accepted."""
    malformed: int = 0
    """Datagrams dropped by :func:`decode_report`."""
    reordered: int = 0
    """Reports dropped as duplicates or older than one already accepted."""


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


class ReportReceiver:
    """The controller's end: a UDP socket whose :meth:`poll` never blocks."""

    def __init__(
        self,
        bind: tuple[str, int],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_batch: int = 4096,
    ) -> None:
        self._clock = clock
        self._max_batch = max_batch
        self._last_seq: dict[str, int] = {}
        self.stats = ReceiverStats()
        self._sock = socket.socket(_family(bind[0]), socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(bind)
        except OSError:
            self._sock.close()
            raise

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def fileno(self) -> int:
        """For select()/poll() by the caller's event loop."""
        return self._sock.fileno()

    def poll(self) -> list[LoadReport]:
        """The reports waiting on the socket (at most ``max_batch``), stamped with the clock."""
        out: list[LoadReport] = []
        while len(out) < self._max_batch:
            try:
                data, source = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                break
            now = self._clock()
            try:
                wire = decode_report(data)
            except ValueError as e:
                self.stats.malformed += 1
                log.debug("malformed report from %s: %s", source[0], e)
                continue
            last = self._last_seq.get(wire.backend)
            if last is not None and 0 <= last - wire.seq < REORDER_WINDOW:
                self.stats.reordered += 1
                continue
            self._last_seq[wire.backend] = wire.seq
            self.stats.received += 1
            out.append(wire.received(now))
        return out

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ReportReceiver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_chain(instance: str) -> dict[str, int] | None:
    """host_tc's event counters of ``instance`` by lower-case name (``xdplb host status``
    shows the same); None when host_tc is not pinned under that instance."""
    if not (paths.pin_root(instance) / "host_events").exists():
        return None
    from xdplb.datapath.host import events_from_pins  # libbpf only where host_tc runs

    try:
        events = events_from_pins(instance)
    except FileNotFoundError:  # unpinned since the check
        return None
    # A sum over cpus of u64 counters: clamped, never a report the agent cannot send.
    return {e.name.lower(): min(n, MAX_COUNTER) for e, n in events.items()}


def largest(
    conns: Mapping[ConnKey, int], limit: int = MAX_CONNS
) -> tuple[dict[ConnKey, int], bool]:
    """The ``limit`` largest entries (ties by address and port), and whether any were left
    out."""
    if len(conns) <= limit:
        return dict(conns), False
    order = sorted(conns.items(), key=lambda kv: (-kv[1], *_conn_order(kv)))
    return dict(order[:limit]), True


class _Measure:
    """The end-of-interval measurements besides /proc: connections and host_tc counters."""

    def __init__(
        self,
        count_conns: Callable[[], Mapping[ConnKey, int]],
        host_instance: str | None,
    ) -> None:
        self._count_conns = count_conns
        self._host_instance = host_instance
        self._chain_failing = False
        self._truncating = False

    def conns(self) -> tuple[dict[ConnKey, int], bool]:
        kept, truncated = largest(self._count_conns())
        if truncated and not self._truncating:
            log.warning("more than %d (address, port) with connections: largest sent", MAX_CONNS)
        self._truncating = truncated
        return kept, truncated

    def chain(self) -> dict[str, int] | None:
        if self._host_instance is None:
            return None
        try:
            chain = read_chain(self._host_instance)
        except (OSError, XdplbError) as e:
            # Pins there but unreadable: the report goes without them, said once.
            if not self._chain_failing:
                log.warning("host_tc counters of %r not read: %s", self._host_instance, e)
            self._chain_failing = True
            return None
        self._chain_failing = False
        return chain


def run_agent(
    name: str,
    target: tuple[str, int],
    interval: float,
    stop: threading.Event,
    *,
    proc_stat: Path | str = PROC_STAT,
    proc_snmp: Path | str = PROC_SNMP,
    seq_start: int | None = None,
    count_conns: Callable[[], Mapping[ConnKey, int]] | None = None,
    host_instance: str | None = None,
) -> int:
    """Report to ``target`` every ``interval`` seconds until ``stop`` is set.

    ``count_conns``: the server-side connections now; by default sock_diag in the calling
    thread's network namespace. ``host_instance``: whose pinned host_tc counters to add
    (None: none).

    Returns the number of reports sent. A failed send (no route yet, say) is logged and
    the next interval tries again; a /proc file that cannot be read or parsed raises, and
    so does a failed sock_diag dump.
    """
    _check_backend(name)
    if not (math.isfinite(interval) and interval > 0):
        raise ValueError(f"interval: must be a positive number of seconds, got {interval!r}")
    infos = socket.getaddrinfo(target[0], target[1], type=socket.SOCK_DGRAM)
    family, _, _, _, address = infos[0]
    seq = time.time_ns() // 1_000_000 if seq_start is None else seq_start
    sampler = Sampler()
    sampler.feed(take_sample(proc_stat=proc_stat, proc_snmp=proc_snmp))
    sent = 0
    with contextlib.ExitStack() as stack:
        if count_conns is None:
            count_conns = stack.enter_context(ConnectionCounter()).count
        measure = _Measure(count_conns, host_instance)
        sock = stack.enter_context(socket.socket(family, socket.SOCK_DGRAM))
        # A fixed schedule, not sleep(interval) after the work: reports do not drift.
        due = time.monotonic() + interval
        while not stop.wait(max(due - time.monotonic(), 0.0)):
            due += interval
            if due < time.monotonic():  # fell behind (suspended?): skip, do not burst
                due = time.monotonic() + interval
            measured = sampler.feed(take_sample(proc_stat=proc_stat, proc_snmp=proc_snmp))
            if measured is None:
                continue
            cpu, rps = measured
            # Last, right before the send: the receiver's clock then tells when it was true.
            conns, truncated = measure.conns()
            wire = WireReport(name, cpu, rps, seq, conns, truncated, measure.chain())
            seq = seq + 1 if seq < MAX_SEQ else 0
            try:
                sock.sendto(encode_report(wire), address)
            except OSError as e:
                log.warning("report to %s:%s not sent: %s", target[0], target[1], e)
                continue
            sent += 1
    return sent


def parse_target(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; the port defaults to 19700 when left out."""
    host, port = text, str(DEFAULT_PORT)
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--to: expected [address]:port, got {text!r}")
        port = rest[1:] or port
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--to: expected host:port, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m xdplb.agent", description="Report this backend's load to xdplb."
    )
    parser.add_argument("--name", required=True, help="backend identity, as the LB names it")
    parser.add_argument("--to", required=True, help="controller address, host:port")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between reports (e.g. 1, or 0.2)"
    )
    parser.add_argument(
        "--host-instance",
        default="host",
        help="host_tc instance whose counters to report, when pinned (default: host)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        target = parse_target(args.to)
    except ValueError as e:
        parser.error(str(e))  # exits 2

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sent = run_agent(args.name, target, args.interval, stop, host_instance=args.host_instance)
    except ValueError as e:
        print(f"xdplb.agent: {e}", file=sys.stderr)
        return EXIT_USAGE if str(e).startswith(("backend:", "interval:")) else EXIT_RUNTIME
    except OSError as e:
        print(f"xdplb.agent: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    log.info("stopped after %d reports", sent)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
