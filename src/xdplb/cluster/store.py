"""The fleet's state in etcd (docs/cluster.md, "Fleet state").

Keys under the configured prefix:

- ``<prefix>/config``: the fleet's document (YAML, the fields of
  :data:`~xdplb.config.schema.FLEET_FIELDS`); each write is a revision every node applies,
  or refuses, the same way;
- ``<prefix>/nodes/<node>``: what each node serves (:class:`NodeReport`, JSON), under a
  lease of ``lease_ttl`` seconds, so a node that dies leaves the list by itself.

:class:`FleetMember` is the node's side, sans daemon: it follows the document (read, then
watch from the next revision), hands each revision to ``apply``, and publishes
``report()`` every third of the lease. When the store cannot be reached it says so (the
node keeps serving what it has) and tries again every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field

import aetcd
import aetcd.exceptions
import numpy as np

from xdplb.config.schema import ClusterConfig, Config
from xdplb.control.overlay import Member
from xdplb.control.planner import vip_key
from xdplb.control.status import FleetNode, StoreStatus
from xdplb.core.state import Snapshot

log = logging.getLogger("xdplb.cluster")

#: What a lost or refusing store raises through aetcd (grpc's errors are mapped to these).
STORE_ERRORS = (aetcd.exceptions.ClientError, OSError, asyncio.TimeoutError)
#: Seconds one call to the store may take.
CALL_TIMEOUT = 2
RETRY = 1.0
#: Seconds between two reads of the nodes' reports (and publications of this one's,
#: which also go out at once when this node's checks change their verdict).
READ_INTERVAL = 0.5


@dataclass(frozen=True)
class NodeReport:
    """What a node publishes: the revision it serves, the one it refused last (and why), a
    digest of every VIP's table (by VIP name), its announcements."""

    node: str
    revision: int | None
    refused_revision: int | None = None
    refused_error: str = ""
    tables: dict[str, str] = field(default_factory=dict)
    announced: list[str] = field(default_factory=list)
    #: What its own health checks see: VIP name -> backend address -> up.
    health: dict[str, dict[str, bool]] = field(default_factory=dict)
    #: Its BGP sessions: peer -> BIRD's state and info.
    sessions: dict[str, str] = field(default_factory=dict)
    #: Its session sync: its name on the wire and ``sync.listen`` (empty without sync).
    sync_node: str = ""
    sync_address: str = ""
    at: float = 0.0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> NodeReport | None:
        """None for a value that is not a report (another writer's, a newer format)."""
        try:
            doc = json.loads(raw)
            return cls(**doc) if isinstance(doc, dict) else None
        except (ValueError, TypeError):
            return None


@dataclass
class StoreState:
    """The node's view of the store, for the status."""

    connected: bool = False
    #: Why not connected (empty while connected, or before the first attempt).
    error: str = ""
    #: The revision of the document the node serves (None: none applied from the store).
    revision: int | None = None
    refused_revision: int | None = None
    refused_error: str = ""
    #: Every node's latest report, this one's included, by node name.
    nodes: dict[str, NodeReport] = field(default_factory=dict)


#: ``apply(text, revision)``: None when the revision is served now, else why it was
#: refused (the previous one keeps serving).
Apply = Callable[[bytes, int], str | None]


