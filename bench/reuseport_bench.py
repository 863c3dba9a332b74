#!/usr/bin/env python3
"""UDP datagrams a second through one reuseport group of 4 sockets (a worker process
each) against one socket (one worker), in one run, in a namespace of its own. JSON out.

Modes, each measured for ``--seconds`` after a short warm-up, one after the other:

- ``one_socket``: one socket, one worker process;
- ``reuseport_4``: four sockets with SO_REUSEPORT, the kernel's hash picks the socket;
- ``generations_4``: the same four sockets as one generation of an
  :class:`~xdplb.sockets.reuseport.ReuseportGroup` (the sk_reuseport program selects).

Senders are ``--senders`` processes, each sending 64-byte datagrams round-robin from
``--flows`` client sockets (distinct source ports, so distinct flows) as fast as they
can over loopback. A worker counts what it reads; datagrams that found a full receive
queue are the namespace's ``Udp: RcvbufErrors``. Senders and workers share the
machine's CPUs: the numbers are of this machine, with the CPU model beside them.

Run as root: ``.venv/bin/python bench/reuseport_bench.py`` (about 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from xdplb.lab import netns
from xdplb.sockets.reuseport import ReuseportGroup, bind_reuseport

HOST = "127.0.0.1"
PAYLOAD = b"x" * 64
WORKERS = 4
WARMUP = 0.5


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def rcvbuf_errors() -> int:
    """``Udp: RcvbufErrors`` of the calling thread's namespace."""
    with open("/proc/thread-self/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Udp:")]
    return int(rows[1][rows[0].index("RcvbufErrors")])


def _fork(work: Callable[[], int]) -> tuple[int, int]:
    """Run ``work`` in a child process that writes its result to a pipe: (pid, fd)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, never return into the parent's code
        code = 1
        try:
            os.close(r)
            os.write(w, str(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect(children: list[tuple[int, int]]) -> list[int]:
    out = []
    for pid, fd in children:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        if status != 0 or not data:
            raise RuntimeError(f"child {pid} failed (status {status})")
        out.append(int(data))
    return out


def _worker(sock: socket.socket, start: float, end: float) -> Callable[[], int]:
    def run() -> int:
        sock.settimeout(0.05)
        buf = bytearray(2048)
        n = 0
        while (now := time.monotonic()) < end:
            try:
                sock.recv_into(buf)
            except TimeoutError:
                continue
            if now >= start:
                n += 1
        return n

    return run


def _sender(port: int, flows: int, start: float, end: float) -> Callable[[], int]:
    def run() -> int:
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(flows)]
        dest = (HOST, port)
        n = 0
        while (now := time.monotonic()) < end:
            for s in socks:
                try:
                    s.sendto(PAYLOAD, dest)
                except OSError:  # ENOBUFS on a busy loopback: not sent, not counted
                    continue
                if now >= start:
                    n += 1
        return n

    return run


def measure(socks: list[socket.socket], senders: int, flows: int, seconds: float) -> dict[str, Any]:
    """One mode: a worker per socket, ``senders`` senders, counted over ``seconds``."""
    port = socks[0].getsockname()[1]
    start = time.monotonic() + WARMUP
    end = start + seconds
    drops0 = rcvbuf_errors()
    workers = [_fork(_worker(s, start, end + 0.2)) for s in socks]
    sending = [_fork(_sender(port, flows, start, end)) for _ in range(senders)]
    sent = _collect(sending)
    received = _collect(workers)
    return {
        "workers": len(socks),
        "received_per_s": round(sum(received) / seconds),
        "sent_per_s": round(sum(sent) / seconds),
        "rcvbuf_errors": rcvbuf_errors() - drops0,
        "per_worker_per_s": [round(n / seconds) for n in received],
    }


@contextmanager
def bench_netns() -> Iterator[str]:
    name = f"xlrpbench{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="measured time per mode")
    ap.add_argument("--senders", type=int, default=2, help="sender processes")
    ap.add_argument("--flows", type=int, default=64, help="client sockets per sender")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("reuseport_bench: run as root (network namespace, BPF)")

    results: dict[str, Any] = {}
    with bench_netns() as ns, netns.enter(ns):
        one = [bind_reuseport("udp", HOST, 0)]
        results["one_socket"] = measure(one, args.senders, args.flows, args.seconds)
        one[0].close()

        plain = [bind_reuseport("udp", HOST, 0)]
        plain += [bind_reuseport("udp", HOST, plain[0].getsockname()[1]) for _ in range(3)]
        results["reuseport_4"] = measure(plain, args.senders, args.flows, args.seconds)
        for s in plain:
            s.close()

        group = ReuseportGroup.open(ns, "udp")
        try:
            socks = [bind_reuseport("udp", HOST, 0)]
            socks += [bind_reuseport("udp", HOST, socks[0].getsockname()[1]) for _ in range(3)]
            gen = group.begin()
            for s in socks:
                gen.add(s)
            gen.ready()
            results["generations_4"] = measure(socks, args.senders, args.flows, args.seconds)
            results["generations_4"]["program"] = group.counters()
            for s in socks:
                s.close()
        finally:
            group.destroy()

    one_rate = results["one_socket"]["received_per_s"] or 1
    text = json.dumps(
        {
            "bench": "reuseport",
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "seconds_per_mode": args.seconds,
            "senders": args.senders,
            "flows": args.senders * args.flows,
            "payload_bytes": len(PAYLOAD),
            "modes": results,
            "ratio_reuseport_4_over_one": round(
                results["reuseport_4"]["received_per_s"] / one_rate, 2
            ),
            "ratio_generations_4_over_one": round(
                results["generations_4"]["received_per_s"] / one_rate, 2
            ),
        },
        indent=2,
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
