#!/usr/bin/env python3
"""`make bench-hooks`: the balancer on veth, both hooks, and socket-level balancing,
against plain routing and nftables DNAT, in one run, in the lab (docs/benchmarks.md,
"The two hooks on veth" and "The socket tier").

client -> LB -> three nginx backends, every offload at veth's defaults. Modes:

- ``routing``: the LB routes the VIP to b1 (no balancing: the reference); replies go
  straight back to the client (direct server return, as for the balancers);
- ``nftables``: the LB DNATs the VIP to the three backends (numgen random), conntrack
  on; replies come back through the LB (the backends route the client via it);
- ``lb_xdp`` and ``lb_tc``: the daemon with ``hook: xdp`` / ``hook: tc`` on the LB's
  veth, GUE to the backends (host_tc decapsulates), replies straight back;
- ``sock_lb``: the client's load generators run in a cgroup v2 child with sock_lb
  attached: connect() and sendmsg() to the VIP are rewritten to a backend (Maglev, the
  XDP tier's tables), so packets carry the backend's address; the LB only routes the
  backends' addresses, replies straight back, no NAT anywhere.

Rows: short connections a second (wrk, ``Connection: close``), keep-alive requests a
second with p50/p90/p99, iperf3 with 1 and 4 streams (and retransmits), UDP request /
response a second (a Python client: it bounds that row for every mode alike), and the
CPU time the whole machine spent per short connection (from /proc/stat). Every client
program, the UDP one included, is a process of its own, so that in ``sock_lb`` it can
join the cgroup before it opens a socket (a thread cannot join a cgroup alone); the
other modes run the same processes outside it. JSON out, with a summary: sock_lb against
nftables and lb_tc, the median over rounds of the per-round ratios.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xdplb.datapath import sock_lb
from xdplb.datapath.sock_lb import Endpoint, SockLb
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cgroup_clients import child_cgroup
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.topology import CLIENT_MTU
from xdplb.lab.wait import wait_for
from xdplb.sockets import socklb_plan
from xdplb.sockets.socklb_plan import Backend, Service

VIP = "198.18.100.1"
UDP_PORT = 53
IPERF_PORT = 5201
MODES = ("routing", "nftables", "lb_xdp", "lb_tc", "sock_lb")
#: The client's source address in ``sock_lb`` (in the lab's segment): see sock_lb_routes.
SOCK_LB_SOURCE = "198.18.0.201"
#: Seconds a client keeps its iperf3 backend under sock_lb: longer than a row.
IPERF_AFFINITY_S = 60.0

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


def services(lab: Lab) -> list[Service]:
    """sock_lb's services: the VIP's HTTP, UDP echo and iperf3 ports over the three
    backends, weights 1; iperf3 with client affinity (its control and data connections
    must meet one server)."""

    def svc(port: int, proto: int, affinity_s: float = 0.0) -> Service:
        backends = tuple(Backend(Endpoint(lab.addr(b), port)) for b in lab.backends)
        return Service(ipaddress.ip_address(VIP), port, proto, backends, affinity_s)

    return [
        svc(80, socket.IPPROTO_TCP),
        svc(UDP_PORT, socket.IPPROTO_UDP),
        svc(IPERF_PORT, socket.IPPROTO_TCP, IPERF_AFFINITY_S),
    ]


@contextmanager
def sock_lb_routes(lab: Lab) -> Iterator[None]:
    """The client reaches the backends' own addresses through the LB (one routed hop, as
    in every other mode), from an address of its own: under nftables the backends keep
    TIME_WAIT sockets of the same 4-tuples (backend:80, client:port), made with another
    TCP timestamp offset (it depends on the destination the client's socket had: the VIP
    there, the backend here), and PAWS would drop the SYNs that meet them."""
    lb4 = str(lab.addr("lb"))
    backends = [str(lab.addr(b)) for b in lab.backends]
    lab.run("client", ["ip", "addr", "add", f"{SOCK_LB_SOURCE}/32", "dev", "eth0"])
    try:
        for b in backends:
            route = [f"{b}/32", "via", lb4, "src", SOCK_LB_SOURCE]
            lab.run("client", ["ip", "route", "add", *route])
        yield
    finally:
        for b in backends:
            lab.run("client", ["ip", "route", "del", f"{b}/32"], check=False)
        lab.run("client", ["ip", "addr", "del", f"{SOCK_LB_SOURCE}/32", "dev", "eth0"], check=False)


@contextmanager
def mode(lab: Lab, name: str, workdir: Path) -> Iterator[Path | None]:
    """The LB set up as ``name``; yields the cgroup the client's processes must run in
    (None: anywhere). Undone afterwards."""
    workdir.mkdir(parents=True, exist_ok=True)
    client4 = str(lab.addr("client"))
    backends = [str(lab.addr(b)) for b in lab.backends]
    if name == "sock_lb":
        instance = f"{lab.prefix}-socklb"
        lab.pin_root("socklb")  # removed at the lab's teardown if detach never ran
        with sock_lb_routes(lab), child_cgroup("hooksbench") as cg:
            try:
                with SockLb(instance) as balancer:
                    balancer.attach(cg)
                    socklb_plan.apply(balancer, services(lab))
                yield cg
            finally:
                sock_lb.detach(instance)
        return
    if name == "routing":
        lab.run("lb", ["ip", "route", "add", f"{VIP}/32", "via", backends[0]])
        try:
            yield None
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
            yield None
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
        yield None
    finally:
        lb.destroy()


def client_argv(cg: Path | None, argv: Sequence[str]) -> list[str]:
    """``argv``, joining ``cg`` first when there is one (before it opens any socket)."""
    if cg is None:
        return list(argv)
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg / "cgroup.procs"), *argv]


#: GETs to the VIP (which backend answered each: its name is the body), and one UDP
#: datagram whose reply must come from the VIP (what an application checks; under
#: sock_lb, recvmsg4 shows the VIP in place of the backend). Stops at the first failure.
CHECK = """
import json, socket, sys
vip, udp_port, gets = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {"tcp": False, "backends": {}, "udp_source_is_vip": False}
try:
    for _ in range(gets):
        with socket.create_connection((vip, 80), timeout=2) as s:
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        head, _, body = data.partition(b"\\r\\n\\r\\n")
        if not head.startswith(b"HTTP/1.1 200"):
            break
        name = body.decode().strip()
        out["backends"][name] = out["backends"].get(name, 0) + 1
    out["tcp"] = sum(out["backends"].values()) == gets
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.settimeout(2)
        u.sendto(b"hi", (vip, udp_port))
        out["udp_source_is_vip"] = u.recvfrom(64)[1] == (vip, udp_port)
