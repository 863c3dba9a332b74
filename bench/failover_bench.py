"""Failover time: from a backend's failure to the new table being live in the data path.

    .venv/bin/python bench/failover_bench.py [--rounds 5] [--out FILE]

The real daemon (``xdplb run``) in the lab: three backends with host_tc and the lab's
servers, one VIP with an HTTP health check (interval 200 ms, timeout 150 ms, fall 2,
rise 2, jitter 0.1). Each round kills b2's server and polls the pinned maps (the VIP's
lookup table, as lb_xdp reads it) until no bucket points at b2; then starts b2's server
again and polls until b2 is back in the table.

"Live in the data path" is the table lb_xdp looks up: the poll reads which inner map
``lb_tables`` (or ``lb_btables``) points at for the VIP, every 2 ms, and reads that table
when it changes (:class:`TablePoll`), so a time includes the check cadence, the daemon's
reaction, planning (the Maglev build) and the swap, and is late by at most one poll
period (~2 ms; a few ms more on a busy machine).

The failure time is split with the daemon's own log (``asctime``, ms resolution, wall
clock): detection = kill -> "backend ... is down"; reaction = that line -> "applied N
map operations in X ms" (wake-up, plan with the Maglev build, apply); apply = X (the
map updates only). ``xdplb_table_rebuild_seconds`` (its ``_sum`` over the round) is
read too, as a check of the logged apply time.

``run(rounds)`` returns the dict that is printed as JSON. Needs root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from xdplb.core.state import LookupTable
from xdplb.datapath.lb import TABLE_MAPS, LbMaps
from xdplb.datapath.maps import Map
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode

VIP = "198.18.100.1"
VICTIM = "b2"
INTERVAL_MS, TIMEOUT_MS, FALL, RISE, JITTER = 200, 150, 2, 2, 0.1
POLL_SLEEP = 0.002
#: Give up on a transition after this long (the bound is well under 1 s).
GIVE_UP = 10.0
#: Quiet time between a recovery and the next kill (the checks settle).
SETTLE = 0.5

_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}) \S+ \S+ (.*)$")
_APPLIED = re.compile(r"applied (\d+) map operations in ([\d.]+) ms")
_METRIC = re.compile(r"^xdplb_table_rebuild_seconds_(sum|count) ([\d.e+-]+)$", re.M)


def health_check() -> dict[str, Any]:
    return {
        "checker": {"http": {"uri": "/", "codes": [200]}},
        "interval_ms": INTERVAL_MS,
        "timeout_ms": TIMEOUT_MS,
        "fall_count": FALL,
        "rise_count": RISE,
        "jitter": JITTER,
    }


class TablePoll:
    """Whether an address is in the VIP's live table, read from the pinned maps.

    Reading a 65,537-bucket inner map takes the kernel ~14 ms, too coarse and too costly
    to poll. But the daemon never writes a live table: it fills a new inner map and swaps
    it into the outer map. So the poll reads only the outer maps' entry for the VIP (the
    inner map's id, microseconds) and reads the table when that id changes. Backend ids
    are looked up again when the table shows an unknown one."""

    def __init__(self, maps: LbMaps) -> None:
        self.maps = maps
        (params,) = maps.snapshot().vips.values()
        self.key = struct.pack("<I", params.vip_id)
        self.live: tuple[str, int] | None = None
        self.cached: set[str] = set()
        self.table_reads = 0
        self.addr_of: dict[int, str] = {}
        self._refresh()

    def _refresh(self) -> None:
        snap = self.maps.snapshot()
        self.addr_of = {i: str(b.addr) for i, b in snap.backends.items()}

    def _live(self) -> tuple[str, int] | None:
        for name in TABLE_MAPS.values():
            raw = self.maps[name].lookup(self.key)
            if raw is not None:
                return name, struct.unpack("<I", raw)[0]
        return None

    def members(self) -> set[str]:
        live = self._live()
        if live == self.live:
            return self.cached
        self.live = live
        self.table_reads += 1
        if live is None:
            self.cached = set()
            return self.cached
        with Map.from_id(live[1]) as inner:
            table = LookupTable.from_contents(
                next(k for k, n in TABLE_MAPS.items() if n == live[0]), inner.lookup_array()
            )
        ids = table.counts().keys()
        if not ids <= self.addr_of.keys():
            self._refresh()
        self.cached = {self.addr_of.get(i, f"id {i}") for i in ids}
        return self.cached


def _wait(pred: Callable[[], bool], what: str, node: LbNode) -> float:
    """time.monotonic() when ``pred()`` first held; RuntimeError after GIVE_UP."""
    t0 = time.monotonic()
    while True:
        at = time.monotonic()  # what pred() reads first is the live table's id
        if pred():
            return at
        if time.monotonic() - t0 > GIVE_UP:
            raise RuntimeError(f"{what}: not after {GIVE_UP} s\n{node.log_tail()}")
        time.sleep(POLL_SLEEP)


def _log_events(path: Path, offset: int, addr: str) -> list[tuple[float, str, str]]:
    """(wall-clock time, kind, text) of the daemon's log lines after ``offset``: kind is
    "down"/"up" for ``addr``'s health changes, "applied" for a plan applied."""
    with path.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    events: list[tuple[float, str, str]] = []
    for line in text.splitlines():
        m = _LOG_LINE.match(line)
        if m is None:
            continue
        at = datetime.datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
        msg = m[2]
        if f"backend {addr} is down" in msg:
            events.append((at, "down", msg))
        elif f"backend {addr} is up" in msg:
            events.append((at, "up", msg))
        elif _APPLIED.search(msg):
            events.append((at, "applied", msg))
    return events


