"""lb_tables and lb_btables through LbMaps: each kind in its own outer map, read back.

A Maglev table is an inner ARRAY of __u32 first hops in lb_tables, a Beamer table an
inner ARRAY of struct xdplb_bucket in lb_btables (docs/datapath.md); a snapshot reads
both, and DeleteTable clears a vip id from either.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from xdplb import abi
from xdplb.datapath import Map
from xdplb.datapath.lb import LbDatapath, destroy
from xdplb.planner import DeleteTable, PutTable
from xdplb.state import LookupTable

pytestmark = pytest.mark.bpf

MAGLEV, BEAMER = abi.TableKind.MAGLEV, abi.TableKind.BEAMER


@pytest.fixture(scope="module")
def dp() -> Iterator[LbDatapath]:
    instance = f"tbltest-{os.getpid()}"
    try:
        with LbDatapath(instance) as d:
            yield d
    finally:
        destroy(instance)


def _inner_value_size(dp: LbDatapath, name: str, vip_id: int) -> int:
    raw = dp[name].lookup(struct.pack("<I", vip_id))
    assert raw is not None
    with Map.from_id(struct.unpack("<I", raw)[0]) as inner:
        return inner.value_size


def test_each_kind_in_its_own_map_and_read_back(dp: LbDatapath) -> None:
    maglev = LookupTable(np.array([1, 2, 3, 1, 2], dtype=np.uint32))
    beamer = LookupTable(
        np.array([4, 5, 6], dtype=np.uint32), np.array([[5, 0, 0], [4, 6, 7], [0, 0, 0]])
    )
    dp.apply([PutTable(3, maglev, MAGLEV), PutTable(7, beamer, BEAMER)])

    assert _inner_value_size(dp, "lb_tables", 3) == 4
    assert _inner_value_size(dp, "lb_btables", 7) == ctypes.sizeof(abi.Bucket)
    assert dp["lb_tables"].lookup(struct.pack("<I", 7)) is None
    assert dp["lb_btables"].lookup(struct.pack("<I", 3)) is None
    assert dp.table(3) == maglev and dp.table(7) == beamer
    assert dp.snapshot().tables == {3: maglev, 7: beamer}

    dp.apply([DeleteTable(3), DeleteTable(7), DeleteTable(9)])  # 9: in neither, harmless
    assert dp.table(3) is None and dp.table(7) is None
    assert dp.snapshot().tables == {}


def test_maglev_table_with_later_hops_is_refused(dp: LbDatapath) -> None:
    t = LookupTable(np.array([1, 2], dtype=np.uint32), np.array([3, 0], dtype=np.uint32))
    with pytest.raises(ValueError, match="no later hops"):
        dp.apply([PutTable(5, t, MAGLEV)])
    assert dp.table(5) is None