class FleetMember:
    """This node in the store: follows the fleet's document, publishes its report."""

    def __init__(
        self,
        cfg: ClusterConfig,
        node: str,
        apply: Apply,
        report: Callable[[], NodeReport],
        agree: Callable[[frozenset[Member] | None], None] = lambda down: None,
        tables: Callable[[], dict[str, bytes]] = dict,
        adopt: Callable[[Mapping[str, bytes], bool], None] = lambda tables, follow: None,
        on_nodes: Callable[[Mapping[str, NodeReport]], None] = lambda nodes: None,
    ) -> None:
        self.cfg = cfg
        self.node = node
        self._apply = apply
        self._report = report
        #: Called with the members the live nodes agree are down after every read of
        #: the reports, and with None when the store is lost (the node's own view then).
        self._agree = agree
        #: The Beamer tables built here, by VIP name (what the leader publishes), and
        #: where the store's go (``adopt(tables, follow)``: follow them as they are, or
        #: step on from them as the new leader).
        self._tables = tables
        self._adopt = adopt
        #: Called with every live node's report after each read (session sync's peers).
        self._on_nodes = on_nodes
        self._leading = False
        self._written: dict[str, bytes] = {}
        self._read: dict[bytes, tuple[int, bytes]] = {}
        self._adopted: tuple[bool, tuple[tuple[bytes, int], ...]] | None = None
        self._poke = asyncio.Event()
        self.state = StoreState()
        prefix = cfg.prefix.encode()
        self.config_key = prefix + b"/config"
        self.nodes_prefix = prefix + b"/nodes/"
        self.beamer_prefix = prefix + b"/beamer/"

    def _take(self, value: bytes, revision: int) -> None:
        why = self._apply(value, revision)
        st = self.state
        if why is None:
            st.revision = revision
        else:
            st.refused_revision, st.refused_error = revision, why

    def poke(self) -> None:
        """Publish now (this node's checks changed their verdict), not at the next tick."""
        self._poke.set()

    def report(self) -> NodeReport:
        st = self.state
        base = self._report()
        return NodeReport(
            node=self.node,
            revision=st.revision,
            refused_revision=st.refused_revision,
            refused_error=st.refused_error,
            tables=base.tables,
            announced=base.announced,
            health=base.health,
            sessions=base.sessions,
            sync_node=base.sync_node,
            sync_address=base.sync_address,
            at=time.time(),
        )

    def status(self) -> StoreStatus:
        st = self.state
        now = time.time()
        mine = st.nodes.get(self.node)
        ours = mine.tables if mine is not None else self._report().tables
        return StoreStatus(
            store=f"{self.cfg.store}{self.cfg.prefix}",
            node=self.node,
            connected=st.connected,
            error=st.error,
            revision=st.revision,
            refused_revision=st.refused_revision,
            refused_error=st.refused_error,
            nodes=[
                FleetNode(
                    node=r.node,
                    revision=r.revision,
                    refused_revision=r.refused_revision,
                    refused_error=r.refused_error,
                    age=max(0.0, now - r.at),
                    announced=list(r.announced),
                    sessions=dict(r.sessions),
                    tables_differ=sorted(
                        v for v in ours.keys() | r.tables.keys() if ours.get(v) != r.tables.get(v)
                    ),
                )
                for r in sorted(st.nodes.values(), key=lambda r: r.node)
            ],
        )

    async def run(self) -> None:
        """Until cancelled: connect, follow, publish; on a loss, say so and retry."""
        host, port = self.cfg.endpoint
        while True:
            try:
                client = aetcd.Client(
                    host=host, port=port, timeout=CALL_TIMEOUT, connect_wait_timeout=CALL_TIMEOUT
                )
                try:
                    await self._session(client)
                finally:
                    await client.close()
            except STORE_ERRORS as e:
                if self.state.connected or not self.state.error:
                    log.error(
                        "store %s: %s: serving revision %s meanwhile",
                        self.cfg.store,
                        e or type(e).__name__,
                        self.state.revision,
                    )
                self.state.connected = False
                self.state.error = str(e) or type(e).__name__
                self._agree(None)
                self._adopt({}, False)  # no leader to follow: step here
                self._leading, self._adopted = False, None
            await asyncio.sleep(RETRY)

    async def _session(self, client: aetcd.Client) -> None:
        # The watch starts right after the revision read: nothing written in between is
        # missed (a watch "from now" would start when its task first runs).
        rng = await client.get_prefix(self.config_key)
        got = next((kv for kv in rng if kv.key == self.config_key), None)
        if got is not None and got.mod_revision != self.state.revision:
            self._take(got.value, got.mod_revision)
        watch = asyncio.create_task(self._watch(client, rng.header.revision + 1))
        lease = await client.lease(self.cfg.lease_ttl)
        if not self.state.connected:
            log.info(
                "store %s: connected, serving revision %s", self.cfg.store, self.state.revision
            )
        self.state.connected, self.state.error = True, ""
        refreshed = time.monotonic()
        try:
            while True:
                self._poke.clear()
                await client.put(
                    self.nodes_prefix + self.node.encode(), self.report().encode(), lease=lease
                )
                if time.monotonic() - refreshed >= self.cfg.lease_ttl / 3:
                    await lease.refresh()
                    refreshed = time.monotonic()
                nodes = {}
                for kv in await client.get_prefix(self.nodes_prefix):
                    rep = NodeReport.decode(kv.value)
                    if rep is not None:
                        nodes[rep.node] = rep
                self.state.nodes = nodes
                self._agree(agreed_down(nodes.values()))
                self._on_nodes(nodes)
                await self._share_beamer(client, nodes)
                if watch.done():
                    watch.result()  # the watch's error: a new session
                    raise aetcd.exceptions.ClientError("the watch ended")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(READ_INTERVAL):
                        await self._poke.wait()
        finally:
            watch.cancel()
            with contextlib.suppress(*STORE_ERRORS):
                await lease.revoke()

    async def _share_beamer(self, client: aetcd.Client, nodes: Mapping[str, NodeReport]) -> None:
        """One node steps the Beamer tables, the live node with the lowest name (every
        node that reads the same reports agrees on it): it publishes each table it builds,
        the others serve what it published. A node that becomes the leader starts from
        the store's tables (a table's history outlives the node that made it)."""
        leader = self.node in nodes and min(nodes) == self.node
        if not leader:
            self._leading = False
            self._written.clear()
            stored = await self._stored_tables(client)
            seen = (True, tuple(sorted((k, r) for k, (r, _) in self._read.items())))
            if seen != self._adopted:  # only what changed is decoded again
                self._adopt(stored, True)
                self._adopted = seen
            return
        if not self._leading:
            self._adopt(await self._stored_tables(client), False)
            self._adopted = None
            self._leading = True
        for name, raw in self._tables().items():
            if self._written.get(name) != raw:
                await client.put(self.beamer_prefix + name.encode(), raw)
                self._written[name] = raw

    async def _stored_tables(self, client: aetcd.Client) -> dict[str, bytes]:
        """The store's Beamer tables by VIP name; a value is fetched only when its key's
        revision moved since the last read."""
        keys = {
            kv.key: kv.mod_revision
            for kv in await client.get_prefix(self.beamer_prefix, keys_only=True)
        }
        for key, rev in keys.items():
            if self._read.get(key, (None,))[0] != rev:
                got = await client.get(key)
                if got is not None:
                    self._read[key] = (got.mod_revision, got.value)
        self._read = {k: v for k, v in self._read.items() if k in keys}
        start = len(self.beamer_prefix)
        return {k[start:].decode(errors="replace"): v for k, (_, v) in self._read.items()}

    async def _watch(self, client: aetcd.Client, start: int) -> None:
        """Every later revision of the document (a deletion changes nothing: the node
        keeps serving the last one)."""
        events = await client.watch(self.config_key, start_revision=start)
        async for ev in events:
            if ev.kind == aetcd.rtypes.EventKind.PUT:
                self._take(ev.kv.value, ev.kv.mod_revision)


