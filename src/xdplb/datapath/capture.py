"""lb_xdp's packet capture from user space: its three maps and their reader.

This module owns turning a capture on and off (``lb_cap_cfg``: the settings with an
expiry on lb_xdp's clock, renewed while the reader runs, so a reader that is killed
stops the sampling within one lease), resetting and summing the per-CPU sampler
(``lb_cap_state``), and reading ``lb_capture``, a BPF ring buffer
(:mod:`xdplb.datapath.ringbuf`). One capture per instance at a time:
:func:`capture_lock` takes a lock file in the run directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from xdplb.core import abi, paths
from xdplb.core.capture import CaptureSettings, Record, vip_name
from xdplb.core.closing import Closing
from xdplb.core.errors import XdplbError
from xdplb.core.state import Vip
from xdplb.datapath.maps import Map
from xdplb.datapath.ringbuf import RingReader

CAPTURE_MAPS = ("lb_cap_cfg", "lb_cap_state", "lb_capture")
#: How long a capture stays on without a renewal: the longest an abandoned one samples.
LEASE_NS = 5_000_000_000
_U32 = struct.Struct("<I")
_ZERO = _U32.pack(0)


class CaptureBusy(XdplbError):
    """Another capture of the same instance is running."""


def monotonic_ns() -> int:
    """lb_xdp's clock (bpf_ktime_get_ns is CLOCK_MONOTONIC)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


@contextlib.contextmanager
def capture_lock(instance: str) -> Iterator[None]:
    """Hold ``<run dir>/<instance>.capture.lock`` (flock) for one capture's lifetime."""
    run = paths.run_dir()
    run.mkdir(parents=True, exist_ok=True)
    path = run / f"{instance}.capture.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise CaptureBusy(f"another capture of instance {instance} is running") from None
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CaptureStats:
    """Summed over CPUs since the capture started: records lb_xdp submitted, sampled
    packets over the per-second cap, and sampled packets the full ring had no room for."""

    records: int
    capped: int
    ring_full: int


class CaptureMaps(Closing):
    """lb_cap_cfg, lb_cap_state and lb_capture of one lb_xdp (from pins or an object)."""

    def __init__(self, maps: dict[str, Map], vips: Map | None = None) -> None:
        self.cfg = maps["lb_cap_cfg"]
        self.state = maps["lb_cap_state"]
        self.ring = RingReader(maps["lb_capture"])
        self._maps = maps
        self._vips = vips
        self._settings: CaptureSettings | None = None
        self._deadline: int | None = None

    @classmethod
    def from_pins(cls, pin_root: Path) -> CaptureMaps:
        missing = [n for n in (*CAPTURE_MAPS, "lb_vips") if not (pin_root / n).exists()]
        if missing:
            raise FileNotFoundError(
                f"{pin_root}: no pinned {', '.join(missing)}: is it running "
                "(a version of lb_xdp with capture)?"
            )
        maps = {n: Map.from_pinned(pin_root / n) for n in CAPTURE_MAPS}
        return cls(maps, Map.from_pinned(pin_root / "lb_vips"))

    def vip_names(self) -> dict[int, str]:
        """vip id -> ``ADDRESS:PORT/PROTOCOL``, from lb_vips now (empty without it)."""
        if self._vips is None:
            return {}
        out = {}
        for key, value in self._vips.items():
            vip = Vip.from_abi(abi.VipKey.from_buffer_copy(key))
            out[abi.VipInfo.from_buffer_copy(value).vip_id] = vip_name(
                vip.addr, vip.port, vip.proto
            )
        return out

    # -- on and off ------------------------------------------------------------------

    def start(self, settings: CaptureSettings, seconds: float | None = None) -> None:
        """Sampling on (a fresh sampler, an empty ring) until ``seconds`` from now, or
        for as long as :meth:`renew` is called at least once per lease."""
        self.state.update(_ZERO, bytes(self.state.value_stride))
        self.ring.skip()
        self._settings = settings
        now = monotonic_ns()
        self._deadline = None if seconds is None else now + int(seconds * 1e9)
        self._write(now)

    def renew(self) -> None:
        """Push the expiry one lease further (never past the deadline)."""
        if self._settings is not None:
            self._write(monotonic_ns())

    def _write(self, now: int) -> None:
        assert self._settings is not None
        expires = now + LEASE_NS
        if self._deadline is not None:
            expires = min(expires, self._deadline)
        self.cfg.update(_ZERO, self._settings.abi_value(max(expires, 1)).pack())

    def stop(self) -> None:
        """Sampling off: lb_xdp reads expires_ns 0 again."""
        self._settings = None
        self.cfg.update(_ZERO, bytes(abi.CaptureConfig()))

    def active(self) -> bool:
        """Does lb_cap_cfg say a capture is on (set and not expired)?"""
        raw = self.cfg.lookup(_ZERO)
        if raw is None:
            return False
        expires = int(abi.CaptureConfig.from_buffer_copy(raw).expires_ns)
        return expires != 0 and expires >= monotonic_ns()

    # -- reading ---------------------------------------------------------------------

    def read(self, timeout_s: float, limit: int | None = None) -> list[Record]:
        """The records that came within ``timeout_s`` (all that are ready, or none)."""
        if not self.ring.wait(timeout_s):
            return []
        return [Record.from_bytes(raw) for raw in self.ring.drain(limit)]

    def stats(self) -> CaptureStats:
        rows = [abi.CaptureState.from_buffer_copy(v) for v in self.state.lookup_percpu(_ZERO)]
        return CaptureStats(
            records=sum(r.records for r in rows),
            capped=sum(r.capped for r in rows),
            ring_full=sum(r.ring_full for r in rows),
        )

    def close(self) -> None:
        self.ring.close()
        if self._vips is not None:
            self._vips.close()
        for m in self._maps.values():
            m.close()
