"""``make demo``: the lab, real traffic through lb_xdp, and what a backend removal moves.

1. builds the lab (client, LB, three backends in network namespaces), attaches host_tc
   on the backends and starts a real server on each;
2. starts the real ``xdplb run`` daemon on the LB (weights 2:1:1);
3. sends HTTP requests, UDP exchanges and IPv6 requests from the client to the VIPs and
   shows where they landed next to each backend's weight and table share;
4. removes one backend and replays the same flows: only the removed backend's flows
   move, as Maglev and the connection table promise;
5. kills a backend's server: the health checks take it out of the table;
6. denies the client's prefix on a VIP with a live ACL, then lets it back in;
7. tears everything down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import ExchangeError, http_post, udp_exchange

VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
WEIGHTS = {"b1": 2, "b2": 1, "b3": 1}
FLOWS = range(20000, 20300)

console = Console()


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
        TextColumn("{task.description}"),
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
    t = Table(title=title)
    t.add_column("backend")
    t.add_column("weight", justify="right")
    t.add_column("table share", justify="right")
    for col in landed:
        t.add_column(col, justify="right")
    for name in lab.backends:
        addr = str(lab.addr(name))
        share = shares.get(addr)
        t.add_row(
            f"{name} ({addr})",
            str(WEIGHTS[name]) if share else "-",
            f"{share:.1%}" if share else "removed",
            *(str(c[name]) for c in landed.values()),
        )
    return t


def _acl_step(lb: LbNode, http4: Callable[[int], str]) -> None:
    """Deny the client's /24 on the HTTP VIP, live: its new connections get nothing (the
    SYN is dropped in XDP), the hits are counted; then let it back in."""
    prefix, vip = "198.18.0.0/24", f"{VIP4}:80/tcp"
    console.print(f"[bold]xdplb acl deny {prefix} --vip {vip}[/bold] (live, through the API):")
    _cli(lb, "acl", "deny", prefix, "--vip", vip)
    got = []
    for port in FLOWS[:3]:
        try:
            got.append(http_post(lb.lab.ns("client"), VIP4, 80, b"x", src_port=port, timeout=1))
        except ExchangeError:
            got.append("timed out")
    console.print(f"3 new connections from the client: {got}")
    listing = _cli(lb, "acl", "list", "--vip", vip)
    console.print(listing.rstrip())
    _cli(lb, "acl", "del", prefix, "--vip", vip)
    console.print(f"after xdplb acl del: {http4(FLOWS[0])} answers again.\n")


def _cli(lb: LbNode, *args: str) -> str:
    done = lb.cli(*args)
    if done.returncode != 0:
        raise SystemExit(f"xdplb {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


def main() -> int:
    cleanup_stale()
    console.print(
        Panel.fit(
            "client 198.18.0.1 ─► LB 198.18.0.2 (lb_xdp, XDP) ─GUE─► b1 .11 · b2 .12 · b3 .13 "
            "(host_tc)\nreplies go straight back to the client (direct server return)",
            title="xdplb demo: the lab",
        )
    )
    with Lab() as lab, tempfile.TemporaryDirectory() as tmp:
        for name in lab.backends:
            attach_host(lab, name)
        servers = lab.start_servers()
        lb = LbNode(lab, Path(tmp), _vips(lab, lab.backends))
        lb.start()
        console.print(f"xdplb daemon running in the LB namespace (instance {lb.instance})\n")

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
            mt.add_row(f"moved {move}", str(n))
        console.print(mt)
        from_b3 = sum(1 for p in FLOWS if tcp1[p] == "b3")
        others = sum(n for m, n in moves.items() if not m.startswith("b3"))
        console.print(
            f"{from_b3} flows were on b3 and had to move; {others} flows of b1/b2 moved.\n"
        )
        cli = [sys.executable, "-m", "xdplb.cli.app"]
        console.print("[bold]Killing b2's server[/bold]: its health checks fail ...")
        servers[1].kill()
        t0 = time.monotonic()
        while str(lab.addr("b2")) in _shares(lb) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        console.print(f"b2 left the table {time.monotonic() - t0:.2f} s after its server died.")
        tcp3 = _run(f"HTTP  to {VIP4}:80", FLOWS[:100], http4)
        console.print(f"100 new connections: {dict(Counter(tcp3.values()))}\n")
        _acl_step(lb, http4)
        console.print("[bold]xdplb list[/bold] (the daemon's API, like ipvsadm -L -n):")
        subprocess.run([*cli, "list", "-i", lb.instance], check=False)
        console.print(f"\nThe status page and /metrics are served on {lb.api_socket}.\n")
        lb.destroy()
    console.print("lab torn down: namespaces, links and pins removed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
