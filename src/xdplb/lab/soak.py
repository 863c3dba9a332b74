"""``make soak``: the lab with the real daemon under mixed load and scheduled churn.

Load, all from the client and every byte checked:
- long-lived TCP streams (:class:`~xdplb.lab.paced.PacedStreams`) to an IPv4 and an
  IPv6 VIP, topped up after churn breaks some;
- short TCP connections (one HTTP POST each) and UDP request/response, alternating
  IPv4 and IPv6.

Churn, one event every ``step`` seconds, in a cycle: a backend's server is killed (the
health checks take it out) and restarted (they bring it back); the weights change by a
reload; a backend is removed by a reload and added back by the next; the daemon is
restarted (SIGTERM, then a new ``xdplb run``: the pinned link keeps forwarding
meanwhile); a backend is drained and enabled again through the API.

Every failed connection and broken stream is attributed to the churn event just before
it. Expected are: a stream on a backend whose server was killed (``backend died``), a
stream on a backend a reload removed (``backend removed``: its connections have nowhere
to go), and a new connection or datagram failing between a kill and the health checks
noticing it (``backend down, not yet detected``). Everything else is unexpected.
Memory: the daemon's RSS (start, end, peak, across restarts), the memory of the BPF
maps (pinned maps and the tables inside the map-in-maps) and the connection table's
fill, sampled every few seconds.

Exit status: 0, or 1 when anything unexpected broke or memory grew past the bounds.
Run as ``python -m xdplb.lab.soak --seconds 600 --out build/soak.json`` (root).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdplb.core.errors import LabError
from xdplb.datapath.maps import Map
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import BrokenStream, PacedStreams
from xdplb.lab.registry import cleanup_stale
from xdplb.lab.topology import Lab
from xdplb.lab.traffic import ExchangeError, http_post, udp_exchange
from xdplb.lab.wait import wait_for

VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
#: Health checks: fall after 2 failed checks 300 ms apart (docs/operations.md).
INTERVAL_MS, FALL, RISE = 300, 2, 2
#: From a kill until the health checks have taken the backend out (with planning slack).
DETECT_S = INTERVAL_MS / 1000 * 1.2 * (FALL + 1) + 1.5
STREAMS = {VIP4: 40, VIP6: 20}


@dataclasses.dataclass(frozen=True)
class Event:
    """One churn event."""

    at: float
    kind: str
    #: The backend it concerns (``b1`` ...), if any.
    backend: str | None = None


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failed connection or exchange, or a broken stream."""

    at: float
    what: str  # "stream", "tcp", "udp"
    detail: str
    backend: str | None = None  # known for streams


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _memlock(m: Map) -> int:
    for line in Path(f"/proc/self/fdinfo/{m.fd}").read_text().splitlines():
        if line.startswith("memlock:"):
            return int(line.split()[1])
    return 0


