"""What the agent samples from /proc, and the rates between two samples.

- cpu: the machine's cpu utilisation, 0..1, from the ``cpu`` line of /proc/stat (busy
  jiffies over all jiffies, summed over cpus; iowait counts as idle);
- rps: new TCP connections accepted per second, from ``Tcp: PassiveOpens`` in
  /proc/net/snmp. An L4 balancer does not see requests, it sees connections: a new flow is
  what the lookup table assigns, so that is the "request" it balances. The counter is per
  network namespace: run the agent in the namespace that terminates the VIP's connections.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
PROC_SNMP = Path("/proc/net/snmp")


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