except OSError:
    pass
print(json.dumps(out))
"""


def check(lab: Lab, cg: Path | None, gets: int = 30) -> dict[str, Any]:
    """{"tcp": every one of ``gets`` GETs to the VIP answered, "backends": name ->
    GETs it answered (does the mode balance?), "udp_source_is_vip": a datagram answered
    from the VIP's address and port}, each within 2 s."""
    argv = client_argv(cg, [sys.executable, "-c", CHECK, VIP, str(UDP_PORT), str(gets)])
    out = lab.run("client", argv, check=False, timeout=gets * 2 + 10).stdout
    try:
        res: dict[str, Any] = json.loads(out)
    except ValueError:
        return {"tcp": False, "backends": {}, "udp_source_is_vip": False}
    return res


def wrk(lab: Lab, cg: Path | None, seconds: float, close: bool) -> dict[str, Any]:
    argv = ["wrk", "-t2", "-c64", f"-d{seconds:.0f}s", "--timeout", "2s", "--latency"]
    if close:
        argv += ["-H", "Connection: close"]
    cpu0 = cpu_seconds()
    argv = client_argv(cg, [*argv, f"http://{VIP}/"])
    out = lab.run("client", argv, check=False, timeout=seconds + 20).stdout
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


def iperf(lab: Lab, cg: Path | None, seconds: float, streams: int) -> dict[str, Any]:
    argv = ["iperf3", "-c", VIP, "-t", f"{seconds:.0f}", "-P", str(streams), "-J"]
    out = lab.run("client", client_argv(cg, argv), check=False, timeout=seconds + 20).stdout
    try:
        end = json.loads(out)["end"]["sum_sent"]
    except (ValueError, KeyError):
        return {"gbit_per_s": 0.0, "retransmits": None}
    return {"gbit_per_s": end["bits_per_second"] / 1e9, "retransmits": end.get("retransmits")}


#: ``threads`` connected UDP sockets, one request in flight each, for ``seconds``;
#: prints how many were answered.
UDP_RR = """
import socket, sys, threading, time
vip, port, seconds, threads = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
socks = []
for _ in range(threads):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.5)
    s.connect((vip, port))
    socks.append(s)
done = [0] * threads
stop = time.monotonic() + seconds
def one(i):
    s, n = socks[i], 0
    while time.monotonic() < stop:
        s.send(b"rr")
        try:
            s.recv(64)
            n += 1
        except TimeoutError:
            pass
    done[i] = n
ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(sum(done))
"""


def udp_rr(lab: Lab, cg: Path | None, seconds: float, threads: int = 4) -> dict[str, Any]:
    argv = [sys.executable, "-c", UDP_RR, VIP, str(UDP_PORT), str(seconds), str(threads)]
    out = lab.run("client", client_argv(cg, argv), check=False, timeout=seconds + 20).stdout
    try:
        answered = int(out.strip())
    except ValueError:
        return {"per_second": 0.0}
    return {"per_second": answered / seconds}


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
                    with mode(lab, name, Path(tmp) / f"{name}-{r}") as cg:
                        results[name].append(measure(lab, cg, seconds))
    return results


def measure(lab: Lab, cg: Path | None, seconds: float) -> dict[str, Any]:
    seen = check(lab, cg)
    row: dict[str, Any] = {
        "reachable": seen["tcp"],
        "backends_answering": seen["backends"],
        "udp_source_is_vip": seen["udp_source_is_vip"],
    }
    if not row["reachable"]:  # lb_xdp on veth with offloads on: nothing to measure
        return row
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("short_connections", lambda: wrk(lab, cg, seconds, close=True)),
        ("keepalive", lambda: wrk(lab, cg, seconds, close=False)),
        ("iperf3_1", lambda: iperf(lab, cg, seconds, 1)),
        ("iperf3_4", lambda: iperf(lab, cg, seconds, 4)),
        ("udp_rr", lambda: udp_rr(lab, cg, seconds)),
    ]
    for key, fn in steps:
        row[key] = fn()
    return row


