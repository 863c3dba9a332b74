#!/usr/bin/env python3
"""`make bench-hooks`: the balancer on veth, both hooks, against plain routing and
nftables DNAT, in one run, in the lab (docs/benchmarks.md, "The two hooks on veth").

client -> LB -> three nginx backends, every offload at veth's defaults. Modes:

- ``routing``: the LB routes the VIP to b1 (no balancing: the reference); replies go
  straight back to the client (direct server return, as for the balancers);
- ``nftables``: the LB DNATs the VIP to the three backends (numgen random), conntrack
  on; replies come back through the LB (the backends route the client via it);
- ``lb_xdp`` and ``lb_tc``: the daemon with ``hook: xdp`` / ``hook: tc`` on the LB's
  veth, GUE to the backends (host_tc decapsulates), replies straight back.

Rows: short connections a second (wrk, ``Connection: close``), keep-alive requests a
second with p50/p90/p99, iperf3 with 1 and 4 streams (and retransmits), UDP request /
response a second (a Python client: it bounds that row for every mode alike), and the
CPU time the whole machine spent per short connection (from /proc/stat). JSON out.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.topology import CLIENT_MTU
from xdplb.lab.wait import wait_for

VIP = "198.18.100.1"
UDP_PORT = 53
IPERF_PORT = 5201
MODES = ("routing", "nftables", "lb_xdp", "lb_tc")

NGINX_CONF = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir};
    proxy_temp_path {dir};
    fastcgi_temp_path {dir};
    uwsgi_temp_path {dir};
    scgi_temp_path {dir};
    server {{
        listen 80 reuseport backlog=4096;
        keepalive_requests 1000000;
        location / {{ return 200 "{name}\\n"; }}
    }}
}}
"""


def cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (every namespace shares the CPUs)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / 100.0  # USER_HZ


def listening(lab: Lab, node: str) -> Callable[[], str]:
    """What listens on TCP port 80 on ``node`` (empty: nothing yet)."""
    return lambda: lab.run(node, ["ss", "-Hltn", "sport = :80"], check=False).stdout


@contextmanager
def servers(lab: Lab, workdir: Path) -> Iterator[None]:
    """nginx, iperf3 and a UDP echo on every backend."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for b in lab.backends:
            d = workdir / b
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "nginx.conf"
            conf.write_text(NGINX_CONF.format(dir=d, name=b))
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            procs.append(lab.popen(b, ["nginx", "-c", str(conf), "-g", "daemon off;"], **quiet))
            procs.append(lab.popen(b, ["iperf3", "-s"], **quiet))
        procs += lab.start_servers("--http", "8080", "--udp", str(UDP_PORT))
        for b in lab.backends:
            wait_for(listening(lab, b), f"nginx listening on {b}", until=bool)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()


@contextmanager
def mode(lab: Lab, name: str, workdir: Path) -> Iterator[None]:
    """The LB set up as ``name``; undone afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    client4 = str(lab.addr("client"))
    backends = [str(lab.addr(b)) for b in lab.backends]
    if name == "routing":
        lab.run("lb", ["ip", "route", "add", f"{VIP}/32", "via", backends[0]])
        try:
            yield
        finally:
            lab.run("lb", ["ip", "route", "del", f"{VIP}/32"], check=False)
        return
    if name == "nftables":
        amap = ", ".join(f"{i} : {a}" for i, a in enumerate(backends))
        rules = (
            "table ip xlbbench {\n"
            " chain pre { type nat hook prerouting priority dstnat;\n"
            # iperf3's control and data connections must meet one server: by source.
            f"  ip daddr {VIP} tcp dport {IPERF_PORT} dnat to jhash ip saddr mod "
            f"{len(backends)} map {{ {amap} }}\n"
            f"  ip daddr {VIP} dnat to numgen random mod {len(backends)} map {{ {amap} }}\n"
            " }\n}\n"
        )
        (workdir / "nat.nft").write_text(rules)
        lab.run("lb", ["nft", "-f", str(workdir / "nat.nft")])
        # The lab's route to the client (its MTU: the client's 1400), via the LB instead.
        route = ["ip", "route", "replace", f"{client4}/32"]
        mtu = ["mtu", str(CLIENT_MTU)]
        for b in lab.backends:
            lab.run(b, [*route, "via", str(lab.addr("lb")), *mtu])
        try:
            yield
        finally:
            for b in lab.backends:
                lab.run(b, [*route, "dev", "eth0", *mtu], check=False)
            lab.run("lb", ["nft", "delete", "table", "ip", "xlbbench"], check=False)
        return
    hook = "xdp" if name == "lb_xdp" else "tc"
    vips = [
        {"address": VIP, "port": 0, "backends": [{"address": a} for a in backends]},
        # iperf3's control and data connections must meet one server: by source.
        {
            "address": VIP,
            "port": IPERF_PORT,
            "hash": "source",
            "backends": [{"address": a} for a in backends],
        },
        {
            "address": VIP,
            "port": 0,
            "protocol": "udp",
            "backends": [{"address": a} for a in backends],
        },
    ]
    lb = LbNode(lab, workdir, vips, interfaces=[{"name": "eth0", "hook": hook}])
    try:
        lb.start()
        yield
    finally:
        lb.destroy()


