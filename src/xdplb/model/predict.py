"""Flows without packets: the backend a flow goes to, one at a time
(:func:`predict_backend`) or 10^6 at once with the hash in numpy (:func:`predict_many`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, hashing
from xdplb.core.state import VipParams
from xdplb.model.parse import IPPROTO_TCP
from xdplb.model.select import choose, session
from xdplb.model.state import DataplaneState, Flow

U32Array = npt.NDArray[np.uint32]


def predict_backend(state: DataplaneState, flow: Flow) -> int | None:
    """The backend a packet of ``flow`` goes to (steps 6-9), or None if it does not: a
    packet of an open connection (a TCP SYN skips the connection table).

    None covers "not a VIP" as well as the table drops; use :func:`decide` on a
    frame to learn which.
    """
    hit = state.find_vip(flow.dst, flow.dport, flow.proto)
    if hit is None or not state.maybe_vip_addr(flow.dst.packed):
        return None
    _vip, params = hit
    starts = flow.proto != IPPROTO_TCP
    choice = choose(state, params, flow.key(), flow, starts)
    drop, hops = choice[1], choice[4]
    return None if drop is not None else hops[0]


@dataclass(frozen=True, eq=False)
class FlowBatch:
    """Many flows as columns, for :func:`predict_many`.

    Addresses are the four ``__u32`` words of the C key (IPv4 in word 0), read
    little-endian from network-order bytes, exactly as ``abi.addr_words`` does.
    """

    #: ``(n, 4)`` uint32.
    src: U32Array
    #: ``(n, 4)`` uint32.
    dst: U32Array
    #: ``(n,)`` host-order ports.
    sport: npt.NDArray[np.uint16]
    dport: npt.NDArray[np.uint16]
    #: ``(n,)`` IP protocol numbers.
    proto: npt.NDArray[np.uint8]
    #: ``(n,)`` 4 or 6.
    family: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return int(self.sport.shape[0])

    @classmethod
    def from_flows(cls, flows: Sequence[Flow]) -> FlowBatch:
        src = np.frombuffer(
            b"".join(f.src.packed.ljust(16, b"\0") for f in flows), dtype="<u4"
        ).reshape(-1, 4)
        dst = np.frombuffer(
            b"".join(f.dst.packed.ljust(16, b"\0") for f in flows), dtype="<u4"
        ).reshape(-1, 4)
        return cls(
            src.astype(np.uint32),
            dst.astype(np.uint32),
            np.array([f.sport for f in flows], dtype=np.uint16),
            np.array([f.dport for f in flows], dtype=np.uint16),
            np.array([f.proto for f in flows], dtype=np.uint8),
            np.array([f.src.version for f in flows], dtype=np.uint8),
        )

    def words(self, src_only: npt.NDArray[np.bool_] | None = None) -> U32Array:
        """The ``(n, 10)`` words of each flow key; rows in ``src_only`` keep the source only."""
        n = len(self)
        words = np.zeros((n, hashing.FLOW_WORDS), dtype=np.uint32)
        words[:, 0:4] = self.src
        words[:, 4:8] = self.dst
        # Ports are __be16 in memory; read little-endian as one word: byte-swapped halves.
        sport_be = self.sport.astype(np.uint16).byteswap().astype(np.uint32)
        dport_be = self.dport.astype(np.uint16).byteswap().astype(np.uint32)
        words[:, 8] = sport_be | (dport_be << np.uint32(16))
        words[:, 9] = self.proto.astype(np.uint32)
        if src_only is not None:
            words[src_only, 4:] = 0
        return words


@dataclass(frozen=True, eq=False)
class Predictions:
    """:func:`predict_many`'s answer, one row per flow."""

    #: The chosen backend, 0 where the flow is not forwarded (no VIP, or a table drop).
    backend: U32Array
    #: The flow hash that chose it (the stored one on a connection-table hit).
    flow_hash: U32Array
    #: ``vip_id`` of the matched VIP, -1 where none matched.
    vip_id: npt.NDArray[np.int64]

    @property
    def gue_sport(self) -> npt.NDArray[np.uint16]:
        return (np.uint32(0x8000) | (self.flow_hash & np.uint32(0x7FFF))).astype(np.uint16)


