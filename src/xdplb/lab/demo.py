"""``make demo``: the lab, real traffic through the balancer, and what a backend removal moves.

1. builds the lab (client, LB, three backends in network namespaces), attaches host_tc
   on the backends and starts a real server on each;
2. starts the real ``xdplb run`` daemon on the LB (weights 2:1:1);
3. sends HTTP requests, UDP exchanges and IPv6 requests from the client to the VIPs and
   shows where they landed next to each backend's weight and table share;
4. removes one backend and replays the same flows: only the removed backend's flows
   move, as Maglev and the connection table promise;
5. kills a backend's server: the health checks take it out of the table;
6. denies the client's prefix on a VIP with a live ACL, then lets it back in;
7. with ``--keep`` (``make demo KEEP=1``): keeps the lab up, forwards the host's
   127.0.0.1:9180 to the daemon's API socket, and prints how to reach the status page,
   the CLI and the VIPs, until Ctrl-C;
8. tears everything down (:func:`demo_lab`): the daemon, its pins and its run files.

Every line that carries data is printed with Rich's markup off: an IPv6 VIP in square
brackets is text, not a style.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import ExchangeError, http_post, udp_exchange

VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
WEIGHTS = {"b1": 2, "b2": 1, "b3": 1}
FLOWS = range(20000, 20300)

#: The host's loopback port forwarded to the daemon's API socket in --keep mode.
KEEP_PORT = 9180

console = Console()


def say(text: str) -> None:
    """Print data as it is: no Rich markup, no highlighting."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


#: HTTP checks through the tunnel, every 300 ms; down after 2 failures.
HEALTH = {"checker": {"http": {"uri": "/", "codes": [200]}}, "interval_ms": 300, "timeout_ms": 200}


def _vips(lab: Lab, names: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "address": VIP4,
            "port": 80,
            "health": HEALTH,
            "backends": [{"address": str(lab.addr(n)), "weight": WEIGHTS[n]} for n in names],
        },
        {
            "address": VIP4,
            "port": 53,
            "protocol": "udp",
            "backends": [{"address": str(lab.addr(n))} for n in names],
        },
        {
            "address": VIP6,
            "port": 80,
            "backends": [{"address": str(lab.addr(n, 6))} for n in names],
        },
    ]


def _run(label: str, ports: range, fn: Callable[[int], str]) -> dict[int, str]:
    out: dict[int, str] = {}
    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task(label, total=len(ports))
        for port in ports:
            out[port] = fn(port)
            progress.advance(task)
    return out


def _shares(lb: LbNode) -> dict[str, float]:
    """Table share per backend address for the TCP VIP, from the live maps."""
    maps = lb.maps()
    try:
        snap = maps.snapshot()
    finally:
        maps.close()
    vip_id = next(p.vip_id for v, p in snap.vips.items() if str(v.addr) == VIP4 and v.port == 80)
    table = snap.tables[vip_id]
    return {str(snap.backends[i].addr): c / len(table) for i, c in table.counts().items()}


def _table(title: str, lab: Lab, lb: LbNode, landed: dict[str, Counter[str]]) -> Table:
    shares = _shares(lb)
    t = Table(title=Text(title))
    t.add_column("backend")
    t.add_column("weight", justify="right")
    t.add_column("table share", justify="right")
    for col in landed:
        t.add_column(col, justify="right")
    for name in lab.backends:
        addr = str(lab.addr(name))
        share = shares.get(addr)
        t.add_row(
            Text(f"{name} ({addr})"),
            str(WEIGHTS[name]) if share else "-",
            f"{share:.1%}" if share else "removed",
            *(str(c[name]) for c in landed.values()),
        )
    return t


def _acl_step(lb: LbNode, http4: Callable[[int], str]) -> None:
    """Deny the client's /24 on the HTTP VIP, live: its new connections get nothing (the
    SYN is dropped by the balancer), the hits are counted; then let it back in."""
    prefix, vip = "198.18.0.0/24", f"{VIP4}:80/tcp"
    console.print(
        f"[bold]xdplb acl deny {escape(prefix)} --vip {escape(vip)}[/bold] (live, through the API):"
    )
    _cli(lb, "acl", "deny", prefix, "--vip", vip)
    got = []
    for port in FLOWS[:3]:
        try:
            got.append(http_post(lb.lab.ns("client"), VIP4, 80, b"x", src_port=port, timeout=1))
        except ExchangeError:
            got.append("timed out")
    say(f"3 new connections from the client: {got}")
    listing = _cli(lb, "acl", "list", "--vip", vip)
    say(listing.rstrip())
    _cli(lb, "acl", "del", prefix, "--vip", vip)
    say(f"after xdplb acl del: {http4(FLOWS[0])} answers again.\n")


