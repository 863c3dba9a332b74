"""``xdplb capture``: sample what lb_xdp drops, forwards and passes, as pcapng or lines.

This module owns the command: it reads the instance's pinned capture maps
(:mod:`xdplb.datapath.capture`), turns sampling on for its run (an expiry renewed every
second; off again when it ends, is interrupted or terminated, and by itself within
:data:`~xdplb.datapath.capture.LEASE_NS` when it is killed), and writes each record as
an enhanced packet block whose comment says what lb_xdp did (:mod:`xdplb.core.pcapng`),
or prints a summary line per packet. Messages that carry data are printed without markup.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Annotated, BinaryIO

import typer

from xdplb.cli.args import (
    EXIT_CONFIG,
    EXIT_NOT_RUNNING,
    EXIT_RUNTIME,
    InstanceOpt,
    OptConfigOpt,
    instance_name,
    usage_error,
)
from xdplb.cli.client import parse_backend, parse_vip
from xdplb.core import abi, pcapng
from xdplb.core.addresses import IPAddress
from xdplb.core.capture import CaptureSettings, Record, parse_points
from xdplb.core.errors import XdplbError
from xdplb.datapath.capture import CaptureBusy, CaptureMaps, capture_lock, monotonic_ns
from xdplb.datapath.layout import pins_dir

#: How often the expiry is pushed on while the capture runs.
RENEW_S = 1.0
#: The longest one wait on the ring lasts (the deadline and --count are checked after it).
POLL_S = 0.2


class _Stop(Exception):
    """SIGTERM or SIGHUP: end the capture as Ctrl-C does."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _vip_filter(text: str) -> IPAddress:
    """``--vip``: an address, or a VIP whose address is taken."""
    try:
        return parse_backend(text)
    except ValueError:
        pass
    try:
        addr: IPAddress = parse_vip(text).address
        return addr
    except ValueError:
        raise usage_error(
            f"invalid --vip: {text!r} is neither an address nor ADDRESS:PORT/PROTOCOL"
        ) from None


class _Pcapng:
    """A pcapng stream: the section header once, an interface block per ingress device."""

    def __init__(self, out: BinaryIO, snaplen: int) -> None:
        self.out = out
        self.snaplen = snaplen
        self.ifaces: dict[int, int] = {}
        out.write(pcapng.section_header())

    def write(self, rec: Record, wall_ns: int, comment: str) -> None:
        iface = self.ifaces.get(rec.ifindex)
        if iface is None:
            iface = self.ifaces[rec.ifindex] = len(self.ifaces)
            try:
                name = socket.if_indextoname(rec.ifindex)
            except OSError:
                name = f"ifindex{rec.ifindex}"
            self.out.write(pcapng.interface(name, self.snaplen))
        self.out.write(pcapng.packet(iface, wall_ns, rec.frame, rec.pkt_len, comment))
        self.out.flush()


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[BinaryIO | None]:
    if path is None:
        yield None
    elif str(path) == "-":
        yield sys.stdout.buffer
    else:
        with path.open("wb") as f:
            yield f


def capture(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    points: Annotated[
        str, typer.Option("--points", "-p", help="what to record: drop, forward, pass (a list)")
    ] = "drop",
    vip: Annotated[
        str | None,
        typer.Option("--vip", help="only packets to this address (or this VIP's address)"),
    ] = None,
    sample: Annotated[
        int, typer.Option("--sample", help="record 1 in N packets of those points, per CPU")
    ] = 1,
    max_rate: Annotated[
        int, typer.Option("--max-rate", help="records per second per CPU at most (0: no cap)")
    ] = 1000,
    snaplen: Annotated[
        int, typer.Option("--snaplen", help=f"bytes of each frame, 1..{abi.CAP_SNAP_MAX}")
    ] = abi.CAP_SNAP_MAX,
    seconds: Annotated[float | None, typer.Option("--seconds", help="stop after this long")] = None,
    count: Annotated[int | None, typer.Option("--count", help="stop after N packets")] = None,
    write: Annotated[
        Path | None, typer.Option("--write", "-w", help="pcapng file ('-': stdout)")
    ] = None,
    summary: Annotated[
        bool, typer.Option("--summary", help="a line per packet (the default without -w)")
    ] = False,
) -> None:
    """Sample packets at lb_xdp's drop, forward and pass points.

    A record says what lb_xdp did: the drop reason, the pass event, or the backend chosen.

    pcapng carries it as each packet's comment; --summary prints it on a line.

    Sampling is on only while the command runs; a killed capture stops within 5 s.

    Example: xdplb capture -i lb1 -p drop,forward --vip 198.18.100.1 --seconds 10 -w x.pcapng
    """
    try:
        settings = CaptureSettings(
            parse_points(points),
            sample=sample,
            max_per_sec=max_rate,
            snap_len=snaplen,
            dst=None if vip is None else _vip_filter(vip),
        )
    except ValueError as e:
        raise usage_error(f"invalid option: {e}") from None
    if seconds is not None and seconds <= 0:
        raise usage_error(f"invalid --seconds: {seconds} is not > 0")
    if count is not None and count <= 0:
        raise usage_error(f"invalid --count: {count} is not > 0")
    if write is not None and str(write) == "-" and summary:
        raise usage_error("invalid options: --summary and -w - both write to stdout")
    name = instance_name(config, instance)
    try:
        maps = CaptureMaps.from_pins(pins_dir(name))
    except FileNotFoundError as e:
        typer.echo(f"instance {name} is not running: {e}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except XdplbError as e:  # pins of another layout (datapath.layout.LayoutMismatch)
        typer.echo(f"cannot read the pins: {e}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with capture_lock(name), maps, _output(write) as out:
            n = _run(maps, settings, out, summary or write is None, seconds, count)
            stats = maps.stats()
    except CaptureBusy as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    except XdplbError as e:
        typer.echo(f"capture failed: {e}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    except OSError as e:
        typer.echo(f"capture failed: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG if write is not None else EXIT_RUNTIME) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    typer.echo(
        f"{n} packets captured; lb_xdp recorded {stats.records}, "
        f"{stats.capped} over --max-rate, {stats.ring_full} lost (ring full)",
        err=True,
    )


def _run(
    maps: CaptureMaps,
    settings: CaptureSettings,
    out: BinaryIO | None,
    lines: bool,
    seconds: float | None,
    count: int | None,
) -> int:
    """Records until the deadline, the count, Ctrl-C, SIGTERM or SIGHUP; sampling off after."""
    pcap = None if out is None else _Pcapng(out, settings.snap_len)
    vips = maps.vip_names()
    wall = time.time_ns() - monotonic_ns()
    n = 0
    maps.start(settings, seconds)
    start = renewed = time.monotonic()
    try:
        while count is None or n < count:
            now = time.monotonic()
            if seconds is not None and now - start >= seconds:
                break
            if now - renewed >= RENEW_S:
                maps.renew()
                renewed = now
            left = POLL_S if seconds is None else min(POLL_S, seconds - (now - start))
            for rec in maps.read(max(left, 0), None if count is None else count - n):
                n += 1
                if pcap is not None:
                    pcap.write(rec, wall + rec.ts_ns, rec.comment(vips))
                if lines:
                    when = datetime.fromtimestamp((wall + rec.ts_ns) / 1e9).strftime("%H:%M:%S.%f")
                    typer.echo(f"{when} {rec.summary(vips)}")
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        maps.stop()
    return n