class Soak:
    """One soak run (see the module docstring)."""

    def __init__(self, seconds: float, workdir: Path, *, step: float | None = None) -> None:
        self.seconds = seconds
        self.step = step if step is not None else min(15.0, max(2.5, seconds / 16))
        self.workdir = workdir
        self.events: list[Event] = []
        self.failures: list[Failure] = []
        self.attempts: Counter[str] = Counter()
        #: Short exchanges that took over 0.5 s (a retransmission), and the slowest.
        self.slow: Counter[str] = Counter()
        self.slowest: dict[str, float] = {}
        self.samples: list[dict[str, Any]] = []
        self.groups: list[tuple[str, PacedStreams]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lab: Lab
        self.lb: LbNode
        self.servers: dict[str, subprocess.Popen[str]] = {}
        self.weights: dict[str, int] = {}

    # -- setup ------------------------------------------------------------------------

    def _vips(self) -> list[dict[str, Any]]:
        def vip(addr: str, port: int, proto: str, check_port: int) -> dict[str, Any]:
            family = 6 if ":" in addr else 4
            backends = [
                {"address": str(self.lab.addr(b, family)), "weight": w}
                for b, w in self.weights.items()
            ]
            health = {
                "checker": {"tcp": {"check_port": check_port}},
                "interval_ms": INTERVAL_MS,
                "timeout_ms": 200,
                "fall_count": FALL,
                "rise_count": RISE,
            }
            return {
                "address": addr,
                "port": port,
                "protocol": proto,
                "health": health,
                "backends": backends,
            }

        return [
            vip(VIP4, 7, "tcp", 7),
            vip(VIP4, 80, "tcp", 80),
            vip(VIP4, 53, "udp", 80),
            vip(VIP6, 7, "tcp", 7),
            vip(VIP6, 80, "tcp", 80),
            vip(VIP6, 53, "udp", 80),
        ]

    def _event(self, kind: str, backend: str | None = None) -> None:
        with self._lock:
            self.events.append(Event(time.monotonic(), kind, backend))
        print(f"[{self._elapsed():6.1f}s] {kind}{' ' + backend if backend else ''}", flush=True)

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _start_server(self, b: str) -> None:
        (self.servers[b],) = self.lab.start_servers(names=[b])

    def _kill_server(self, b: str) -> None:
        proc = self.servers.pop(b)
        proc.kill()
        proc.wait()

    def _wait_healthy(self, timeout: float = 20.0) -> None:
        """Until the health checks have seen every backend of every VIP up."""
        with self.lb.api() as api:

            def health() -> list[str | None]:
                st = api.get("/api/v1/status").json()
                return [b.get("health") for v in st["vips"] for b in v["backends"]]

            wait_for(
                health,
                "every backend healthy",
                until=lambda h: bool(h) and all(x == "up" for x in h),
                timeout=timeout,
                interval=0.1,
            )

    # -- load -------------------------------------------------------------------------

    def _on_break(self, b: BrokenStream) -> None:
        with self._lock:
            self.failures.append(Failure(b.at, "stream", b.reason, b.backend))

    def _top_up(self) -> None:
        """Open streams until each VIP has its number of live ones again."""
        ns = self.lab.ns("client")
        live = Counter[str]()
        for addr, g in self.groups:
            live[addr] += len(g.streams) - len(g.broken)
        for addr, want in STREAMS.items():
            n = want - live[addr]
            if n <= 0:
                continue
            with self._lock:
                self.attempts["stream"] += n
            g = PacedStreams(
                ns, addr, 7, n=n, size=512, period=0.2, on_break=self._on_break, strict=False
            )
            with self._lock:
                for e in g.failed_connects:
                    self.failures.append(Failure(time.monotonic(), "stream-connect", e))
            self.groups.append((addr, g.start()))

    def _short(self, what: str, fn: Callable[[str, int], None], rate: float) -> None:
        i = 0
        while not self._stop.is_set():
            addr = VIP4 if i % 2 == 0 else VIP6
            i += 1
            t = time.monotonic()
            try:
                fn(addr, i)
            except (ExchangeError, OSError) as e:  # udp_exchange lets ECONNREFUSED through
                with self._lock:
                    self.failures.append(Failure(time.monotonic(), what, f"{addr}: {e}"))
            took = time.monotonic() - t
            with self._lock:
                self.attempts[what] += 1
                self.slowest[what] = max(self.slowest.get(what, 0.0), took)
                if took > 0.5:
                    self.slow[what] += 1
            self._stop.wait(max(0.0, 1 / rate - (time.monotonic() - t)))

    def _tcp(self, addr: str, _i: int) -> None:
        http_post(self.lab.ns("client"), addr, 80, os.urandom(256), timeout=2.0)

    def _udp(self, addr: str, i: int) -> None:
        # A new source port each time (ports are not reused within 40,000 exchanges): the
        # soak counts new flows. A reused 5-tuple follows its connection-table entry,
        # possibly to a backend that died since (likely the one unexpected failure of a
        # 120 s soak with kernel-chosen ports).
        udp_exchange(
            self.lab.ns("client"),
            addr,
            53,
            os.urandom(64),
            src_port=20000 + i // 2 % 40000,
            timeout=2.0,
            tries=2,
        )

    # -- memory -----------------------------------------------------------------------

    def _bpf_memory(self) -> tuple[int, int, int]:
        """(bytes of every pinned map and inner table, inner tables, conn-table entries)."""
        total = inner = 0
        with self.lb.maps() as maps:
            for m in maps.maps.values():
                total += _memlock(m)
            for outer in ("lb_tables", "lb_btables"):
                for _k, v in maps[outer].items():
                    with Map.from_id(struct.unpack("<I", v[:4])[0]) as t:
                        total += _memlock(t)
                        inner += 1
            conns = maps.conns.estimate_count()
        return total, inner, conns

    def _sample(self) -> None:
        pid = self.lb.proc.pid if self.lb.proc is not None else None
        rss = _rss_kib(pid) if pid is not None else None
        try:
            bpf, inner, conns = self._bpf_memory()
        except (OSError, FileNotFoundError, LabError):
            return
        self.samples.append(
            {
                "t": round(self._elapsed(), 1),
                "daemon_pid": pid,
                "rss_kib": rss,
                "bpf_bytes": bpf,
                "tables": inner,
                "conns": conns,
            }
        )

    # -- churn ------------------------------------------------------------------------

    def _churn(self, k: int) -> None:
        backends = self.lab.backends
        victim = backends[(k // 8) % len(backends)]
        match k % 8:
            case 0:
                self._event("backend killed", victim)
                self._kill_server(victim)
            case 1:
                self._start_server(victim)
                self._event("backend restarted", victim)
            case 2:
                self.weights = {
                    b: 1 + (i == k // 8 % len(backends)) for i, b in enumerate(backends)
                }
                self._event("reload: weights")
                self.lb.reload(self._vips())
            case 3:
                self.weights.pop(backends[-1])
                self._event("reload: backend removed", backends[-1])
                self.lb.reload(self._vips())
            case 4:
                self.weights[backends[-1]] = 1
                self._event("reload: backend added", backends[-1])
                self.lb.reload(self._vips())
            case 5:
                self._event("daemon restart")
                self.lb.stop_daemon()
                self.lb.start()
            case 6:
                self._event("drain", backends[0])
                self._api_drain(backends[0], "drain")
            case _:
                self._event("enable", backends[0])
                self._api_drain(backends[0], "enable")

    def _api_drain(self, b: str, action: str) -> None:
        with self.lb.api() as api:
            for vip in self.lb.doc["vips"]:
                a, port, proto = vip["address"], vip["port"], vip["protocol"]
                addr = self.lab.addr(b, 6 if ":" in a else 4)
                resp = api.post(f"/api/v1/vips/{a}/{port}/{proto}/backends/{addr}/{action}")
                if resp.status_code != 200:
                    raise LabError(f"{action} {b} on {a}:{port}/{proto}: {resp.text}")

    # -- attribution ------------------------------------------------------------------

    def _classify(self, f: Failure) -> tuple[str, Event | None]:
        before = [e for e in self.events if e.at <= f.at]
        last = before[-1] if before else None
        kills = [e for e in before if e.kind == "backend killed"]
        for kill in reversed(kills):
            restart = next(
                (
                    e
                    for e in self.events
                    if e.kind == "backend restarted"
                    and e.backend == kill.backend
                    and e.at > kill.at
                ),
                None,
            )
            alive_again = restart.at if restart is not None else float("inf")
            if f.what == "stream" and f.backend == kill.backend and f.at <= alive_again + 1:
                return "expected: backend died", kill
            if f.what != "stream" and kill.at <= f.at <= kill.at + DETECT_S:
                return "expected: backend down, not yet detected", kill
        removed = [e for e in before if e.kind == "reload: backend removed"]
        if f.what == "stream" and any(e.backend == f.backend for e in removed):
            return "expected: backend removed", last
        return "unexpected", last

    # -- the run ----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        cleanup_stale()
        with Lab() as lab:
            self.lab = lab
            for b in lab.backends:
                attach_host(lab, b)
                self._start_server(b)
            self.weights = dict.fromkeys(lab.backends, 1)
            self.lb = LbNode(lab, self.workdir, self._vips())
            self.lb.start()
            self._wait_healthy()
            self.t0 = time.monotonic()
            threads = [
                threading.Thread(target=self._short, args=("tcp", self._tcp, 10.0), daemon=True),
                threading.Thread(target=self._short, args=("udp", self._udp, 10.0), daemon=True),
            ]
            try:
                self._top_up()
                for t in threads:
                    t.start()
                self._sample()
                k = 0
                next_event = self.t0 + self.step
                next_sample = self.t0 + 2
                end = self.t0 + self.seconds
                while (now := time.monotonic()) < end:
                    if now >= next_event:
                        self._churn(k)
                        k += 1
                        next_event += self.step
                        self._top_up()
                    if now >= next_sample:
                        self._sample()
                        next_sample += 2
                    time.sleep(0.05)
                # Leave everything up and settled for the last word.
                if k % 8 == 1:
                    self._start_server(self.lab.backends[(k // 8) % len(self.lab.backends)])
                self._sample()
            finally:
                self._stop.set()
                for t in threads:
                    if t.is_alive():
                        t.join()
                for _, g in self.groups:
                    g.close()
                self.lb.destroy()
        return self.report()

    def report(self) -> dict[str, Any]:
        kinds: Counter[str] = Counter()
        details = []
        for f in self.failures:
            kind, ev = self._classify(f)
            kinds[kind] += 1
            details.append(
                {
                    "t": round(f.at - self.t0, 2),
                    "what": f.what,
                    "backend": f.backend,
                    "detail": f.detail,
                    "class": kind,
                    "after": None
                    if ev is None
                    else {"t": round(ev.at - self.t0, 2), "kind": ev.kind, "backend": ev.backend},
                }
            )
        rss = [s["rss_kib"] for s in self.samples if s["rss_kib"] is not None]
        bpf = [s["bpf_bytes"] for s in self.samples]
        stream_bytes = sum(s.es.sent for _, g in self.groups for s in g.streams)
        return {
            "seconds": self.seconds,
            "step": self.step,
            "events": [
                {"t": round(e.at - self.t0, 2), "kind": e.kind, "backend": e.backend}
                for e in self.events
            ],
            "attempted": dict(self.attempts),
            "failed": dict(Counter(f.what for f in self.failures)),
            "slow_over_500ms": dict(self.slow),
            "slowest_s": {k: round(v, 3) for k, v in self.slowest.items()},
            "stream_bytes_verified": stream_bytes,
            "classes": dict(kinds),
            "unexpected": kinds["unexpected"],
            "failures": details,
            "memory": {
                "rss_kib": {"start": rss[0], "end": rss[-1], "peak": max(rss)} if rss else None,
                "bpf_bytes": {"start": bpf[0], "end": bpf[-1], "peak": max(bpf)} if bpf else None,
                "tables": {"start": self.samples[0]["tables"], "end": self.samples[-1]["tables"]}
                if self.samples
                else None,
                "conns_peak": max((s["conns"] for s in self.samples), default=0),
                "samples": self.samples,
            },
        }


def check(report: dict[str, Any], max_rss_growth_kib: int, max_bpf_growth: int) -> list[str]:
    """What went wrong, if anything (empty: the soak passed)."""
    problems = []
    if report["unexpected"]:
        problems.append(f"{report['unexpected']} unexpected failures")
    mem = report["memory"]
    if mem["rss_kib"] is None or mem["bpf_bytes"] is None:
        problems.append("no memory samples")
        return problems
    rss = mem["rss_kib"]
    if rss["peak"] - rss["start"] > max_rss_growth_kib:
        problems.append(
            f"daemon RSS grew {rss['peak'] - rss['start']} KiB (> {max_rss_growth_kib})"
        )
    bpf = mem["bpf_bytes"]
    if bpf["end"] - bpf["start"] > max_bpf_growth:
        problems.append(f"BPF map memory grew {bpf['end'] - bpf['start']} B (> {max_bpf_growth})")
    return problems


def summary(report: dict[str, Any]) -> str:
    mem = report["memory"]
    rss, bpf = mem["rss_kib"] or {}, mem["bpf_bytes"] or {}
    lines = [
        f"soak: {report['seconds']:.0f} s, {len(report['events'])} churn events "
        f"(one every {report['step']:.1f} s)",
        f"  attempted: {report['attempted']}",
        f"  failed:    {report['failed']}",
        f"  slow (> 0.5 s): {report['slow_over_500ms']}, slowest: {report['slowest_s']}",
        f"  by class:  {report['classes']}",
        f"  stream bytes verified: {report['stream_bytes_verified']}",
        f"  daemon RSS KiB: start {rss.get('start')} end {rss.get('end')} peak {rss.get('peak')}",
        f"  BPF maps bytes: start {bpf.get('start')} end {bpf.get('end')} peak {bpf.get('peak')}"
        f"; tables {mem['tables']}; conn-table entries peak {mem['conns_peak']}",
    ]
    for f in report["failures"]:
        if f["class"] == "unexpected":
            lines.append(f"  UNEXPECTED t={f['t']} {f['what']} {f['detail']} after {f['after']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="xdplb soak: load and churn in the lab")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--step", type=float, default=None, help="seconds between churn events")
    ap.add_argument("--out", type=Path, default=Path("build/soak.json"))
    ap.add_argument("--max-rss-growth-mib", type=float, default=64)
    ap.add_argument("--max-bpf-growth-kib", type=float, default=1024)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("the soak needs root (network namespaces, BPF)", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".log")
    # The lab's servers and the daemon inherit stderr: their noise (a reset connection's
    # traceback is expected under churn) goes to the log, the summary stays readable.
    saved = os.dup(2)
    try:
        with log.open("w") as f, tempfile.TemporaryDirectory(prefix="xdplb-soak-") as tmp:
            os.dup2(f.fileno(), 2)
            report = Soak(args.seconds, Path(tmp), step=args.step).run()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    problems = check(
        report, int(args.max_rss_growth_mib * 1024), int(args.max_bpf_growth_kib * 1024)
    )
    report["problems"] = problems
    args.out.write_text(json.dumps(report, indent=1))
    print(summary(report))
    print(f"  report: {args.out}, stderr of the lab: {log}")
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
