"""The consumer side of a BPF ring buffer (``BPF_MAP_TYPE_RINGBUF``), through mmap.

The kernel's layout: a consumer page, then the producer page and the data pages mapped
twice, so that a record that wraps is contiguous; each record is an 8-byte header (its
length with the BUSY and DISCARD bits), then the record, 8-byte aligned. lb_xdp's
capture (``lb_capture``) and session export (``lb_sess_export``) are read with it.
"""

from __future__ import annotations

import contextlib
import mmap
import select
import struct

import numpy as np
import numpy.typing as npt

from xdplb.core.closing import Closing
from xdplb.datapath.maps import Map, MapType

_BUSY = 1 << 31
_DISCARD = 1 << 30
_HDR = 8
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class RingReader(Closing):
    """The consumer side of a BPF_MAP_TYPE_RINGBUF map, through mmap."""

    def __init__(self, ring: Map) -> None:
        if ring.type is not MapType.RINGBUF:
            raise ValueError(f"map {ring.name} is not a ring buffer")
        self._ring = ring
        self._size = ring.max_entries
        self._mask = self._size - 1
        page = mmap.PAGESIZE
        self._cons = mmap.mmap(ring.fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._data = mmap.mmap(
            ring.fd, page + 2 * self._size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
        )
        self._page = page
        self._poll = select.poll()
        self._poll.register(ring.fd, select.POLLIN)

    def _positions(self) -> tuple[int, int]:
        (cons,) = _U64.unpack_from(self._cons, 0)
        (prod,) = _U64.unpack_from(self._data, 0)
        return cons, prod

    def skip(self) -> None:
        """Drop whatever is in the ring (records of an earlier capture)."""
        _cons, prod = self._positions()
        _U64.pack_into(self._cons, 0, prod)

    def wait(self, timeout_s: float) -> bool:
        """Until the ring has data or ``timeout_s`` passed; True if it has data."""
        cons, prod = self._positions()
        if cons != prod:
            return True
        return bool(self._poll.poll(max(0, int(timeout_s * 1000))))

    def drain(self, limit: int | None = None) -> list[bytes]:
        """The committed records, oldest first (at most ``limit``), consumed."""
        out: list[bytes] = []
        cons, prod = self._positions()
        while cons < prod and (limit is None or len(out) < limit):
            off = self._page + (cons & self._mask)
            (hdr,) = _U32.unpack_from(self._data, off)
            if hdr & _BUSY:
                break  # reserved, not yet submitted: later records wait for it
            length = hdr & ~(_BUSY | _DISCARD)
            if not hdr & _DISCARD:
                out.append(bytes(self._data[off + _HDR : off + _HDR + length]))
            cons += (length + _HDR + 7) & ~7
            _U64.pack_into(self._cons, 0, cons)
        return out

    def drain_array(
        self, dtype: np.dtype[np.void], limit: int | None = None
    ) -> npt.NDArray[np.void]:
        """:meth:`drain` for a ring whose every record is one ``dtype`` (the program
        submits one kind): the records as one array, from one copy of the ring's bytes,
        no Python object a record (~20 ns a record, where :meth:`drain` takes ~1 us).
        The data pages are mapped twice, so the span from the consumer position on is
        contiguous even where it wraps. ValueError for a record of another size."""
        cons, prod = self._positions()
        stride = (_HDR + dtype.itemsize + 7) & ~7
        n = (prod - cons) // stride
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return np.zeros(0, dtype=dtype)
        off = self._page + (cons & self._mask)
        rows = np.frombuffer(self._data, dtype=np.uint8, count=n * stride, offset=off)
        rows = rows.reshape(n, stride)
        hdr = np.ascontiguousarray(rows[:, :4]).view("<u4").ravel()  # headers first
        busy = np.flatnonzero(hdr & _BUSY)
        if len(busy):  # reserved, not yet submitted: it and what follows wait
            n = int(busy[0])
            rows, hdr = rows[:n], hdr[:n]
        if ((hdr & ~np.uint32(_BUSY | _DISCARD)) != dtype.itemsize).any():
            raise ValueError(f"a record of {self._ring.name} is not {dtype.itemsize} bytes")
        kept = rows[(hdr & _DISCARD) == 0, _HDR : _HDR + dtype.itemsize]
        out = np.ascontiguousarray(kept).view(dtype).reshape(-1)
        _U64.pack_into(self._cons, 0, cons + n * stride)
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._poll.unregister(self._ring.fd)
        for m in (getattr(self, "_cons", None), getattr(self, "_data", None)):
            if m is not None:
                m.close()
