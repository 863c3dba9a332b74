"""lb_tables and lb_btables through LbMaps: each kind in its own outer map, read back.

A Maglev table is an inner ARRAY of __u32 first hops in lb_tables, a Beamer table an
inner ARRAY of struct xdplb_bucket in lb_btables (docs/datapath.md); a snapshot reads
both, and DeleteTable clears a vip id from either.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from xdplb.core import abi
from xdplb.core.errors import BpfError
from xdplb.core.mapops import DeleteTable, PutTable
from xdplb.core.state import LookupTable
from xdplb.datapath import Map
from xdplb.datapath.lb import LbDatapath, LbMaps, destroy

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


def test_a_reader_in_another_process_rereads_a_table_replaced_under_it(
    dp: LbDatapath, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process (the CLI, a test) finds a table's id in the outer map, and the
    daemon replaces and frees that table before it opens it: ENOENT, then the outer map
    names the new table, which it reads."""
    old = LookupTable(np.array([1, 2, 3], dtype=np.uint32))
    new = LookupTable(np.array([3, 2, 1], dtype=np.uint32))
    dp.apply([PutTable(11, old, MAGLEV)])
    reader = LbMaps(dp.maps)  # shares the maps, not the writer's record of its tables
    real = Map.from_id
    calls: list[int] = []

    def racing(map_id: int) -> Map:
        calls.append(map_id)
        if len(calls) == 1:
            dp.apply([PutTable(11, new, MAGLEV)])  # the writer replaces it...
            raise BpfError(f"bpf_map_get_fd_by_id({map_id})", errno.ENOENT)  # ...and it is gone
        return real(map_id)

    monkeypatch.setattr(Map, "from_id", staticmethod(racing))
    assert reader.table(11) == new
    assert len(calls) == 2 and calls[0] != calls[1]
    dp.apply([DeleteTable(11)])


def test_a_table_that_keeps_vanishing_is_an_error(
    dp: LbDatapath, monkeypatch: pytest.MonkeyPatch
) -> None:
    dp.apply([PutTable(12, LookupTable(np.array([1], dtype=np.uint32)), MAGLEV)])

    def gone(map_id: int) -> Map:
        raise BpfError(f"bpf_map_get_fd_by_id({map_id})", errno.ENOENT)

    monkeypatch.setattr(Map, "from_id", staticmethod(gone))
    with pytest.raises(BpfError):
        LbMaps(dp.maps).table(12)
    dp.apply([DeleteTable(12)])