def predict_many(state: DataplaneState, flows: FlowBatch | Sequence[Flow]) -> Predictions:
    """:func:`predict_backend` for many flows at once, hashing with numpy.

    The VIP lookup runs once per distinct (dst, dport, proto) and the hash once
    per flow in numpy; only connection-table hits (if ``state.conns`` is not
    empty) cost a Python dict lookup per flow.
    """
    batch = flows if isinstance(flows, FlowBatch) else FlowBatch.from_flows(flows)
    n = len(batch)
    backend = np.zeros(n, dtype=np.uint32)
    out_hash = np.zeros(n, dtype=np.uint32)
    vip_id = np.full(n, -1, dtype=np.int64)
    src_only = np.zeros(n, dtype=bool)

    # Step 6 per distinct destination, not per flow.
    dst_bytes = batch.dst.astype("<u4").view(np.uint8).reshape(n, 16)
    groups: dict[tuple[bytes, int, int, int], list[int]] = {}
    for i in range(n):
        fam = int(batch.family[i])
        raw = dst_bytes[i, : 4 if fam == 4 else 16].tobytes()
        groups.setdefault((raw, fam, int(batch.dport[i]), int(batch.proto[i])), []).append(i)
    params_of: dict[int, VipParams] = {}
    for (raw, fam, dport, proto), members in groups.items():
        # Step 2': a destination outside lb_vip_filter is no VIP's.
        hit = state.find_vip_raw(fam, raw, dport, proto) if state.maybe_vip_addr(raw) else None
        if hit is None:
            continue
        params = hit[1]
        params_of[params.vip_id] = params
        idx = np.array(members, dtype=np.int64)
        vip_id[idx] = params.vip_id
        src_only[idx] = bool(params.flags & abi.VIP_F_SRC_HASH)

    # Step 9, vectorised over every matched flow.
    matched = vip_id >= 0
    hashes = hashing.flow_hash_many(batch.words(src_only), state.config.seed)
    for vid, params in params_of.items():
        rows = np.flatnonzero(vip_id == vid)
        table = state.tables.get(vid)
        if table is None or rows.size == 0 or params.table_size == 0:
            continue
        h = hashes[rows].astype(np.uint64)
        bucket = h % np.uint64(params.table_size)
        inside = bucket < len(table)
        chosen = np.zeros(rows.size, dtype=np.uint32)
        chosen[inside] = table.first[bucket[inside].astype(np.int64)]
        usable = _usable_mask(state, chosen)
        backend[rows[usable]] = chosen[usable]
        out_hash[rows] = hashes[rows]

    # Step 8 overrides where the connection table has a live entry.
    if state.conns:
        keys = np.zeros((n, hashing.FLOW_WORDS), dtype="<u4")
        keys[:] = batch.words()
        raw_keys = keys.tobytes()
        for row in np.flatnonzero(matched).tolist():
            key = raw_keys[row * 40 : row * 40 + 40]
            if key not in state.conns:
                continue
            params = params_of[int(vip_id[row])]
            _, conn, _ = session(state, params, key, int(batch.proto[row]))
            if conn is not None:
                backend[row] = conn.backend_id
                out_hash[row] = conn.hash
    return Predictions(backend, out_hash, vip_id)


def _usable_mask(state: DataplaneState, ids: U32Array) -> npt.NDArray[np.bool_]:
    """Per id: :meth:`DataplaneState.backend_usable`, looked up once per distinct id."""
    mask = np.zeros(ids.shape, dtype=bool)
    for bid in np.unique(ids):
        if state.backend_usable(int(bid)):
            mask[ids == bid] = True
    return mask