def _cli(lb: LbNode, *args: str) -> str:
    done = lb.cli(*args)
    if done.returncode != 0:
        raise SystemExit(f"xdplb {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


def teardown(lb: LbNode) -> None:
    """The demo's cleanup: SIGTERM the daemon (it removes its API socket and pid file as
    it exits), then detach the balancer and remove its pins and the run files it keeps across
    restarts (LbNode.destroy)."""
    try:
        if lb.proc is not None and lb.proc.poll() is None:
            lb.stop_daemon()
    finally:
        lb.destroy()


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def demo_lab(workdir: Path) -> Iterator[tuple[Lab, LbNode, list[subprocess.Popen[str]]]]:
    """The lab with host_tc and a server on every backend and the daemon on the LB;
    leaving it runs :func:`teardown`, then removes the namespaces."""
    ignored: dict[int, Any] = {}
    try:
        with Lab() as lab:
            for name in lab.backends:
                attach_host(lab, name)
            servers = lab.start_servers()
            lb = LbNode(lab, workdir, _vips(lab, lab.backends))
            try:
                lb.start()
                yield lab, lb, servers
            finally:
                # A second Ctrl-C (or kill) must not cut the cleanup short.
                ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
                teardown(lb)
    finally:
        for sig, handler in ignored.items():
            signal.signal(sig, handler)


class _Pump(socketserver.BaseRequestHandler):
    """One forwarded connection: bytes both ways until either side closes."""

    server: _Forward

    def handle(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
            try:
                up.connect(str(self.server.target))
            except OSError:
                return
            peer = {self.request: up, up: self.request}
            while True:
                ready, _, _ = select.select(list(peer), [], [])
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peer[sock].sendall(data)


class _Forward(socketserver.ThreadingTCPServer):
    """The host's 127.0.0.1:port to the daemon's unix socket (not per namespace), so a
    browser on this host, or through ``ssh -L``, reaches the status page. It serves what
    ``api: {listen: 127.0.0.1:9180}`` would: callers on this host."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, target: Path) -> None:
        self.target = target
        super().__init__(("127.0.0.1", port), _Pump)


def _forward(target: Path) -> _Forward:
    try:
        return _Forward(KEEP_PORT, target)
    except OSError:
        return _Forward(0, target)  # 9180 is taken: any free port


def keep(lab: Lab, lb: LbNode) -> None:
    """Serve the lab until Ctrl-C (or SIGTERM, which :func:`main` turns into Ctrl-C),
    saying how to reach it."""
    lab.start_servers(names=["b2"])  # back up after its rise count: the page shows it
    fwd = _forward(lb.api_socket)
    threading.Thread(target=fwd.serve_forever, name="forward", daemon=True).start()
    port = fwd.server_address[1]
    xdplb = Path(sys.executable).with_name("xdplb")
    client = lab.ns("client")
    console.print("[bold]The lab stays up[/bold] (make demo KEEP=1):")
    for line in (
        f"  status page  http://127.0.0.1:{port}/   (/metrics too; forwarded to {lb.api_socket})",
        f"  from another machine: ssh -L {port}:127.0.0.1:{port} root@<this host>,"
        f" then http://127.0.0.1:{port}/",
        f"  CLI          {xdplb} status -i {lb.instance}",
        f"               {xdplb} list -i {lb.instance}",
        f"               {xdplb} backend weight {VIP4}:80/tcp {lab.addr('b1')} 5 -i {lb.instance}",
        f"               {xdplb} status --api http://127.0.0.1:{port}",
        f"  traffic      ip netns exec {client} curl -s http://{VIP4}/",
        f"               ip netns exec {client} curl -s 'http://[{VIP6}]/'",
        f"  daemon       log {lb.log_path}, configuration {lb.config_path} (saving it reloads)",
        "  b3 was removed; b2's server is running again, its health checks bring it back.",
        "Ctrl-C tears the lab down.",
    ):
        say(line)

    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        say("")
    finally:
        fwd.shutdown()
        fwd.server_close()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--keep", action="store_true", help="keep the lab up after the tour, until Ctrl-C"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a kill tears the lab down, as Ctrl-C does
    cleanup_stale()
    console.print(
        Panel.fit(
            "client 198.18.0.1 ─► LB 198.18.0.2 (lb_tc: the balancer at TC, as on every veth) "
            "─GUE─► b1 .11 · b2 .12 · b3 .13 (host_tc)\nreplies go straight back to the client "
            "(direct server return); offloads at their defaults",
            title="xdplb demo: the lab",
        )
    )
    with tempfile.TemporaryDirectory() as tmp, demo_lab(Path(tmp)) as (lab, lb, servers):
        say(f"xdplb daemon running in the LB namespace (instance {lb.instance})\n")
        tour(lab, lb, servers)
        if args.keep:
            keep(lab, lb)
        else:
            say("make demo KEEP=1 keeps the lab up to explore the status page and the CLI.")
    say("lab torn down: namespaces, links, pins and run files removed.")
    return 0


def tour(lab: Lab, lb: LbNode, servers: list[subprocess.Popen[str]]) -> None:
    """Steps 3-6: traffic, a removal, a failure, an ACL, then ``xdplb list``."""
    client = lab.ns("client")

    def http4(port: int) -> str:
        return http_post(client, VIP4, 80, os.urandom(200), src_port=port)

    def udp4(port: int) -> str:
        return udp_exchange(client, VIP4, 53, os.urandom(64), src_port=port)

    def http6(port: int) -> str:
        return http_post(client, VIP6, 80, os.urandom(200), src_port=port)

    tcp1 = _run(f"HTTP  to {VIP4}:80", FLOWS, http4)
    udp1 = _run(f"UDP   to {VIP4}:53", FLOWS[:100], udp4)
    v6 = _run(f"HTTP  to [{VIP6}]:80", FLOWS[:100], http6)
    console.print(
        _table(
            "Where the flows landed (every reply verified byte for byte)",
            lab,
            lb,
            {
                "HTTP v4": Counter(tcp1.values()),
                "UDP v4": Counter(udp1.values()),
                "HTTP v6": Counter(v6.values()),
            },
        )
    )

    console.print(
        "\n[bold]Removing b3[/bold] (config reload, SIGHUP) and replaying "
        "the same 300 HTTP flows ..."
    )
    lb.reload(_vips(lab, ["b1", "b2"]))
    tcp2 = _run(f"HTTP  to {VIP4}:80", FLOWS, http4)
    moves = Counter(f"{tcp1[p]} → {tcp2[p]}" for p in FLOWS if tcp1[p] != tcp2[p])
    stayed = sum(1 for p in FLOWS if tcp1[p] == tcp2[p])
    console.print(_table("After removing b3", lab, lb, {"HTTP v4": Counter(tcp2.values())}))
    mt = Table(title="How the 300 flows moved")
    mt.add_column("flows")
    mt.add_column("count", justify="right")
    mt.add_row("stayed on their backend", str(stayed))
    for move, n in sorted(moves.items()):
        mt.add_row(Text(f"moved {move}"), str(n))
    console.print(mt)
    from_b3 = sum(1 for p in FLOWS if tcp1[p] == "b3")
    others = sum(n for m, n in moves.items() if not m.startswith("b3"))
    say(f"{from_b3} flows were on b3 and had to move; {others} flows of b1/b2 moved.\n")
    cli = [sys.executable, "-m", "xdplb.cli.app"]
    console.print("[bold]Killing b2's server[/bold]: its health checks fail ...")
    servers[1].kill()
    t0 = time.monotonic()
    while str(lab.addr("b2")) in _shares(lb) and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    say(f"b2 left the table {time.monotonic() - t0:.2f} s after its server died.")
    tcp3 = _run(f"HTTP  to {VIP4}:80", FLOWS[:100], http4)
    say(f"100 new connections: {dict(Counter(tcp3.values()))}\n")
    _acl_step(lb, http4)
    console.print("[bold]xdplb list[/bold] (the daemon's API, like ipvsadm -L -n):")
    subprocess.run([*cli, "list", "-i", lb.instance], check=False)
    say(f"\nThe status page and /metrics are served on {lb.api_socket}.\n")


if __name__ == "__main__":
    sys.exit(main())