def _split(events: list[tuple[float, str, str]], kind: str, since: float) -> dict[str, Any]:
    """From the log: when ``addr`` went ``kind`` and the first plan applied after that."""
    marked = next((at for at, k, _ in events if k == kind and at >= since - 0.002), None)
    if marked is None:
        return {"log_ok": False}
    applied = next(((at, msg) for at, k, msg in events if k == "applied" and at >= marked), None)
    if applied is None:
        return {"log_ok": False}
    m = _APPLIED.search(applied[1])
    assert m is not None
    return {
        "log_ok": True,
        "detect_ms": round((marked - since) * 1000, 1),
        "react_ms": round((applied[0] - marked) * 1000, 1),
        "apply_ms": float(m[2]),
        "ops": int(m[1]),
    }


def _rebuild_metric(node: LbNode) -> tuple[float, float]:
    """(sum, count) of xdplb_table_rebuild_seconds from the daemon's /metrics."""
    with node.api() as api:
        text = api.get("/metrics").text
    got = {k: float(v) for k, v in _METRIC.findall(text)}
    return got.get("sum", 0.0), got.get("count", 0.0)


def _round(
    lab: Lab, node: LbNode, poll: TablePoll, server: subprocess.Popen[str]
) -> tuple[dict[str, Any], subprocess.Popen[str]]:
    addr = str(lab.addr(VICTIM))
    offset = node.log_path.stat().st_size
    sum0, count0 = _rebuild_metric(node)
    wall0 = time.time()
    server.kill()
    killed = time.monotonic()
    server.wait()
    out = _wait(lambda: addr not in poll.members(), f"{VICTIM} out of the table", node)
    sum1, count1 = _rebuild_metric(node)
    time.sleep(SETTLE)  # a few failing checks more: the state is settled down
    server = lab.start_servers(names=[VICTIM])[0]
    listening, wall1 = time.monotonic(), time.time()
    back = _wait(lambda: addr in poll.members(), f"{VICTIM} back in the table", node)
    time.sleep(0.05)  # let the daemon's log line be written
    events = _log_events(node.log_path, offset, addr)
    fail = _split(events, "down", wall0)
    rec = _split(events, "up", wall1)
    res = {
        "failure_to_out_ms": round((out - killed) * 1000, 1),
        "failure": fail,
        "rebuilds_during_failure": int(count1 - count0),
        "apply_ms_metric": round((sum1 - sum0) * 1000, 2),
        "recovery_to_in_ms": round((back - listening) * 1000, 1),
        "recovery": rec,
    }
    time.sleep(SETTLE)
    return res, server


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 1), "max": round(max(xs), 1)}


def run(rounds: int = 5) -> dict[str, Any]:
    """``rounds`` fail/recover cycles of b2; results as a dict (see the module doc)."""
    if os.geteuid() != 0:
        raise PermissionError("the failover benchmark needs root (network namespaces, BPF)")
    cleanup_stale()
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="xdplb-failover-") as tmp, Lab(backends=3) as lab:
        for name in lab.backends:
            attach_host(lab, name)
        servers = dict(zip(lab.backends, lab.start_servers(), strict=True))
        backends = [{"address": str(lab.addr(b))} for b in lab.backends]
        vips = [{"address": VIP, "port": 80, "health": health_check(), "backends": backends}]
        node = LbNode(lab, Path(tmp), vips)
        node.start()
        with node.maps() as maps:
            poll = TablePoll(maps)
            _wait(lambda: len(poll.members()) == len(lab.backends), "all backends in", node)
            time.sleep(SETTLE)
            for _ in range(rounds):
                r, servers[VICTIM] = _round(lab, node, poll, servers[VICTIM])
                per_round.append(r)
            table_reads = poll.table_reads
        node.destroy()
    interval = INTERVAL_MS / 1000
    fail = [r["failure"] for r in per_round if r["failure"]["log_ok"]]
    rec = [r["recovery"] for r in per_round if r["recovery"]["log_ok"]]
    return {
        "summary": {
            "failure_to_out_ms": _stats([r["failure_to_out_ms"] for r in per_round]),
            "failure_detect_ms": _stats([f["detect_ms"] for f in fail]),
            "failure_react_ms": _stats([f["react_ms"] for f in fail]),
            "failure_apply_ms": _stats([f["apply_ms"] for f in fail]),
            "recovery_to_in_ms": _stats([r["recovery_to_in_ms"] for r in per_round]),
            "recovery_detect_ms": _stats([r["detect_ms"] for r in rec]),
            "recovery_apply_ms": _stats([r["apply_ms"] for r in rec]),
        },
        # interval x count: the checks alone; + 1 interval: the phase of the first failed
        # check; at the jitter's longest interval.
        "bound_ms": {
            "failure": round(interval * FALL * 1000, 1),
            "failure_plus_interval": round(interval * (FALL + 1) * 1000, 1),
            "failure_plus_interval_jitter": round(interval * (1 + JITTER) * (FALL + 1) * 1000, 1),
            "recovery": round(interval * RISE * 1000, 1),
            "recovery_plus_interval": round(interval * (RISE + 1) * 1000, 1),
            "recovery_plus_interval_jitter": round(interval * (1 + JITTER) * (RISE + 1) * 1000, 1),
        },
        "rounds": per_round,
        "meta": {
            "rounds": rounds,
            "backends": 3,
            "check": health_check(),
            "table_size": 65537,
            "poll_sleep_ms": POLL_SLEEP * 1000,
            "table_reads": table_reads,
            "kernel": os.uname().release,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="fail/recover cycles")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    res = run(args.rounds)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
