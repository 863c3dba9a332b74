"""Health checks per second on one core, against 2,000 local backends.

    .venv/bin/python bench/health_bench.py [--seconds 5] [--out FILE]

A namespace ``xdplbt-<pid>-hcbench`` gets 2,000 addresses (198.18.8.1 - 198.18.15.250,
/32 on lo) and one responder process (one listening socket on 0.0.0.0, a minimal
HTTP/1.1 answer, pinned to another CPU). The HealthMonitor runs in this process, in the
namespace, pinned to one CPU, with one target per address: first TCP checks, then HTTP
checks, each at an interval short enough that the monitor is saturated (checks run back
to back, targets queue for a slot). Reported per phase: checks/s over the measured
window (after a warm-up), failures (must be 0), p50/p99 check latency (which, saturated,
is mostly the wait for the loop: Little's law, in-flight checks / rate).

``run(seconds)`` returns the same dict that is printed as JSON. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from xdplb.config.health import HealthCheckConfig
from xdplb.health.checkers import CheckResult, Target, run_check
from xdplb.health.monitor import HealthMonitor
from xdplb.lab import netns

N_BACKENDS = 2000
PORT = 8080
WARMUP = 1.0
#: (interval_ms, timeout_ms, max_concurrent) per phase. The demand (2,000 targets per
#: interval) is far above what one core can check, so the monitor is saturated. A
#: saturated loop's latency is in-flight checks / rate (Little's law), and timeout_ms may
#: not exceed interval_ms: so the bench allows only as many checks in flight as keep the
#: core busy on loopback, where a check never waits for the network. (The default, 512,
#: is for real networks, where most checks in flight are waiting.)
PHASES = {"tcp": (150, 150, 64), "http": (200, 200, 32)}

#: The responder: accepts, answers any request with 200 "ok", closes. A TCP check just
#: connects and closes, which this also handles.
RESPONDER = r"""
import asyncio, socket, sys
REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.buf = t, b""
    def data_received(self, d):
        self.buf += d
        if b"\r\n\r\n" in self.buf:
            self.t.write(REPLY)
            self.t.close()
async def main():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(sys.argv[1])))
    s.listen(4096)
    srv = await asyncio.get_running_loop().create_server(P, sock=s, backlog=4096)
    print("ready", flush=True)
    await srv.serve_forever()
asyncio.run(main())
"""


def addresses(n: int = N_BACKENDS) -> list[IPv4Address]:
    """198.18.8.1 .. 198.18.15.250: 250 per /24."""
    return [IPv4Address(f"198.18.{8 + i // 250}.{1 + i % 250}") for i in range(n)]


def _ip(*args: str, stdin: str | None = None) -> None:
    subprocess.run(["ip", *args], check=True, input=stdin, text=True, capture_output=True)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _phase(kind: str, addrs: list[IPv4Address], seconds: float) -> dict[str, Any]:
    interval_ms, timeout_ms, max_concurrent = PHASES[kind]
    cfg = HealthCheckConfig.model_validate(
        {
            "checker": {kind: {}},
            "interval_ms": interval_ms,
            "timeout_ms": timeout_ms,
            "fall_count": 1,
            "rise_count": 1,
        }
    )
    targets = [Target(key=a, backend=a, address=a, port=PORT, check=cfg) for a in addrs]
    measuring = False
    latencies: list[float] = []
    failures: list[str] = []

    async def check(t: Target) -> CheckResult:
        r = await run_check(t)
        if measuring:
            latencies.append(r.latency)
            if not r.ok:
                failures.append(f"{t.address}: {r.detail}")
        return r

    downs: list[object] = []
    monitor = HealthMonitor(
        lambda key, up: downs.append(key) if not up else None,
        check=check,
        max_concurrent=max_concurrent,
    )
    monitor.set_targets(targets)
    task = asyncio.create_task(monitor.run())
    try:
        await asyncio.sleep(WARMUP)
        measuring = True
        n0, t0, cpu0 = monitor.checks_total, time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        n1, t1, cpu1 = monitor.checks_total, time.perf_counter(), time.process_time()
        measuring = False
        queued = monitor.queued
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    checks = n1 - n0
    return {
        "checks_per_second": round(checks / (t1 - t0), 1),
        # What one core would do if this process had it to itself (the machine may be
        # shared): checks per second of this process's CPU time.
        "checks_per_cpu_second": round(checks / (cpu1 - cpu0), 1),
        "checks": checks,
        "failures": len(failures),
        "failure_examples": failures[:5],
        "went_down": len(downs),
        "latency_p50_ms": round(_percentile(latencies, 0.50) * 1000, 2),
        "latency_p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
        "latency_mean_ms": round(statistics.fmean(latencies) * 1000, 2) if latencies else None,
        "cpu_utilisation": round((cpu1 - cpu0) / (t1 - t0), 3),
        "saturated": queued > 0,
        "queued_at_end": queued,
        "interval_ms": interval_ms,
        "timeout_ms": timeout_ms,
        "max_concurrent": max_concurrent,
        "targets": len(targets),
    }


def run(seconds: float = 5.0) -> dict[str, Any]:
    """Both phases, ``seconds`` measured each; the results as a dict (see the module doc)."""
    if os.geteuid() != 0:
        raise PermissionError("the health benchmark needs root (a network namespace)")
    ns = f"xdplbt-{os.getpid()}-hcbench"
    cpus = sorted(os.sched_getaffinity(0))
    mine, other = cpus[-1], cpus[0]
    old_affinity = set(cpus)
    addrs = addresses()
    responder = None
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "-batch", "-", stdin="".join(f"addr add {a}/32 dev lo\n" for a in addrs))
        responder = netns.popen(
            ns,
            ["taskset", "-c", str(other), sys.executable, "-c", RESPONDER, str(PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert responder.stdout is not None
        if responder.stdout.readline().strip() != "ready":
            raise RuntimeError("the responder did not start")
        os.sched_setaffinity(0, {mine})
        phases: dict[str, Any] = {}
        with netns.enter(ns):
            for kind in PHASES:
                phases[kind] = asyncio.run(_phase(kind, addrs, seconds))
    finally:
        os.sched_setaffinity(0, old_affinity)
        if responder is not None:
            responder.kill()
            responder.wait()
        subprocess.run(["ip", "netns", "del", ns], check=False)
    return {
        "health": phases,
        "meta": {
            "backends": len(addrs),
            "seconds": seconds,
            "warmup_seconds": WARMUP,
            "pinned_cpu": mine,
            "responder_cpu": other,
            "kernel": os.uname().release,
            "python": sys.version.split()[0],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    res = run(args.seconds)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 1 if any(p["failures"] for p in res["health"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
