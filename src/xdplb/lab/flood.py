"""A spoofed-SYN flood for the lab, at the highest rate the lab can generate.

The generator is ``bpf/lab_flood.bpf.c`` run by BPF_PROG_TEST_RUN in live-frame mode
(:func:`xdplb.datapath.live.xdp_live_frames`) on the client's ``eth0``: each
repetition rewrites a template SYN to a VIP with a random source address (within
``prefix``), source port and sequence number, and transmits it with ``XDP_TX``. No
socket, no skb, no Python per packet: two threads turn out about a million frames a
second here, or a set rate (``--pps``).

:class:`SynFlood` prepares the lab for it and runs the generator as its own process
in the client's namespace (``python -m xdplb.lab.flood``), bounded in time and count:

- XDP frames sent to a veth are dropped unless the peer runs XDP (KERNEL_NOTES):
  the bridge-side port of the client gets ``xdp_pass`` (:meth:`Lab.peer_xdp`) for as
  long as the flood is prepared (attach before measuring a baseline, so both runs see
  the same path: one where that port takes the client's GSO packets apart);
- the backends' SYN-ACKs to the spoofed sources are routed to the client, which
  drops them, as the Internet would lose them: without a route the backends would
  skip the SYN-ACK (and the SYN queue) altogether, and the flood would cost them
  nothing.

The default prefix, 198.19.0.0/16, is the half of the lab's 198.18.0.0/15 that holds
no lab host: the segment (198.18.0.0/24) and the VIPs (198.18.100.0/24) are never
spoofed, so no backend answers a node or a VIP of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

from xdplb.core import paths
from xdplb.core.errors import BpfError, LabError
from xdplb.lab.topology import IFNAME, SEGMENT4, VIP_NET4, Lab, check_lab_address

#: The template's length in bytes: what syn_template builds and lab_flood copies
#: (FLOOD_FRAME_LEN in bpf/lab_flood.bpf.c).
FRAME_LEN = 74
#: Spoofed sources by default: the lab range minus every network a lab host is on.
DEFAULT_PREFIX = ipaddress.IPv4Network("198.19.0.0/16")
#: Source ports drawn by default (the ephemeral range, as clients use).
DEFAULT_SPORTS = (1024, 65535)
#: Threads calling the generator, one batch (:data:`MAX_BATCH` frames) a call. Measured
#: here (kernel 6.18, lb_tc in the LB, whose skbs keep the frames' pages longer than
#: lb_xdp did): a call asked for many batches made the first one only and took 25 to
#: 60 ms (52,000 frames in 10 s from 71 million asked); one batch a call from two
#: threads makes about a million a second. The bounds are checked between calls.
_SENDERS = 2


def check_prefix(prefix: ipaddress.IPv4Network) -> None:
    """Refuse a spoofing prefix outside the lab or overlapping a network of its hosts."""
    check_lab_address(prefix.network_address)
    check_lab_address(prefix.broadcast_address)
    for net in (SEGMENT4, VIP_NET4):
        if prefix.overlaps(net):
            raise LabError(f"flood prefix {prefix} overlaps the lab's {net}")


def syn_template(
    src_mac: str, dst_mac: str, src: str, dst: str, dport: int, sport: int = 40000
) -> bytes:
    """An Ethernet/IPv4/TCP SYN as a Linux client sends it (MSS, SACK, timestamps,
    window scaling: 74 bytes), checksums filled in."""
    from scapy.layers.inet import IP, TCP
    from scapy.layers.l2 import Ether

    opts = [("MSS", 1360), ("SAckOK", b""), ("Timestamp", (1, 0)), ("NOP", None), ("WScale", 7)]
    pkt = (
        Ether(src=src_mac, dst=dst_mac)
        / IP(src=src, dst=dst, ttl=64, flags="DF", id=0)
        / TCP(sport=sport, dport=dport, flags="S", seq=1, window=64240, options=opts)
    )
    return bytes(pkt)


@dataclasses.dataclass(frozen=True)
class FloodResult:
    """What one generator run did."""

    #: Frames the program handed to XDP_TX (the veth may still drop some).
    sent: int
    #: Wall time of the generation, in seconds.
    seconds: float

    @property
    def pps(self) -> float:
        return self.sent / self.seconds if self.seconds > 0 else 0.0


def flood_config(frame: bytes, prefix: ipaddress.IPv4Network, sports: tuple[int, int]) -> bytes:
    """lab_flood's flood_cfg entry: the template ``frame``, the sources drawn from
    ``prefix`` and the source ports ``sports`` (first, last)."""
    check_prefix(prefix)
    lo, hi = sports
    if not 1 <= lo <= hi <= 65535:
        raise LabError(f"bad source port range {lo}..{hi}")
    if len(frame) != FRAME_LEN:
        raise LabError(f"the template is {len(frame)} bytes, lab_flood takes {FRAME_LEN}")
    span = hi - lo + 1
    return struct.pack(
        "<80s4sIHHI",
        frame,
        prefix.network_address.packed,
        (1 << (32 - prefix.prefixlen)) - 1,
        lo,
        0 if span == 65536 else span,
        0,
    )


def generate(
    ifname: str,
    frame: bytes,
    prefix: ipaddress.IPv4Network,
    sports: tuple[int, int],
    *,
    seconds: float,
    count: int,
    pps: float | None = None,
    ready: Callable[[], None] | None = None,
) -> FloodResult:
    """Run the generator in this thread's namespace until ``seconds`` have passed or
    ``count`` frames went out (whichever first), or SIGTERM/SIGINT; at ``pps`` frames a
    second or as fast as it goes, in batches of :data:`MAX_BATCH`. ``ready`` is called
    once the program is loaded, just before the first frame."""
    from xdplb.datapath import BpfObject
    from xdplb.datapath.live import MAX_BATCH, xdp_live_frames

    cfg = flood_config(frame, prefix, sports)
    stop = False

    def _stop(_sig: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    ifindex = socket.if_nametoindex(ifname)
    with BpfObject.load(paths.bpf_object("lab_flood")) as obj:
        obj.map("flood_cfg").update(bytes(4), cfg)
        prog = obj.program("lab_flood")
        sent_map = obj.map("flood_sent")
        lock = threading.Lock()
        done = 0
        errors: list[BaseException] = []

        def sender() -> None:
            nonlocal done
            try:
                while not stop:
                    with lock:
                        n = min(MAX_BATCH, count - done)
                        due = start + done / pps if pps else 0.0
                        done += max(n, 0)
                    if n <= 0 or time.monotonic() - start >= seconds:
                        return
                    if (wait := due - time.monotonic()) > 0:
                        time.sleep(wait)
                    xdp_live_frames(prog.fd, frame, ifindex=ifindex, repeat=n)
            except BpfError as exc:
                if exc.errno != 4:  # EINTR: a signal; the handler has set stop
                    errors.append(exc)

        if ready is not None:
            ready()
        start = time.monotonic()
        threads = [threading.Thread(target=sender, daemon=True) for _ in range(_SENDERS)]
        try:
            for th in threads:
                th.start()
            for th in threads:
                while th.is_alive():  # the main thread stays free for SIGTERM
                    th.join(0.05)
            elapsed = time.monotonic() - start
        finally:
            stop = True
            for s, h in old.items():
                signal.signal(s, h)
        if errors:
            raise errors[0]
        sent = sum(struct.unpack("<Q", v)[0] for v in sent_map.lookup_percpu(bytes(4)))
    return FloodResult(sent=sent, seconds=elapsed)


class SynFlood:
    """A spoofed-SYN flood from the lab's client to ``vip``:``port``.

    ``with SynFlood(lab, vip, port) as flood:`` prepares the lab (see the module
    docstring) and undoes it on exit; :meth:`start` and :meth:`wait` run the
    generator process (or :meth:`run` does both)."""

    def __init__(
        self,
        lab: Lab,
        vip: str,
        port: int,
        *,
        prefix: str | ipaddress.IPv4Network = DEFAULT_PREFIX,
        sports: tuple[int, int] = DEFAULT_SPORTS,
        node: str = "client",
    ) -> None:
        self.lab = lab
        self.vip = ipaddress.IPv4Address(vip)
        check_lab_address(self.vip)
        self.port = port
        self.prefix = ipaddress.IPv4Network(prefix)
        check_prefix(self.prefix)
        self.sports = sports
        self.node = node
        self._undo = contextlib.ExitStack()
        self._proc: subprocess.Popen[str] | None = None

    # -- preparing the lab ------------------------------------------------------------

    def __enter__(self) -> SynFlood:
        try:
            self._prepare()
        except BaseException:
            self._undo.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._undo.close()

    def _prepare(self) -> None:
        self._undo.callback(self.lab.peer_xdp(self.node))
        via = str(self.lab.addr(self.node))
        for b in self.lab.backends:
            if b == self.node:
                continue  # a spare backend host playing the attacker
            self.lab.run(b, ["ip", "route", "add", str(self.prefix), "via", via])
            self._undo.callback(
                self.lab.run, b, ["ip", "route", "del", str(self.prefix)], check=False
            )

    # -- running the generator --------------------------------------------------------

    def frame(self) -> bytes:
        """The template SYN: client MAC to the LB's, first address of the prefix."""
        return syn_template(
            self.lab.mac(self.node),
            self.lab.mac("lb"),
            str(self.prefix.network_address),
            str(self.vip),
            self.port,
        )

    def start(self, seconds: float, count: int = 1 << 40, pps: float | None = None) -> None:
        """Start the generator for at most ``seconds`` and ``count`` frames, at ``pps``
        frames a second (default: as fast as it goes); returns once it is sending."""
        if self._proc is not None:
            raise LabError("the flood is already running")
        argv = [
            sys.executable,
            "-m",
            "xdplb.lab.flood",
            "--frame",
            self.frame().hex(),
            "--prefix",
            str(self.prefix),
            "--sports",
            f"{self.sports[0]}-{self.sports[1]}",
            "--seconds",
            str(seconds),
            "--count",
            str(count),
            *(["--pps", str(pps)] if pps else []),
        ]
        self._proc = self.lab.popen(
            self.node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if line != "sending":
            err = self._proc.stderr.read() if self._proc.stderr else ""
            raise LabError(f"the flood generator did not start: {line} {err}")

    def wait(self, timeout: float = 30.0) -> FloodResult:
        """Until the generator ends; what it did."""
        if self._proc is None:
            raise LabError("the flood is not running")
        proc, self._proc = self._proc, None
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise LabError(f"the flood generator ran past {timeout} s") from None
        if proc.returncode != 0:
            raise LabError(f"the flood generator failed ({proc.returncode}): {err.strip()}")
        doc = json.loads(out)
        return FloodResult(sent=int(doc["sent"]), seconds=float(doc["seconds"]))

    def stop(self) -> FloodResult | None:
        """SIGTERM a running generator; what it did (None if none was running)."""
        if self._proc is None:
            return None
        self._proc.send_signal(signal.SIGTERM)
        return self.wait()

    def run(self, seconds: float, count: int = 1 << 40) -> FloodResult:
        """Start and wait."""
        self.start(seconds, count)
        return self.wait(timeout=seconds + 30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="spoofed-SYN flood generator (run it in a netns)")
    ap.add_argument("--frame", required=True, help="template frame, hex")
    ap.add_argument("--ifname", default=IFNAME)
    ap.add_argument("--prefix", default=str(DEFAULT_PREFIX))
    ap.add_argument("--sports", default=f"{DEFAULT_SPORTS[0]}-{DEFAULT_SPORTS[1]}")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--count", type=int, default=1 << 40)
    ap.add_argument("--pps", type=float, default=None, help="frames a second (default: all)")
    args = ap.parse_args(argv)
    lo, _, hi = args.sports.partition("-")

    def ready() -> None:
        # The caller times its window from here.
        sys.stdout.write("sending\n")
        sys.stdout.flush()

    result = generate(
        args.ifname,
        bytes.fromhex(args.frame),
        ipaddress.IPv4Network(args.prefix),
        (int(lo), int(hi)),
        seconds=args.seconds,
        count=args.count,
        pps=args.pps,
        ready=ready,
    )
    json.dump({"sent": result.sent, "seconds": result.seconds, "pps": result.pps}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