def reachable(lab: Lab) -> bool:
    """One GET to the VIP answered by a backend within 2 s."""
    with lab.enter("client"):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(2.0)
        s.connect((VIP, 80))
        s.sendall(b"GET / HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        s.close()


def wrk(lab: Lab, seconds: float, close: bool) -> dict[str, Any]:
    argv = ["wrk", "-t2", "-c64", f"-d{seconds:.0f}s", "--timeout", "2s", "--latency"]
    if close:
        argv += ["-H", "Connection: close"]
    cpu0 = cpu_seconds()
    out = lab.run("client", [*argv, f"http://{VIP}/"], check=False, timeout=seconds + 20).stdout
    cpu = cpu_seconds() - cpu0
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    rate = float(m.group(1)) if m else 0.0
    errors = re.search(r"Socket errors: (.*)", out)
    res: dict[str, Any] = {"per_second": rate, "errors": errors.group(1) if errors else None}
    for pct in ("50", "90", "99"):
        lm = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)", out, re.M)
        if lm:
            scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[lm.group(2)]
            res[f"p{pct}_ms"] = float(lm.group(1)) * scale
    if close and rate:
        res["cpu_us_per_connection"] = cpu / (rate * seconds) * 1e6
    return res


def iperf(lab: Lab, seconds: float, streams: int) -> dict[str, Any]:
    out = lab.run(
        "client",
        ["iperf3", "-c", VIP, "-t", f"{seconds:.0f}", "-P", str(streams), "-J"],
        check=False,
        timeout=seconds + 20,
    ).stdout
    try:
        end = json.loads(out)["end"]["sum_sent"]
    except (ValueError, KeyError):
        return {"gbit_per_s": 0.0, "retransmits": None}
    return {"gbit_per_s": end["bits_per_second"] / 1e9, "retransmits": end.get("retransmits")}


def udp_rr(lab: Lab, seconds: float, threads: int = 4) -> dict[str, Any]:
    done = [0] * threads
    stop = time.monotonic() + seconds

    def one(i: int) -> None:
        with lab.enter("client"):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.5)
        s.connect((VIP, UDP_PORT))
        n = 0
        while time.monotonic() < stop:
            s.send(b"rr")
            try:
                s.recv(64)
                n += 1
            except TimeoutError:
                pass
        done[i] = n
        s.close()

    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"per_second": sum(done) / seconds}


def run(seconds: float, only: tuple[str, ...], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Every mode once a round, the order reversed every other round (the machine's
    drift falls on both ends alike); mode -> its rows, one per round."""
    cleanup_stale()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in only}
    with tempfile.TemporaryDirectory() as tmp, Lab() as lab:
        for b in lab.backends:
            attach_host(lab, b)
        with servers(lab, Path(tmp)):
            for r in range(rounds):
                for name in only if r % 2 == 0 else only[::-1]:
                    print(f"round {r + 1}: {name} ...", file=sys.stderr, flush=True)
                    with mode(lab, name, Path(tmp) / f"{name}-{r}"):
                        results[name].append(measure(lab, seconds))
    return results


def measure(lab: Lab, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"reachable": reachable(lab)}
    if not row["reachable"]:  # lb_xdp on veth with offloads on: nothing to measure
        return row
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("short_connections", lambda: wrk(lab, seconds, close=True)),
        ("keepalive", lambda: wrk(lab, seconds, close=False)),
        ("iperf3_1", lambda: iperf(lab, seconds, 1)),
        ("iperf3_4", lambda: iperf(lab, seconds, 4)),
        ("udp_rr", lambda: udp_rr(lab, seconds)),
    ]
    for key, fn in steps:
        row[key] = fn()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="bench/hooks_results.json")
    args = ap.parse_args(argv)
    only = tuple(m for m in args.modes.split(",") if m)
    bad = [m for m in only if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    doc = {
        "cpu": cpu,
        "kernel": platform.release(),
        "seconds_per_row": args.seconds,
        "modes": run(args.seconds, only, args.rounds),
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
