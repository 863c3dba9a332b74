"""A Beamer table as the fleet's store keeps it (docs/cluster.md, "Fleet state"): hops by
backend address, not by the ids one node gave its backends, with each bucket's change
generation, so that every node serves the same hop lists and a node that restarts, or
missed revisions, takes the table with its history instead of building its own.

The encoding (version 1) is JSON: ``size``, ``generation``, ``at`` (wall-clock seconds of
the table's last change), ``addrs`` (the backend addresses, index 0 is "none"), and
``hops`` / ``changed``: base64 of zlib of little-endian arrays, ``(size, MAX_HOPS)``
uint16 indexes into ``addrs`` (the first hop, then the previous ones) and ``(size,)``
uint64 generations.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from xdplb.core.abi import MAX_HOPS
from xdplb.core.addresses import IPAddress
from xdplb.tables.beamer import BeamerTable

VERSION = 1


def _pack(a: np.ndarray[Any, Any]) -> str:
    return base64.b64encode(zlib.compress(a.tobytes(), 6)).decode()


def _unpack(text: str, dtype: str, count: int) -> np.ndarray[Any, Any]:
    raw = zlib.decompress(base64.b64decode(text))
    return np.frombuffer(raw, dtype=dtype, count=count)


def encode(table: BeamerTable, addr_of: Mapping[int, IPAddress], at: float) -> bytes:
    """``table`` (ids of this node's backends, ``addr_of``) by address; KeyError if it
    names an id ``addr_of`` lacks."""
    hops = np.column_stack([table.first, table.hops])
    ids = np.unique(hops)
    addrs = [""] + [str(addr_of[int(i)]) for i in ids if i]
    index = np.searchsorted(ids, hops).astype("<u2") + (0 if ids[0] == 0 else 1)
    doc = {
        "v": VERSION,
        "size": table.size,
        "generation": table.generation,
        "at": at,
        "addrs": addrs,
        "hops": _pack(index),
        "changed": _pack(table.changed.astype("<u8")),
    }
    return json.dumps(doc, sort_keys=True).encode()


def decode(raw: bytes, id_of: Mapping[IPAddress, int]) -> tuple[BeamerTable, float] | None:
    """The table in this node's ids (``id_of``: address -> id) and when it last changed;
    None if it is not a table of this version, or names a first hop this node has no id
    for. A previous hop without an id here is left out (no connection of it can be
    daisy-chained through this node)."""
    try:
        doc = json.loads(raw)
        if doc.get("v") != VERSION:
            return None
        size = int(doc["size"])
        addrs = [ipaddress.ip_address(a) if a else None for a in doc["addrs"]]
        index = _unpack(doc["hops"], "<u2", size * MAX_HOPS).reshape(size, MAX_HOPS)
        changed = _unpack(doc["changed"], "<u8", size)
        at = float(doc["at"])
        generation = int(doc["generation"])
    except (ValueError, KeyError, TypeError, zlib.error):
        return None
    lut = np.array([id_of.get(a, 0) if a is not None else 0 for a in addrs], dtype=np.uint32)
    if index.max(initial=0) >= len(lut):
        return None
    hops = lut[index]
    if not hops[:, 0].all():
        return None
    first, rest = hops[:, 0], hops[:, 1:]
    # Pack the previous hops to the front where one was left out.
    order = np.argsort(rest == 0, axis=1, kind="stable")
    rest = np.take_along_axis(rest, order, axis=1)
    try:
        return BeamerTable(first, rest, changed.astype(np.uint64), generation), at
    except ValueError:
        return None
