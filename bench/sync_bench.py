"""Session sync between two balancer nodes (docs/sync.md, issue 14): a full copy, the
incremental stream, the export ring's read, and the lag from a new flow on one node to
its session on the other.

    .venv/bin/python bench/sync_bench.py [--out bench/sync_results.json] [--quick]
                                         [--entries N] [--incremental N] [--flows N]
                                         [--conn-table N] [--refresh-interval S]

Two real instances of lb_xdp, ``bench-<pid>-sa`` (A) and ``bench-<pid>-sb`` (B), each with
its own pinned maps, configured through the planner with the same VIP and 20 backends
(so that the backend addresses match; each node's backend ids are its own) and with a
``sync`` section: A listens on 127.0.0.1, B listens too and has A as its only peer.
A's SyncNode runs in a child process (this script with ``--serve-a``, its own
interpreter and event loop, A's maps opened from their pins), B's in this process: the
two sides of the stream do not share a GIL or a loop. Frames go through A's lb_xdp with
BPF_PROG_TEST_RUN from a thread inside a network namespace made for the purpose (a veth
with the balancer's addresses, permanent neighbours for the backends), so that lb_xdp
takes its real encapsulate + FIB + XDP_TX path; the sockets stay in the host's
namespace, on 127.0.0.1 only.

1. ``ring_drain``: N new-flow SYNs through A's lb_xdp (export on, no insert budget),
   then one ``SessionExport.drain_records()`` of the N records they left in
   ``lb_sess_export``, timed; and the conversion the pump does next (``vip_mask`` +
   ``to_wire``), timed apart. Before the SyncNodes start; A's table is flushed after.
2. ``full_sync``: A's table filled with live TCP_EST sessions to the VIP (as bench.py's
   session import), then B's SyncNode started: from its start (its dial) to its matching
   END, and B's live sessions counted. Bytes: every frame A's SyncNode encodes, summed
   by wrapping ``xdplb.sync.wire.encode`` in the child (nothing in src is changed), and
   the kernel's ``bytes_acked`` of A's socket (``ss -ti``) as a check.
3. ``incremental``: A's child feeds its publisher the way the pump does after draining
   the ring (records of the export ring's layout, ``vip_mask``, ``to_wire`` with NEW,
   ``_publish``), batch after batch with one yield to its loop between them, and the
   time runs until B has received every entry (``status().peers[0].received``); B's
   table flushed before each run, runs of 1,000- and 10,000-record batches interleaved.
4. ``lag``: with both nodes running and B synced, one new-flow SYN at a time through A's
   lb_xdp; A's own pump drains the ring every ``batch_delay_ms`` (10); this process
   polls B's table (``ConnTable.get``, every 0.2 ms, from the frames' thread, B's loop
   running meanwhile) until the flow's session is there.

Needs root (BPF, a network namespace). Both instances and the namespace are removed on
the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import ipaddress
import json
import logging
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import _git_rev, cpu_model
from xdplb.config import Config, parse_config
from xdplb.control.planner import plan
from xdplb.core import abi
from xdplb.datapath import clock, conns
from xdplb.datapath.conns import EXPORT_DTYPE, SessionExport
from xdplb.datapath.lb import LbDatapath, LbMaps, destroy
from xdplb.lab import netns
from xdplb.model import frames
from xdplb.model.state import Flow
from xdplb.sync import convert, wire
from xdplb.sync.convert import TableView, view_from
from xdplb.sync.node import SyncNode, SyncSource

log = logging.getLogger("sync_bench")

# --- the two nodes' configuration ----------------------------------------------------------

LB_V4 = ipaddress.IPv4Address("198.18.0.2")
VIP = ipaddress.IPv4Address("198.18.100.1")
VIP_PORT = 80
BACKENDS = [ipaddress.IPv4Address(f"198.18.0.{11 + i}") for i in range(20)]
LB_MAC = bytes.fromhex("0200c6120002")
XDP_TX = 3
#: Sources of the sessions each measurement makes (distinct, so each is new to B).
FILL_BASE = int(ipaddress.IPv4Address("203.0.0.0"))
INCR_BASE = int(ipaddress.IPv4Address("100.64.0.0"))
DRAIN_BASE = int(ipaddress.IPv4Address("172.16.0.0"))
LAG_BASE = int(ipaddress.IPv4Address("172.30.0.0"))
BATCH_DELAY_MS = 10
#: Seconds of B's poll of its table between two reads, in the lag measurement.
POLL = 0.0002
LAG_TIMEOUT = 2.0
WAIT_TIMEOUT = 300.0


def node_config(
    instance: str,
    node: str,
    port: int,
    key: str,
    conn_table: int,
    peers: list[dict[str, str]],
    refresh: float = 5.0,
) -> dict[str, Any]:
    return {
        "instance": instance,
        "tunnel": {"source_v4": str(LB_V4)},
        "limits": {"conn_table": conn_table},
        # No insert budget: every SYN of the ring measurement is recorded (and exported).
        "flood": {"conn_insert_budget": 0},
        "sync": {
            "listen": f"127.0.0.1:{port}",
            "node": node,
            "key": key,
            "peers": peers,
            "batch_delay_ms": BATCH_DELAY_MS,
            "refresh_interval": refresh,
            "copy_timeout": 600,
        },
        "vips": [
            {
                "address": str(VIP),
                "port": VIP_PORT,
                "protocol": "tcp",
                "encap": "gue",
                "backends": [{"address": str(b)} for b in BACKENDS],
            }
        ],
    }


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 (held together while chosen, so distinct)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def session_records(
    base: int, n: int, bids: npt.NDArray[np.uint16], last_seen: int
) -> npt.NDArray[np.void]:
    """``n`` TCP_EST sessions to the VIP from ``base + i`` (as bench.py's run_sessions),
    backends in turn: records of ``conns.SESSION_DTYPE``."""
    i = np.arange(n, dtype=np.uint32)
    keys = np.zeros((n, 10), dtype=np.uint32)
    keys[:, 0] = (np.uint32(base) + i).byteswap()  # network order
    keys[:, 4] = np.frombuffer(VIP.packed, dtype="<u4")[0]
    ports = (1024 + i % 60000).astype(np.uint16).byteswap().astype(np.uint32)
    keys[:, 8] = ports | (np.uint32(VIP_PORT << 8) << 16)  # dport in network order
    keys[:, 9] = abi.IPPROTO_TCP
    return conns.records(keys, bids[i % len(bids)], i, abi.SessState.TCP_EST, last_seen)


def active_ids(maps: LbMaps) -> npt.NDArray[np.uint16]:
    return np.array(
        sorted(i for i, b in maps.snapshot().backends.items() if b.active), dtype=np.uint16
    )


# --- the network namespace of the frames -----------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def frames_netns(name: str) -> Iterator[None]:
    """netns ``name``: veth lb0 <-> lb0p, lb0 with the balancer's address, forwarding on,
    a permanent neighbour for every backend (as bench_harness.lab_netns). Deleted on the
    way out."""
    _ip("netns", "add", name)
    try:
        mac = ":".join(f"{x:02x}" for x in LB_MAC)
        _ip("-n", name, "link", "add", "lb0", "address", mac, "type", "veth", "peer", "lb0p")
        for dev in ("lo", "lb0", "lb0p"):
            _ip("-n", name, "link", "set", dev, "up")
        _ip("-n", name, "addr", "add", f"{LB_V4}/24", "dev", "lb0")
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.forwarding=1"):
            netns.run(name, ["sysctl", "-qw", key])
        for b in BACKENDS:
            lladdr = ":".join(f"{x:02x}" for x in bytes([2, 0, 0, 0, 4, b.packed[-1]]))
            neigh = ["neigh", "replace", str(b), "lladdr", lladdr, "dev", "lb0"]
            _ip("-n", name, *neigh, "nud", "permanent")
        yield
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def syn_flow(base: int, k: int) -> Flow:
    return Flow(ipaddress.IPv4Address(base + k // 50000), VIP, 10000 + k % 50000, VIP_PORT, 6)


class Frames:
    """A's lb_xdp run from threads inside the frames' namespace."""

    def __init__(self, lb: LbDatapath, ns: str) -> None:
        self.lb, self.ns = lb, ns
        #: Set when the run ends early: a thread still sending flows stops.
        self.stop = threading.Event()

    def call(self, fn: Callable[[int], Any]) -> Any:
        """``fn(ifindex)`` in a thread inside the namespace (blocking)."""
        out: list[Any] = []
        err: list[BaseException] = []

        def body() -> None:
            try:
                with netns.enter(self.ns):
                    out.append(fn(socket.if_nametoindex("lb0")))
            except BaseException as e:
                err.append(e)

        t = threading.Thread(target=body, name="frames")
        t.start()
        t.join()
        if err:
            raise err[0]
        return out[0]

    def run(self, flows: list[Flow], ifindex: int) -> int:
        """Every flow's SYN once; how many were sent to a backend (XDP_TX)."""
        prog = self.lb.program
        tx = 0
        for f in flows:
            tx += prog.test_run(frames.frame(f), ingress_ifindex=ifindex).retval == XDP_TX
        return tx


# --- A's side: the child process --------------------------------------------------------------


class WireCount:
    """Every frame A's SyncNode encodes, by message type: frames, bytes, entries."""

    def __init__(self) -> None:
        self.by_type: dict[str, dict[str, int]] = {}
        self._encode = wire.encode

    def encode(self, key: bytes, node: str, epoch: int, seq: int, msg: wire.Message) -> bytes:
        out = self._encode(key, node, epoch, seq, msg)
        c = self.by_type.setdefault(type(msg).__name__, {"frames": 0, "bytes": 0, "entries": 0})
        c["frames"] += 1
        c["bytes"] += len(out)
        if isinstance(msg, wire.Entries):
            c["entries"] += len(msg.entries)
        return out


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def serve_a() -> int:
    """The child: A's SyncNode on A's pinned maps, driven by JSON lines on stdin."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    spec = json.loads(await reader.readline())
    cfg = parse_config(spec["config"])
    assert cfg.sync is not None and cfg.sync_node is not None
    count = WireCount()
    maps = LbMaps.from_pins(Path(spec["pin_dir"]))
    export = SessionExport(maps["lb_sess_export"])
    view = view_from(maps.snapshot(), cfg)
    bids = active_ids(maps)
    node = SyncNode(
        cfg.sync, cfg.sync_node, cfg.sync.secret(), SyncSource(maps.conns, export, lambda: view)
    )
    try:
        with mock.patch.object(wire, "encode", count.encode):
            await node.start()
            _reply({"ready": True})
            while line := await reader.readline():
                cmd = json.loads(line)
                if cmd["cmd"] == "wire":
                    _reply({"by_type": count.by_type, "sent": node.sent})
                elif cmd["cmd"] == "publish":
                    _reply(await publish(node, view, bids, cmd["total"], cmd["batch"], cmd["base"]))
                elif cmd["cmd"] == "status":
                    _reply(node.status().model_dump(mode="json"))
                elif cmd["cmd"] == "quit":
                    break
    finally:
        await node.close()
        export.close()
        maps.close()
    _reply({"bye": True})
    return 0


async def publish(
    node: SyncNode, view: TableView, bids: npt.NDArray[np.uint16], total: int, batch: int, base: int
) -> dict[str, Any]:
    """``total`` new sessions through the pump's path, ``batch`` records at a time."""
    recs = np.zeros(total, dtype=EXPORT_DTYPE)
    recs["type"] = abi.ExportType.NEW
    recs["sess"] = session_records(base, total, bids, clock.now_ticks())
    sent, overflows = node.sent, node.overflows
    t0 = time.monotonic()
    for i in range(0, total, batch):
        node.publish_records(recs[i : i + batch], view)
        await asyncio.sleep(0)
    t1 = time.monotonic()
    return {
        "t0": t0,
        "published": t1,
        "sent": node.sent - sent,
        "overflows": node.overflows - overflows,
    }


class ChildA:
    """The parent's handle on A's child process."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, cfg: dict[str, Any], pin_dir: Path) -> ChildA:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            "--serve-a",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        child = cls(proc)
        try:
            await child.send({"config": cfg, "pin_dir": str(pin_dir)})
            await child.read(60)
        except BaseException:
            await child.stop()
            raise
        return child

    async def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def read(self, timeout: float = WAIT_TIMEOUT) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            rc = await self.proc.wait()
            raise RuntimeError(f"A's process ended (exit status {rc})")
        out: dict[str, Any] = json.loads(line)
        return out

    async def call(self, obj: dict[str, Any], timeout: float = WAIT_TIMEOUT) -> dict[str, Any]:
        await self.send(obj)
        return await self.read(timeout)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                await self.call({"cmd": "quit"}, 10)
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except (TimeoutError, asyncio.CancelledError):
                self.proc.kill()
                await self.proc.wait()


# --- measurements ---------------------------------------------------------------------------


def ring_drain(
    lb: LbDatapath, fr: Frames, view: TableView, per_round: int, rounds: int
) -> dict[str, Any]:
    export = SessionExport(lb["lb_sess_export"])
    try:
        n = min(per_round, export.capacity - 64)
        runs = []
        for r in range(rounds):
            flows = [syn_flow(DRAIN_BASE + r * 256, k) for k in range(n)]
            export.skip()
            tx = fr.call(functools.partial(fr.run, flows))
            t0 = time.perf_counter()
            recs = export.drain_records()
            t1 = time.perf_counter()
            keep = convert.vip_mask(recs["sess"], view.synced)
            msgs = convert.to_wire(recs["sess"][keep], wire.Op.NEW, view, clock.now_ticks())
            t2 = time.perf_counter()
            if tx != n or len(recs) != n or int(np.count_nonzero(recs["type"] == 1)) != n:
                raise RuntimeError(
                    f"ring round {r}: {n} SYNs, {tx} sent to a backend, {len(recs)} records"
                )
            if sum(len(m.entries) for m in msgs) != n:
                raise RuntimeError(f"ring round {r}: to_wire kept fewer than {n} records")
            runs.append(
                {
                    "records": len(recs),
                    "drain_ns_per_record": round((t1 - t0) * 1e9 / n, 1),
                    "to_wire_ns_per_record": round((t2 - t1) * 1e9 / n, 1),
                }
            )
    finally:
        export.close()
    return {
        "method": (
            f"{n} new-flow TCP SYNs (distinct source ports and addresses) through A's lb_xdp "
            "by BPF_PROG_TEST_RUN (lb_config has CFG_F_EXPORT, set by the planner since "
            "sync is configured; no insert budget), every one XDP_TX and one NEW record "
            "in lb_sess_export; then one SessionExport.drain_records() of them, timed "
            "with perf_counter (ns per record = time / records); then the pump's "
            "conversion of the same records (vip_mask + to_wire), timed apart. Median of "
            f"{rounds} rounds; the ring holds {export.capacity} records."
        ),
        "records_per_round": n,
        "drain_ns_per_record": statistics.median(r["drain_ns_per_record"] for r in runs),
        "to_wire_ns_per_record": statistics.median(r["to_wire_ns_per_record"] for r in runs),
        "rounds": runs,
    }


def fill(lb: LbDatapath, view: TableView, entries: int) -> dict[str, int]:
    """``entries`` live TCP_EST sessions into A's table: one import of ``entries`` (99% of
    them must be live after it: a set's 5th flow evicts one of its 4), then imports of
    further new flows, as many as are missing, until ``entries`` are live."""
    bids = active_ids(lb)
    made = 0
    live = 0
    first = 0
    for round_ in range(20):
        n = entries - live
        if n <= 0:
            break
        recs = session_records(FILL_BASE + made, n, bids, clock.now_ticks())
        made += n
        lb.conns.import_records(recs, seed=view.seed, gen=view.gen, timeouts=view.timeouts)
        live = lb.conns.count(view.gen, view.timeouts)
        if round_ == 0:
            first = live
            if live < entries * 99 // 100:
                raise RuntimeError(f"only {live} of {entries} sessions live in A's table")
    return {"live": live, "imported": made, "live_after_first_import": first}


def socket_bytes(port: int) -> dict[str, int] | None:
    """The kernel's byte counters of the established socket on local port ``port``."""
    try:
        out = subprocess.run(
            ["ss", "-tinH", "state", "established", "sport", "=", f":{port}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    fields = r"\b(bytes_sent|bytes_acked|bytes_retrans|bytes_received|data_segs_out):(\d+)"
    got = {k: int(v) for k, v in re.findall(fields, out)}
    return got or None


async def wait_until(what: str, cond: Callable[[], bool], timeout: float, step: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(step)
    return time.monotonic()


async def full_sync(
    a: ChildA,
    b: SyncNode,
    lb_b: LbDatapath,
    view_b: TableView,
    in_a: dict[str, int],
    port_a: int,
) -> dict[str, Any]:
    t0 = time.monotonic()
    await b.start()

    def copied() -> bool:
        p = b.status().peers[0]
        if p.state == "retrying":
            raise RuntimeError(f"B's subscription to A failed: {p.error}")
        return p.copies >= 1

    t1 = await wait_until("B's full copy from A", copied, WAIT_TIMEOUT, 0.002)
    st = b.status().peers[0]
    got = await a.call({"cmd": "wire"})
    kernel = socket_bytes(port_a)
    imported = await asyncio.to_thread(lb_b.conns.count, view_b.gen, view_b.timeouts)
    by_type: dict[str, dict[str, int]] = got["by_type"]
    wire_bytes = sum(c["bytes"] for c in by_type.values())
    ent = by_type.get("Entries", {"frames": 0, "bytes": 0, "entries": 0})
    n = st.last_copy_entries or 0
    secs = t1 - t0
    return {
        "method": (
            "A's table filled with live TCP_EST sessions to the VIP (conns.records + "
            "import_records, 20 backends in turn; flows a set's fifth flow evicted made up "
            "by importing as many new ones again, until exactly the number asked is live), "
            "then B's SyncNode started with A as "
            "its peer: seconds from B's start (its dial to 127.0.0.1) to B's status "
            "showing the copy's matching END (polled every 2 ms; last_copy_ms is B's own "
            "figure, from its SUBSCRIBE to the END). A's SyncNode runs in a child process, "
            "B's in this one (separate interpreters and loops, not pinned to CPUs). "
            "imported_b: B's live sessions "
            "after the copy (ConnTable.count). Bytes: every frame A's SyncNode encoded "
            "(xdplb.sync.wire.encode wrapped in A's process; BEGIN, ENTRIES, END and any "
            "KEEPALIVE), and the kernel's bytes_acked of A's socket (ss -ti) as a check "
            "(its bytes_sent adds what TCP retransmitted, bytes_retrans); "
            "bytes_per_entry = all frames' bytes / entries copied."
        ),
        "entries_live_in_a": in_a["live"],
        "a_fill": in_a,
        "entries_copied": n,
        "imported_b": imported,
        "seconds": round(secs, 3),
        "last_copy_ms": st.last_copy_ms,
        "entries_per_s": round(n / secs) if secs > 0 else None,
        "bytes_on_wire": wire_bytes,
        "entries_frames": ent["frames"],
        "entries_frame_bytes": ent["bytes"],
        "bytes_per_entry": round(wire_bytes / n, 3) if n else None,
        "kernel_bytes_acked": kernel.get("bytes_acked") if kernel else None,
        "kernel_tcp_info": kernel,
        "frames_by_type": by_type,
        "b_skipped": dict(b.skipped),
        "b_imported_results": dict(b.imported),
    }


def received_all(b: SyncNode, want: int) -> bool:
    return b.status().peers[0].received >= want


async def incremental(
    a: ChildA,
    b: SyncNode,
    total: int,
    batches: list[int],
    repeats: int,
    flush_b: Callable[[], None],
) -> dict[str, Any]:
    runs = []
    for k in range(repeats * len(batches)):
        batch = batches[k % len(batches)]
        flush_b()  # every run imports into free ways, whatever the runs before it left
        before = b.status().peers[0]
        await a.send(
            {"cmd": "publish", "total": total, "batch": batch, "base": INCR_BASE + k * (1 << 20)}
        )
        want = before.received + total
        t_done = await wait_until(
            f"B receiving {total} entries",
            functools.partial(received_all, b, want),
            WAIT_TIMEOUT,
            0.001,
        )
        pub = await a.read()
        after = b.status().peers[0]
        secs = t_done - pub["t0"]
        runs.append(
            {
                "batch": batch,
                "entries": total,
                "seconds": round(secs, 3),
                "entries_per_s": round(total / secs),
                "publish_seconds": round(pub["published"] - pub["t0"], 3),
                "sent": pub["sent"],
                "received_b": after.received - before.received,
                "imported_b": after.imported - before.imported,
                "overflows": pub["overflows"],
            }
        )
        if pub["overflows"] or after.imported - before.imported < total * 99 // 100:
            raise RuntimeError(f"incremental run {runs[-1]}: entries lost")
    by_batch = {
        str(n): round(statistics.median(r["entries_per_s"] for r in runs if r["batch"] == n))
        for n in batches
    }
    return {
        "method": (
            f"{total} new TCP_EST sessions per run, made in A's process as records of the "
            "export ring's layout (type NEW) and fed to A's publisher the way SyncNode._pump "
            "does after drain_records (vip_mask, to_wire with NEW, _publish), one batch "
            "after another with one yield to A's loop between batches; seconds from the "
            "first batch to B's status counting every entry received (received is counted "
            "as each message is imported; polled every 1 ms). B's table is flushed (a new "
            "generation) before each run, so that every run imports into free ways. "
            f"{repeats} runs per batch size, interleaved; entries_per_s is the median of "
            "all runs, by_batch the median per batch size. A's process and B's are "
            "separate (not pinned to CPUs). The ring read that precedes this in the pump "
            "is measured separately (ring_drain)."
        ),
        "entries_per_s": round(statistics.median(r["entries_per_s"] for r in runs)),
        "entries_per_s_by_batch": by_batch,
        "runs": runs,
    }


@dataclass
class LagRun:
    lags: list[float] = field(default_factory=list)
    #: Seconds into the run of each flow of ``lags``.
    when: list[float] = field(default_factory=list)
    missing: int = 0
    #: Polls of B's table that found the flow's set held by a writer for all of
    #: ConnTable.get's tries (TornRead), then polled again.
    torn: int = 0


def present(lb_b: LbDatapath, key: bytes, seed_b: int, run: LagRun) -> bool:
    try:
        return lb_b.conns.get(key, seed_b) is not None
    except conns.TornRead:
        run.torn += 1
        return False


def lag_flows(
    fr: Frames, lb_b: LbDatapath, seed_b: int, n: int, spacing: float, ifindex: int
) -> LagRun:
    """In the frames' thread: one SYN at a time through A, then B's table polled for it."""
    prog = fr.lb.program
    run = LagRun()
    start = time.monotonic()
    for k in range(n):
        if fr.stop.is_set():
            break
        flow = syn_flow(LAG_BASE, k)
        data, key = frames.frame(flow), flow.key()
        t0 = time.monotonic()
        if prog.test_run(data, ingress_ifindex=ifindex).retval != XDP_TX:
            raise RuntimeError(f"lag flow {k}: not sent to a backend")
        while not present(lb_b, key, seed_b, run):
            if time.monotonic() - t0 > LAG_TIMEOUT:
                run.missing += 1
                break
            time.sleep(POLL)
        else:
            run.lags.append((time.monotonic() - t0) * 1000)
            run.when.append(t0 - start)
        pause = start + (k + 1) * spacing - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return run


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def lag(fr: Frames, lb_b: LbDatapath, seed_b: int, n: int) -> dict[str, Any]:
    spacing = 0.020
    got: LagRun = await asyncio.to_thread(
        fr.call, lambda ifindex: lag_flows(fr, lb_b, seed_b, n, spacing, ifindex)
    )
    return {
        "method": (
            f"{n} new flows, one TCP SYN each through A's lb_xdp by BPF_PROG_TEST_RUN, "
            f"{spacing * 1000:.0f} ms apart, with both SyncNodes running and B synced: A's "
            f"own pump (its process) drains lb_sess_export every batch_delay_ms "
            f"({BATCH_DELAY_MS}) and publishes; from just before the test run to the "
            f"flow's session found in B's table (ConnTable.get with B's seed, polled every "
            f"{POLL * 1000:.1f} ms from the frames' thread while B's loop runs in this "
            f"process's main thread). A flow not there within {LAG_TIMEOUT:g} s counts "
            "as missing; a poll that found the set held by a writer all through "
            "ConnTable.get's tries (TornRead) is counted in torn_reads and polled again. "
            "sync.refresh_interval as configured (meta; 5 s, the default): A's "
            "refresh reads its whole table (the million sessions of the copy included; "
            "only those lb_xdp used are sent) every interval, on A's loop, meanwhile; "
            "'slowest' lists the five slowest flows as [seconds into the run, ms]."
        ),
        "flows": n,
        "found": len(got.lags),
        "missing": got.missing,
        "torn_reads": got.torn,
        "lag_ms": {
            "p50": round(_pct(got.lags, 0.5), 2) if got.lags else None,
            "p99": round(_pct(got.lags, 0.99), 2) if got.lags else None,
            "max": round(max(got.lags), 2) if got.lags else None,
            "mean": round(statistics.fmean(got.lags), 2) if got.lags else None,
            "min": round(min(got.lags), 2) if got.lags else None,
        },
        # The five slowest: seconds into the run, ms.
        "slowest": [
            [round(w, 3), round(x, 2)] for x, w in sorted(zip(got.lags, got.when, strict=True))[-5:]
        ],
    }


# --- the run ------------------------------------------------------------------------------------


def load(cfg: Config, hz: int) -> LbDatapath:
    lb = LbDatapath(cfg.instance, lim=cfg.limits)
    try:
        lb.apply(plan(cfg, lb.snapshot(), hz=hz))
    except BaseException:
        lb.close()
        raise
    return lb


async def run(args: argparse.Namespace, inst_a: str, inst_b: str, ns: str) -> dict[str, Any]:
    hz = clock.hz()
    key = secrets.token_hex(32)
    port_a, port_b = free_ports(2)
    raw_a = node_config(inst_a, "sa", port_a, key, args.conn_table, [], args.refresh_interval)
    raw_b = node_config(
        inst_b,
        "sb",
        port_b,
        key,
        args.conn_table,
        [{"node": "sa", "address": f"127.0.0.1:{port_a}"}],
        args.refresh_interval,
    )
    cfg_a, cfg_b = parse_config(raw_a), parse_config(raw_b)
    assert cfg_b.sync is not None and cfg_b.sync_node is not None
    res: dict[str, Any] = {}
    # SIGTERM cancels this task (its cleanups run as it unwinds); a KeyboardInterrupt
    # raised by a signal handler in the middle of the loop could lose a task's wakeup.
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    assert me is not None
    loop.add_signal_handler(signal.SIGTERM, me.cancel)
    b: SyncNode | None = None
    try:
        with contextlib.ExitStack() as stack:
            lb_a = stack.enter_context(contextlib.closing(load(cfg_a, hz)))
            lb_b = stack.enter_context(contextlib.closing(load(cfg_b, hz)))
            if not lb_a.snapshot().config.flags & abi.CFG_F_EXPORT:
                raise RuntimeError("the planner did not set CFG_F_EXPORT on A")
            fr = Frames(lb_a, ns)

            log.warning("ring drain: %d rounds of %d SYNs", args.drain_rounds, args.drain_records)
            res["ring_drain"] = ring_drain(
                lb_a, fr, view_from(lb_a.snapshot(), cfg_a), args.drain_records, args.drain_rounds
            )
            lb_a.flush_conns()  # the ring's SYNs are not part of the copy
            view_a = view_from(lb_a.snapshot(), cfg_a)
            t0 = time.monotonic()
            in_a = fill(lb_a, view_a, args.entries)
            log.warning("A filled: %s in %.1f s", in_a, time.monotonic() - t0)

            a = await ChildA.start(raw_a, lb_a.pin_dir)
            try:
                view_b = view_from(lb_b.snapshot(), cfg_b)
                export_b = stack.enter_context(
                    contextlib.closing(SessionExport(lb_b["lb_sess_export"]))
                )
                views = {"b": view_b}

                def flush_b() -> None:
                    lb_b.flush_conns()
                    views["b"] = view_from(lb_b.snapshot(), cfg_b)

                b = SyncNode(
                    cfg_b.sync,
                    cfg_b.sync_node,
                    cfg_b.sync.secret(),
                    SyncSource(lb_b.conns, export_b, lambda: views["b"]),
                )
                log.warning("full sync of %d sessions", in_a["live"])
                res["full_sync"] = await full_sync(a, b, lb_b, view_b, in_a, port_a)
                log.warning("incremental: %d entries per run", args.incremental)
                res["incremental"] = await incremental(
                    a, b, args.incremental, args.batches, args.repeats, flush_b
                )
                log.warning("lag: %d flows", args.flows)
                res["lag"] = await lag(fr, lb_b, view_b.seed, args.flows)
                res["a_status"] = await a.call({"cmd": "status"})
                res["b_status"] = b.status().model_dump(mode="json")
            finally:
                fr.stop.set()
                if b is not None:
                    await b.close()
                await a.stop()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _term)
    return res


def print_summary(res: dict[str, Any]) -> None:
    f, i, r, lg = res["full_sync"], res["incremental"], res["ring_drain"], res["lag"]
    print(
        f"full sync: {f['entries_copied']:,} entries in {f['seconds']:.2f} s "
        f"({f['entries_per_s']:,} entries/s, B's last_copy_ms {f['last_copy_ms']}), "
        f"{f['imported_b']:,} live in B, {f['bytes_on_wire']:,} bytes "
        f"({f['bytes_per_entry']} bytes/entry; the kernel's bytes_acked {f['kernel_bytes_acked']})"
    )
    print(
        f"incremental: {i['entries_per_s']:,} entries/s (median of {len(i['runs'])} runs of "
        f"{i['runs'][0]['entries']:,}; by batch size: "
        + ", ".join(f"{k}: {v:,}" for k, v in i["entries_per_s_by_batch"].items())
        + ")"
    )
    print(
        f"ring drain: {r['drain_ns_per_record']:.0f} ns/record "
        f"(+ vip_mask/to_wire {r['to_wire_ns_per_record']:.0f} ns/record)"
    )
    m = lg["lag_ms"]
    print(
        f"lag A -> B: p50 {m['p50']} ms, p99 {m['p99']} ms, max {m['max']} ms "
        f"({lg['found']}/{lg['flows']} found, {lg['torn_reads']} torn reads of B's table)"
    )
    meta = res["meta"]
    print(f"{meta['cpu_model']}, {meta['cpus']} CPUs, kernel {meta['kernel']}, {meta['seconds']} s")


def _term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM outside the event loop: unwind through every cleanup (inside it, the
    loop cancels the run instead)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/sync_results.json"))
    ap.add_argument("--quick", action="store_true", help="smaller run (100k entries, < 30 s)")
    ap.add_argument("--entries", type=int, default=None, help="full copy (1,000,000)")
    ap.add_argument("--conn-table", type=int, default=None, help="limits.conn_table")
    ap.add_argument("--incremental", type=int, default=None, help="entries per run (500,000)")
    ap.add_argument("--flows", type=int, default=None, help="lag flows (300)")
    ap.add_argument(
        "--refresh-interval", type=float, default=5.0, help="sync.refresh_interval (5, its default)"
    )
    ap.add_argument("--serve-a", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.serve_a:
        return asyncio.run(serve_a())
    q = args.quick
    args.entries = args.entries or (100_000 if q else 1_000_000)
    args.conn_table = args.conn_table or (1 << 20 if q else 1 << 22)
    args.incremental = args.incremental or (100_000 if q else 500_000)
    args.flows = args.flows or (100 if q else 300)
    args.batches = [1000, 10000]
    args.repeats = 2 if q else 3
    args.drain_records = 20_000 if q else 40_000
    args.drain_rounds = 2 if q else 5
    if os.geteuid() != 0:
        print("sync_bench needs root (BPF, a network namespace)", file=sys.stderr)
        return 2

    signal.signal(signal.SIGTERM, _term)
    pid = os.getpid()
    inst_a, inst_b, ns = f"bench-{pid}-sa", f"bench-{pid}-sb", f"bench-{pid}-sync"
    started = time.monotonic()
    try:
        with frames_netns(ns):
            res = asyncio.run(run(args, inst_a, inst_b, ns))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("sync_bench: interrupted; instances and namespace removed", file=sys.stderr)
        return 130
    finally:
        for inst in (inst_a, inst_b):
            destroy(inst)
    res["meta"] = {
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "python": platform.python_version(),
        "quick": q,
        "entries": args.entries,
        "conn_table": args.conn_table,
        "backends": len(BACKENDS),
        "incremental_entries": args.incremental,
        "incremental_batches": args.batches,
        "incremental_repeats": args.repeats,
        "lag_flows": args.flows,
        "batch_delay_ms": BATCH_DELAY_MS,
        "refresh_interval": args.refresh_interval,
        "processes": "A's SyncNode in a child process, B's (and the frames) in this one",
        "seconds": round(time.monotonic() - started, 1),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git": _git_rev(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print_summary(res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
