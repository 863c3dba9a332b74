"""The load agent on each backend, and the receiver of its reports on the controller side.

Every ``interval`` the agent measures, over the interval just ended,

- cpu: the machine's cpu utilisation, 0..1, from the ``cpu`` line of /proc/stat (busy
  jiffies over all jiffies, summed over cpus; iowait counts as idle);
- rps: new TCP connections accepted per second, from ``Tcp: PassiveOpens`` in
  /proc/net/snmp. An L4 balancer does not see requests, it sees connections: a new flow is
  what the lookup table assigns, so that is the "request" it balances. The counter is per
  network namespace: run the agent in the namespace that terminates the VIP's connections.

and sends one JSON datagram to the controller over UDP::

    {"backend": "b1", "cpu": 0.42, "rps": 812.0, "seq": 1718000000123}

``seq`` counts up by one per report and starts at the wall clock in milliseconds, so a
restarted agent starts above anything its previous run sent (at under one report per ms).

Reports are not authenticated: bind the :class:`ReportReceiver` to a management address.
:func:`decode_report` treats every datagram as untrusted and names the field at fault.

Command line (exit codes: 0 stopped by SIGINT/SIGTERM, 1 runtime failure, 2 usage)::

    python -m xdplb.agent --name b1 --to 198.18.0.2:19700 --interval 1
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from xdplb.loadfeedback import LoadReport

log = logging.getLogger("xdplb.agent")

PROC_STAT = Path("/proc/stat")
PROC_SNMP = Path("/proc/net/snmp")
#: Largest report datagram accepted; a valid one is well under 400 bytes.
MAX_DATAGRAM = 1024
#: Longest backend identity (a DNS name's length).
MAX_NAME = 253
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

    def __post_init__(self) -> None:
        _check_backend(self.backend)
        _check_number("cpu", self.cpu, 0.0, 1.0)
        _check_number("rps", self.rps, 0.0, math.inf)
        s = self.seq
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEQ:
            raise ValueError(f"seq: must be an integer in 0..{MAX_SEQ}, got {s!r}")

    def received(self, at: float) -> LoadReport:
        return LoadReport(self.backend, self.cpu, self.rps, at)


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


_FIELDS = ("backend", "cpu", "rps", "seq")


def encode_report(report: WireReport) -> bytes:
    return json.dumps(
        {"backend": report.backend, "cpu": report.cpu, "rps": report.rps, "seq": report.seq},
        separators=(",", ":"),
        allow_nan=False,
    ).encode()


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
        if key not in _FIELDS:
            raise ValueError(f"{str(key)[:40]}: unknown field")
    for key in _FIELDS:
        if key not in doc:
            raise ValueError(f"{key}: missing")
    return WireReport(doc["backend"], doc["cpu"], doc["rps"], doc["seq"])


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


def run_agent(
    name: str,
    target: tuple[str, int],
    interval: float,
    stop: threading.Event,
    *,
    proc_stat: Path | str = PROC_STAT,
    proc_snmp: Path | str = PROC_SNMP,
    seq_start: int | None = None,
) -> int:
    """Report to ``target`` every ``interval`` seconds until ``stop`` is set.

    Returns the number of reports sent. A failed send (no route yet, say) is logged and
    the next interval tries again; a /proc file that cannot be read or parsed raises.
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
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
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
            data = encode_report(WireReport(name, cpu, rps, seq))
            seq = seq + 1 if seq < MAX_SEQ else 0
            try:
                sock.sendto(data, address)
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
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reports")
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
        sent = run_agent(args.name, target, args.interval, stop)
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