def agreed_down(reports: Iterable[NodeReport]) -> frozenset[Member]:
    """The members down by the fleet's agreement: those that more than half of the nodes
    reporting on them see down (a tie is up). One function of the live nodes' reports,
    so every node that reads the same reports builds the same tables."""
    votes: dict[tuple[str, str], list[bool]] = {}
    for r in reports:
        for vip, backends in r.health.items():
            for addr, up in backends.items():
                votes.setdefault((vip, addr), []).append(bool(up))
    out = set()
    for (vip, addr), v in votes.items():
        if 2 * v.count(False) > len(v):
            try:
                out.add((vip, ipaddress.ip_address(addr)))
            except ValueError:  # not an address: another writer's, not counted
                continue
    return frozenset(out)


def table_digests(cfg: Config, snap: Snapshot | None) -> dict[str, str]:
    """Per VIP of ``cfg``, a digest of its table as ``snap`` (the maps) holds it, over
    backend addresses rather than ids: two nodes whose backends got other ids (another
    history of changes) and route alike agree. A VIP without a table: no entry."""
    out: dict[str, str] = {}
    if snap is None:
        return out
    for vip in cfg.vips:
        params = snap.vips.get(vip_key(vip))
        table = snap.tables.get(params.vip_id) if params is not None else None
        if table is None:
            continue
        hops = np.asarray(table.first, dtype=np.uint32)[:, None]
        if table.rest is not None:
            hops = np.column_stack([hops, np.asarray(table.rest, dtype=np.uint32)])
        ids = np.unique(hops)
        addrs = [str(snap.backends[int(i)].addr) if int(i) in snap.backends else "" for i in ids]
        order = np.argsort(addrs, kind="stable")  # rank of each id by its address
        rank = np.empty(len(ids), dtype=np.uint32)
        rank[order] = np.arange(len(ids), dtype=np.uint32)
        h = hashlib.sha256(" ".join(sorted(addrs)).encode())
        h.update(rank[np.searchsorted(ids, hops)].tobytes())
        out[vip.name] = h.hexdigest()[:16]
    return out