def summary(modes: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """sock_lb against nftables and lb_tc on short connections: the median over rounds of
    the per-round change (sock_lb / other - 1). The modes of a round run back to back, so
    the ratio within a round cancels the drift between rounds (other work on the
    machine); a round where either side did not run or reach the VIP counts for nothing."""
    out: dict[str, Any] = {}
    ours = modes.get("sock_lb", [])
    for other in ("nftables", "lb_tc"):
        rate: list[float] = []
        p90: list[float] = []
        for a, b in zip(ours, modes.get(other, []), strict=False):
            sa, sb = a.get("short_connections", {}), b.get("short_connections", {})
            if sa.get("per_second") and sb.get("per_second"):
                rate.append(sa["per_second"] / sb["per_second"] - 1)
            if sa.get("p90_ms") and sb.get("p90_ms"):
                p90.append(sa["p90_ms"] / sb["p90_ms"] - 1)
        if rate and p90:
            out[f"sock_lb_vs_{other}"] = {
                "short_connections_change": statistics.median(rate),
                "p90_latency_change": statistics.median(p90),
                "short_connections_change_per_round": rate,
                "p90_latency_change_per_round": p90,
            }
    return out


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
    load_before = os.getloadavg()[0]
    modes = run(args.seconds, only, args.rounds)
    doc = {
        "cpu": cpu,
        "kernel": platform.release(),
        "seconds_per_row": args.seconds,
        "modes": modes,
        "summary": summary(modes),
        # Other work on the machine shows here: under a load above the CPU count the
        # figures measure the scheduler as much as the paths.
        "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
    }
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))
    for name, cmp in doc["summary"].items():
        print(
            f"{name}: short connections {cmp['short_connections_change']:+.1%}, "
            f"p90 {cmp['p90_latency_change']:+.1%} (median of per-round changes)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
