"""Session sync, the node's side (docs/sync.md): MGW's incremental and full sync over TCP.

Each node listens on ``sync.listen`` and dials every peer; a dialled connection is a
subscription: the subscriber sends SUBSCRIBE (a fresh epoch, full copy wanted), the
publisher answers BEGIN(count), the copy in ENTRIES, END(count, digest), then its new
sessions as they come, and KEEPALIVE when it has nothing to say. The publisher takes a
subscriber into its incremental stream before it reads its table for the copy, and
holds what comes meanwhile until the END: nothing made during a copy is missed.

- Incremental: every ``batch_delay_ms`` the pump drains ``lb_sess_export`` (lb_xdp's
  NEW and UPDATE records), keeps the sessions of VIPs that sync, and queues them to every
  subscriber. Every ``refresh_interval`` the table is scanned for sessions that saw a
  packet since the last scan, sent as REFRESH: a peer's copy of a live session moves its
  last-seen forward, and a session nobody uses any more expires everywhere.
- Full: a starting node is ready (and may announce) once every peer that answers has
  given a copy whose count and digest match what it received. A copy that times out or
  does not match is asked for again; a peer never reached within
  ``sync.unreachable_after`` is not waited for (a dead peer must not keep the cluster
  from restarting a node).
- Every message is checked (:mod:`xdplb.sync.wire`); a refused one is counted by reason,
  nothing of it is imported, and the subscription starts again with a full copy: a TCP
  stream whose framing is in doubt cannot be resynchronised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from xdplb.config.schema import SyncConfig, SyncPeerConfig
from xdplb.control.status import SyncPeerStatus, SyncStatus
from xdplb.core import abi
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import ConnTable, ImportResult, SessionExport
from xdplb.sync import convert, wire
from xdplb.sync.convert import TableView

log = logging.getLogger("xdplb.sync")

# Timeouts are ``asyncio.timeout`` blocks, never ``asyncio.wait_for``: on Python 3.11 a
# wait_for whose awaitable completes as it is cancelled swallows the cancellation
# (CPython gh-86296), and a subscription would outlive close().

#: Seconds between KEEPALIVEs on an idle subscription; a subscriber that hears nothing
#: for three of them drops it and subscribes again.
KEEPALIVE = 1.0
#: Seconds between attempts to reach a peer.
RETRY = 0.5
CONNECT_TIMEOUT = 2.0
#: Seconds a publisher waits for a new connection's SUBSCRIBE.
SUBSCRIBE_TIMEOUT = 5.0
#: Messages queued to one subscriber before it is dropped as too slow.
MAX_QUEUE = 4096
#: Sets of the table read between two yields to the event loop (a copy of a large table
#: must not stall the API).
SCAN_CHUNK = 4096


@dataclass
class SyncSource:
    """What sync needs of this node: its session table, its export stream, and the view
    of its maps at the last plan (None before the first)."""

    table: ConnTable
    export: SessionExport
    view: Callable[[], TableView | None]


@dataclass
class _Peer:
    cfg: SyncPeerConfig
    state: str = "connecting"
    error: str = ""
    ever_reached: bool = False
    copies: int = 0
    copy_failures: int = 0
    last_copy_entries: int | None = None
    last_copy_ms: float | None = None
    received: int = 0
    imported: int = 0
    task: asyncio.Task[None] | None = None

    def status(self) -> SyncPeerStatus:
        return SyncPeerStatus(
            node=self.cfg.node,
            address=self.cfg.address,
            state=self.state,
            error=self.error,
            copies=self.copies,
            copy_failures=self.copy_failures,
            last_copy_entries=self.last_copy_entries,
            last_copy_ms=self.last_copy_ms,
            received=self.received,
            imported=self.imported,
        )


@dataclass(eq=False)  # one per connection, kept in a set by identity
class _Subscriber:
    node: str
    epoch: int
    queue: asyncio.Queue[wire.Message | None] = field(
        default_factory=lambda: asyncio.Queue(MAX_QUEUE)
    )


class _Ended(Exception):
    """A subscription ended; the message says why."""


@contextlib.contextmanager
def _logged(what: str) -> Iterator[None]:
    """A bug of ours in a periodic task is logged, and the task goes on."""
    try:
        yield
    except Exception:
        log.exception("session sync: %s failed", what)


class SyncNode:
    """This node in the sync mesh: publisher to its subscribers, subscriber of its peers."""

    def __init__(self, cfg: SyncConfig, node: str, key: bytes, source: SyncSource) -> None:
        self.cfg = cfg
        self.node = node
        self._key = key
        self._src = source
        self._peers: dict[str, _Peer] = {p.node: _Peer(p) for p in cfg.peers}
        self._subs: set[_Subscriber] = set()
        self._started = time.monotonic()
        #: Peers from the fleet's store are known (or there is no store to wait for).
        self._peers_known = True
        self._ready = False
        self.sent = 0
        self.overflows = 0
        self.refused: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.imported: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- running ------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen, then subscribe to every peer (OSError if ``listen`` cannot be bound)."""
        host, port = self.cfg.address
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self._src.export.skip()  # what lb_xdp recorded before: the copies cover it
        self._tasks = [
            asyncio.create_task(self._pump(), name="sync-pump"),
            asyncio.create_task(self._refresh(), name="sync-refresh"),
        ]
        for p in self._peers.values():
            self._follow(p)
        log.info(
            "session sync: %s listening on %s, peers %s",
            self.node,
            self.cfg.listen,
            ", ".join(f"{p.cfg.node} ({p.cfg.address})" for p in self._peers.values())
            or "none yet",
        )

    async def run(self) -> None:
        """Serve until cancelled (:meth:`start` first, if not started)."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.gather(*self._tasks)
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = self._tasks + [p.task for p in self._peers.values() if p.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()
        for s in list(self._subs):
            with contextlib.suppress(asyncio.QueueFull):
                s.queue.put_nowait(None)

    def _follow(self, p: _Peer) -> None:
        p.task = asyncio.create_task(self._subscribe(p), name=f"sync-{p.cfg.node}")

    def wait_for_fleet(self) -> None:
        """Peers also come from the fleet's store: not ready before its first list."""
        self._peers_known = False

    def set_fleet_peers(self, peers: Mapping[str, str]) -> None:
        """The live nodes of the fleet's store that publish a sync address (node ->
        ``address:port``), this one left out: followed from now on, besides the
        configured peers; a node that left the store is no longer followed."""
        static = {p.node for p in self.cfg.peers}
        for name, address in peers.items():
            if name == self.node or name in static:
                continue
            have = self._peers.get(name)
            if have is not None and have.cfg.address == address:
                continue
            if have is not None and have.task is not None:
                have.task.cancel()
            p = _Peer(SyncPeerConfig(node=name, address=address))
            self._peers[name] = p
            self._follow(p)
        for name in [n for n in self._peers if n not in static and n not in peers]:
            gone = self._peers.pop(name)
            if gone.task is not None:
                gone.task.cancel()
        self._peers_known = True

    # -- readiness and status -------------------------------------------------------------

    def waiting_for(self) -> str | None:
        """Why this node is not synced yet (None once it is: it may announce)."""
        if self._ready:
            return None  # once synced, a peer that comes or goes later changes nothing
        if not self._peers_known:
            return "session sync: waiting for the fleet's list of nodes"
        waiting = [
            f"{p.cfg.node} ({p.state}{': ' + p.error if p.error else ''})"
            for p in self._peers.values()
            if p.copies == 0 and p.state != "unreachable"
        ]
        if waiting:
            return "session sync: waiting for a full copy from " + ", ".join(waiting)
        self._ready = True
        log.info(
            "session sync: synced with %s after %.2f s",
            ", ".join(
                f"{p.cfg.node} ({p.last_copy_entries} sessions)"
                if p.copies
                else f"{p.cfg.node} (unreachable, not waited for)"
                for p in self._peers.values()
            )
            or "no peer",
            time.monotonic() - self._started,
        )
        return None

    def status(self) -> SyncStatus:
        why = self.waiting_for()
        return SyncStatus(
            node=self.node,
            listen=self.cfg.listen,
            ready=why is None,
            waiting_for=why or "",
            peers=[p.status() for p in self._peers.values()],
            subscribers=sorted({s.node for s in self._subs}),
            sent=self.sent,
            imported=dict(self.imported),
            refused=dict(self.refused),
            skipped={why: n for why, n in self.skipped.items() if n},
            overflows=self.overflows,
        )

    # -- publishing -------------------------------------------------------------------------

    def _publish(self, msgs: list[wire.Entries]) -> None:
        n = sum(len(m.entries) for m in msgs)
        for s in list(self._subs):
            try:
                for m in msgs:
                    s.queue.put_nowait(m)
            except asyncio.QueueFull:
                self.overflows += 1
                log.warning("session sync: %s fell behind; dropping its subscription", s.node)
                self._subs.discard(s)
                while not s.queue.empty():
                    s.queue.get_nowait()
                s.queue.put_nowait(None)
                continue
            self.sent += n

    async def _pump(self) -> None:
        """Send lb_xdp's new and changed sessions, at most ``batch_delay_ms`` late."""
        delay = self.cfg.batch_delay_ms / 1000
        while True:
            await asyncio.sleep(delay)
            with _logged("sending new sessions"):
                recs = self._src.export.drain_records()
                view = self._src.view()
                if len(recs) and view is not None and self._subs:
                    self.publish_records(recs, view)

    def publish_records(self, recs: npt.NDArray[np.void], view: TableView) -> None:
        """Queue lb_xdp's export records (of ``EXPORT_DTYPE``) of VIPs that sync to every
        subscriber: NEW as NEW, UPDATE as UPDATE (what the pump does with a drain)."""
        sess = recs["sess"]
        keep = convert.vip_mask(sess, view.synced)
        if keep.any():
            new = recs["type"][keep] == abi.ExportType.NEW
            ops = np.where(new, wire.Op.NEW, wire.Op.UPDATE).astype(np.uint8)
            self._publish(convert.to_wire(sess[keep], ops, view, now_ticks()))

    async def _refresh(self) -> None:
        """Every ``refresh_interval``: REFRESH every session of a synced VIP that saw a
        packet since the last scan (imported ones too: ECMP may have moved the flow here)."""
        interval = self.cfg.refresh_interval
        while True:
            await asyncio.sleep(interval)
            with _logged("refreshing sessions"):
                view = self._src.view()
                if view is None or not self._subs:
                    continue
                now = now_ticks()
                window = int(interval * view.hz) + 1
                for chunk in await self._scan(view, now, window):
                    self._publish(convert.to_wire(chunk, wire.Op.REFRESH, view, now))

    async def _scan(
        self, view: TableView, now: int, used_within: int | None = None
    ) -> list[npt.NDArray[np.void]]:
        """The live sessions of synced VIPs (used here within ``used_within`` ticks), a
        chunk of the table at a time, yielding to the loop between chunks."""
        out = []
        for recs, _pos in self._src.table.chunks(chunk=SCAN_CHUNK):
            sel = convert.live_synced(recs, view, now, used_within)
            if len(sel):
                out.append(sel)
            await asyncio.sleep(0)
        return out

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One subscriber's connection (its own task, which asyncio starts and nobody
        awaits): ended by a cancel at shutdown, it returns, since 3.11's stream server
        logs a handler task that ends cancelled as an error."""
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve_one(reader, writer)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Its SUBSCRIBE, the copy, then the stream."""
        peer = writer.get_extra_info("peername")
        sub: _Subscriber | None = None
        try:
            try:
                async with asyncio.timeout(SUBSCRIBE_TIMEOUT):
                    got = await wire.read_frame(reader, self._key)
            except wire.Refused as e:
                self.refused[e.reason] += 1
                log.warning("session sync: refused a subscription from %s: %s", peer, e)
                return
            except (TimeoutError, OSError):
                return
            if got is None:
                return
            h, msg = got
            if not isinstance(msg, wire.Subscribe):
                self.refused["malformed"] += 1
                log.warning("session sync: %s opened with %s, not SUBSCRIBE", peer, h.type.name)
                return
            try:
                wire.check_subscribe(h)
            except wire.Refused as e:
                self.refused[e.reason] += 1
                log.warning("session sync: refused a subscription from %s: %s", peer, e)
                return
            sub = _Subscriber(h.node, h.epoch)
            self._subs.add(sub)  # before the copy: what comes meanwhile waits in its queue
            seq = 0

            async def send(m: wire.Message) -> None:
                nonlocal seq
                seq += 1
                writer.write(wire.encode(self._key, self.node, sub.epoch, seq, m))
                await writer.drain()

            if msg.full:
                await self._send_copy(send)
            while True:
                try:
                    async with asyncio.timeout(KEEPALIVE):
                        m = await sub.queue.get()
                except TimeoutError:
                    m = wire.Keepalive()
                if m is None:
                    return
                await send(m)
        except (OSError, EOFError):
            pass
        finally:
            if sub is not None:
                self._subs.discard(sub)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _send_copy(self, send: Callable[[wire.Message], Awaitable[None]]) -> None:
        view = self._src.view()
        now = now_ticks()
        msgs: list[wire.Entries] = []
        if view is not None:  # no plan yet: an empty copy
            for c in await self._scan(view, now):
                msgs += convert.to_wire(c, wire.Op.COPY, view, now)
                await asyncio.sleep(0)  # a million sessions take ~0.4 s: the API goes on
        count = sum(len(m.entries) for m in msgs)
        digest = wire.CopyDigest()
        await send(wire.Begin(count))
        for m in msgs:
            digest.update(m.entries)
            await send(m)
        await send(wire.End(count, digest.digest()))

    # -- subscribing ------------------------------------------------------------------------

    async def _subscribe(self, p: _Peer) -> None:
        """Follow one peer for ever: connect, subscribe with a full copy, import."""
        first = time.monotonic()
        while True:
            host, port = p.cfg.endpoint
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT):
                    reader, writer = await asyncio.open_connection(host, port)
            except (OSError, TimeoutError) as e:
                p.error = f"cannot connect: {e.strerror if isinstance(e, OSError) else 'timed out'}"
                unreachable = time.monotonic() - first >= self.cfg.unreachable_after
                p.state = "unreachable" if not p.ever_reached and unreachable else "retrying"
                await asyncio.sleep(RETRY)
                continue
            p.ever_reached = True
            try:
                await self._take(p, reader, writer)
            except wire.Refused as e:
                self.refused[e.reason] += 1
                p.error = f"refused a message: {e}"
                log.warning("session sync: from %s: %s; subscribing again", p.cfg.node, p.error)
            except _Ended as e:
                p.error = str(e)
                log.warning("session sync: from %s: %s; subscribing again", p.cfg.node, e)
            except (OSError, EOFError) as e:
                p.error = f"connection lost: {e}"
            except Exception as e:  # a bug of ours: said, and the subscription starts again
                log.exception("session sync: following %s failed", p.cfg.node)
                p.error = f"failed: {e!r}"
            finally:
                writer.close()
            p.state = "retrying"
            await asyncio.sleep(RETRY)

    async def _take(
        self, p: _Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        epoch = secrets.randbits(64) | 1
        writer.write(wire.encode(self._key, self.node, epoch, 0, wire.Subscribe(full=True)))
        await writer.drain()
        check = wire.StreamCheck(p.cfg.node, epoch)
        p.state = "copying"
        t0 = time.monotonic()
        deadline = t0 + self.cfg.copy_timeout
        copying, begun = True, None
        digest = wire.CopyDigest()
        while True:
            # A copy has its own deadline (the publisher reads its whole table before its
            # BEGIN, which may take longer than keepalives are apart).
            limit = deadline - time.monotonic() if copying else 3 * KEEPALIVE
            try:
                async with asyncio.timeout(max(limit, 0)):
                    got = await wire.read_frame(reader, self._key)
            except TimeoutError:
                if copying and time.monotonic() >= deadline:
                    p.copy_failures += 1
                    raise _Ended(
                        f"its copy did not end within {self.cfg.copy_timeout:g} s "
                        f"({digest.count} entries received)"
                    ) from None
                raise _Ended("silent for three keepalive intervals") from None
            if got is None:
                raise EOFError("closed by the peer")
            h, m = got
            check.check(h)
            if isinstance(m, wire.Begin):
                if not copying or begun is not None:
                    raise wire.Refused("malformed", "BEGIN outside a copy")
                begun = m.count
            elif isinstance(m, wire.Entries):
                is_copy = m.entries["op"] == wire.Op.COPY
                if copying:
                    if begun is None or not is_copy.all():
                        raise wire.Refused("malformed", "a copy's ENTRIES not within BEGIN..END")
                    digest.update(m.entries)
                elif is_copy.any():
                    raise wire.Refused("malformed", "COPY entries after the END")
                self._import(p, m)
            elif isinstance(m, wire.End):
                if not copying or begun is None:
                    raise wire.Refused("malformed", "END outside a copy")
                got_digest = digest.digest()
                if m.count != digest.count or m.count != begun or m.digest != got_digest:
                    p.copy_failures += 1
                    raise _Ended(
                        f"its copy did not match: BEGIN said {begun}, END {m.count}, "
                        f"{digest.count} received"
                        + ("" if m.digest == got_digest else ", digests differ")
                    )
                copying = False
                p.copies += 1
                p.last_copy_entries = m.count
                p.last_copy_ms = round((time.monotonic() - t0) * 1000, 1)
                p.state, p.error = "synced", ""
                log.info(
                    "session sync: full copy from %s: %d sessions in %.0f ms",
                    p.cfg.node,
                    m.count,
                    p.last_copy_ms,
                )
            elif not isinstance(m, wire.Keepalive):
                raise wire.Refused("malformed", f"{h.type.name} from a publisher")

    def _import(self, p: _Peer, m: wire.Entries) -> None:
        p.received += len(m.entries)
        view = self._src.view()
        if view is None:
            self.skipped["no_plan"] += len(m.entries)
            return
        now = now_ticks()
        got = convert.from_wire(m, view, now)
        self.skipped["unknown_backend"] += got.unknown_backend
        self.skipped["not_synced"] += got.not_synced
        for mode, recs in got.batches.items():
            res = self._src.table.import_records(
                recs,
                seed=view.seed,
                gen=view.gen,
                timeouts=view.timeouts,
                now=now,
                replace=mode,
            )
            counts = np.bincount(res, minlength=len(ImportResult))
            for r in ImportResult:
                if counts[r]:
                    self.imported[r.name.lower()] += int(counts[r])
            p.imported += int(counts[: ImportResult.EVICTED + 1].sum())
            self.skipped["busy"] += int(counts[ImportResult.BUSY])
