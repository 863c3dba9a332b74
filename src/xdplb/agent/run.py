"""The agent's loop: a sample every interval, the measurements right before sending, the send.

At the end of each interval, besides the rates of :mod:`~xdplb.agent.sampling`:

- conns: the server-side TCP connections open per (local address, port), and of them
  those not ESTABLISHED, and the connected UDP sockets of served ports, from sock_diag
  (:mod:`~xdplb.agent.serverconns`): what a drain waits on, as under direct server return
  only the backend sees connections end;
- chain: host_tc's event counters (second-hop forwards and the rest), when host_tc is
  pinned on this host under ``--host-instance``.

And, besides the report: sk_lookup steering of ``--steer-instance`` (``xdplb host steer``)
kept on live sockets: a rule whose server restarted points again at the socket the new
process bound where the old one was (:func:`follow_steering`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from xdplb.agent.sampling import PROC_SNMP, PROC_STAT, Sampler, take_sample
from xdplb.agent.serverconns import ConnectionCounter, ServerConns
from xdplb.agent.wire import (
    MAX_CONNS,
    MAX_COUNTER,
    MAX_SEQ,
    WireReport,
    check_backend,
    conn_order,
    encode_report,
)
from xdplb.core import paths
from xdplb.core.errors import XdplbError
from xdplb.core.sockdiag import bound_socket

log = logging.getLogger("xdplb.agent")  # the agent's one logger, whichever module logs

K = TypeVar("K", bound=tuple[Any, ...])


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


def largest(conns: Mapping[K, int], limit: int = MAX_CONNS) -> tuple[dict[K, int], bool]:
    """The ``limit`` largest entries (ties by key: IPv4 first, then address and port), and
    whether any were left out. Keys are (address, port), or (kind, address, port)."""
    if len(conns) <= limit:
        return dict(conns), False

    def order(kv: tuple[K, int]) -> tuple[int, ...]:
        *kind, addr, port = kv[0]
        return (-kv[1], *kind, *conn_order(((addr, port), kv[1])))

    return dict(sorted(conns.items(), key=order)[:limit]), True


def follow_steering(instance: str) -> list[str]:
    """Put back the sockets of ``instance``'s steering rules whose socket closed (a server
    restarted); returns the targets put back. Nothing when no steering is pinned."""
    from xdplb.datapath import sk_lookup  # libbpf only where steering runs

    if not sk_lookup.attached(instance):
        return []
    protocols = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}
    seated = sk_lookup.follow(
        instance, lambda t: bound_socket(t.address, t.port, protocols[t.proto])
    )
    return [str(t) for t in seated]


class _Steering:
    """follow_steering every interval, its failures logged once."""

    def __init__(self, instance: str | None) -> None:
        self._instance = instance
        self._failing = False

    def follow(self) -> None:
        if self._instance is None:
            return
        try:
            for target in follow_steering(self._instance):
                log.info("steering of %r: %s is back", self._instance, target)
        except (OSError, XdplbError) as e:
            if not self._failing:
                log.warning("steering of %r not followed: %s", self._instance, e)
            self._failing = True
            return
        self._failing = False


class _Measure:
    """The end-of-interval measurements besides /proc: connections and host_tc counters."""

    def __init__(self, count_conns: Callable[[], ServerConns], host_instance: str | None) -> None:
        self._count_conns = count_conns
        self._host_instance = host_instance
        self._chain_failing = False
        self._truncating = False

    def conns(self) -> tuple[ServerConns, bool]:
        """The counts, the largest MAX_CONNS entries of TCP and UDP together."""
        counted = self._count_conns()
        both = {(0, a, p): n for (a, p), n in counted.tcp.items()}
        both |= {(1, a, p): n for (a, p), n in counted.udp.items()}
        kept, truncated = largest(both)
        if truncated and not self._truncating:
            log.warning("more than %d (address, port) with connections: largest sent", MAX_CONNS)
        self._truncating = truncated
        tcp = {(a, p): n for (u, a, p), n in kept.items() if not u}
        udp = {(a, p): n for (u, a, p), n in kept.items() if u}
        inactive = {k: n for k, n in counted.tcp_inactive.items() if k in tcp}
        return ServerConns(tcp, inactive, udp), truncated

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
    count_conns: Callable[[], ServerConns] | None = None,
    host_instance: str | None = None,
    steer_instance: str | None = None,
) -> int:
    """Report to ``target`` every ``interval`` seconds until ``stop`` is set.

    ``count_conns``: the server-side connections now; by default sock_diag in the calling
    thread's network namespace. ``host_instance``: whose pinned host_tc counters to add
    (None: none). ``steer_instance``: whose sk_lookup steering to keep on live sockets
    (:func:`follow_steering`, every interval; None: none).

    Returns the number of reports sent. A failed send (no route yet, say) is logged and
    the next interval tries again; a /proc file that cannot be read or parsed raises, and
    so does a failed sock_diag dump.
    """
    check_backend(name)
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
        steering = _Steering(steer_instance)
        sock = stack.enter_context(socket.socket(family, socket.SOCK_DGRAM))
        # A fixed schedule, not sleep(interval) after the work: reports do not drift.
        due = time.monotonic() + interval
        while not stop.wait(max(due - time.monotonic(), 0.0)):
            due += interval
            if due < time.monotonic():  # fell behind (suspended?): skip, do not burst
                due = time.monotonic() + interval
            steering.follow()
            measured = sampler.feed(take_sample(proc_stat=proc_stat, proc_snmp=proc_snmp))
            if measured is None:
                continue
            cpu, rps = measured
            # Last, right before the send: the receiver's clock then tells when it was true.
            conns, truncated = measure.conns()
            wire = WireReport(
                name,
                cpu,
                rps,
                seq,
                conns.tcp,
                truncated,
                measure.chain(),
                conns.tcp_inactive,
                conns.udp,
            )
            seq = seq + 1 if seq < MAX_SEQ else 0
            try:
                sock.sendto(encode_report(wire), address)
            except OSError as e:
                log.warning("report to %s:%s not sent: %s", target[0], target[1], e)
                continue
            sent += 1
    return sent
