"""Loaded BPF programs: handles on a program file descriptor."""

from __future__ import annotations

from xdplb.core.closing import Closing
from xdplb.datapath._ffi import StrPath, close_fd, dup_fd, ffi, obj_get, obj_info, obj_pin
from xdplb.datapath.testrun import TestRunResult, test_run


class Program(Closing):
    """A loaded BPF program. Owns its file descriptor (closed by close() or on collection)."""

    def __init__(self, fd: int, name: str | None = None) -> None:
        """Wrap ``fd`` (ownership is taken); type and id come from the kernel."""
        self._fd = fd
        try:
            info = obj_info(fd, "bpf_prog_info", "bpf_obj_get_info_by_fd(prog)")
        except BaseException:
            close_fd(fd)
            self._fd = -1
            raise
        self.id: int = info.id
        #: ``enum bpf_prog_type`` (BPF_PROG_TYPE_XDP = 6, SCHED_CLS = 3, ...).
        self.type: int = info.type
        # The kernel keeps 15 characters of the name; libbpf knows the whole one.
        self.name: str = name if name is not None else ffi.string(info.name).decode()

    @classmethod
    def from_pinned(cls, path: StrPath) -> Program:
        return cls(obj_get(str(path), "bpf_obj_get"))

    @classmethod
    def from_fd(cls, fd: int, name: str | None = None) -> Program:
        """A handle on a duplicate of ``fd``; the caller keeps ownership of ``fd``."""
        return cls(dup_fd(fd), name)

    @property
    def fd(self) -> int:
        return self._fd

    def pin(self, path: StrPath) -> None:
        obj_pin(self._fd, str(path), f"bpf_obj_pin(prog {self.name})")

    def test_run(
        self,
        data: bytes,
        *,
        repeat: int = 1,
        ingress_ifindex: int = 0,
        data_size_out: int | None = None,
        ctx: bytes | None = None,
        meta: bytes = b"",
    ) -> TestRunResult:
        """Run on ``data`` via BPF_PROG_TEST_RUN (see :func:`testrun.test_run`)."""
        return test_run(
            self._fd,
            self.type,
            data,
            repeat=repeat,
            ingress_ifindex=ingress_ifindex,
            data_size_out=data_size_out,
            ctx=ctx,
            meta=meta,
            what=self.name,
        )

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        close_fd(fd)

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Program({self.name!r}, type={self.type}, id={self.id})"
