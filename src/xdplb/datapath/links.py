"""Attaching programs: XDP through bpf_link, TC (clsact, direct-action) through netlink,
cgroup and sk_lookup hooks through bpf_link, iterators, sk_reuseport groups."""

from __future__ import annotations

import enum
import errno
import os
import socket
import struct
import sys

from xdplb.core.closing import Closing
from xdplb.datapath._ffi import (
    StrPath,
    check,
    close_fd,
    ffi,
    lib,
    new_opts,
    obj_get,
    obj_info,
    obj_pin,
)
from xdplb.datapath.programs import Program


class XdpMode(enum.IntEnum):
    """XDP attach mode: the XDP_FLAGS_* value passed to bpf_link_create."""

    GENERIC = 1 << 1  # XDP_FLAGS_SKB_MODE
    NATIVE = 1 << 2  # XDP_FLAGS_DRV_MODE


class Link(Closing):
    """A bpf_link. Closing the fd detaches it unless it is pinned; detach() always does."""

    def __init__(self, fd: int) -> None:
        """Wrap ``fd`` (ownership is taken)."""
        self._fd = fd

    @classmethod
    def from_pinned(cls, path: StrPath) -> Link:
        return cls(obj_get(str(path), "bpf_obj_get"))

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def id(self) -> int:
        return int(obj_info(self._fd, "bpf_link_info", "bpf_obj_get_info_by_fd(link)").id)

    @property
    def prog_id(self) -> int:
        """Id of the program the link runs now (0 once detached)."""
        return int(obj_info(self._fd, "bpf_link_info", "bpf_obj_get_info_by_fd(link)").prog_id)

    def _union(self, size: int) -> bytes:
        """The first ``size`` bytes of the raw ``struct bpf_link_info``'s per-type union,
        which starts at byte 16."""
        buf = ffi.new("unsigned char[]", 64)
        length = ffi.new("__u32 *", 64)
        check(lib.bpf_obj_get_info_by_fd(self._fd, buf, length), "bpf_obj_get_info_by_fd(link)")
        return bytes(buf[16 : 16 + size])

    @property
    def xdp_ifindex(self) -> int:
        """The interface an XDP or tcx link drives (``xdp.ifindex``, ``tcx.ifindex``);
        0 once detached."""
        return int.from_bytes(self._union(4), sys.byteorder)

    @property
    def cgroup_id(self) -> int:
        """The cgroup a cgroup link is attached to (``cgroup.cgroup_id``: the inode of its
        directory in the v2 hierarchy); 0 once detached."""
        return int.from_bytes(self._union(8), sys.byteorder)

    def pin(self, path: StrPath) -> None:
        """Pin in bpffs: the attachment then outlives this process."""
        obj_pin(self._fd, str(path), "bpf_obj_pin(link)")

    def update_program(self, prog: Program) -> None:
        """Atomically replace the attached program (bpf_link_update)."""
        check(
            lib.bpf_link_update(self._fd, prog.fd, new_opts("bpf_link_update_opts")),
            f"bpf_link_update({prog.name})",
        )

    def detach(self) -> None:
        """Detach now, even if pinned or held open elsewhere (pins stay: unlink them)."""
        check(lib.bpf_link_detach(self._fd), "bpf_link_detach")

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        close_fd(fd)

    def __del__(self) -> None:
        self.close()


def attach_xdp(prog: Program, ifindex: int, mode: XdpMode = XdpMode.NATIVE) -> Link:
    """Attach an XDP program to ``ifindex`` (in the calling thread's netns) as a bpf_link."""
    opts = new_opts("bpf_link_create_opts", flags=int(mode))
    fd = lib.bpf_link_create(prog.fd, ifindex, lib.BPF_XDP, opts)
    return Link(check(fd, f"bpf_link_create(xdp {prog.name}, ifindex {ifindex}, {mode.name})"))


#: ``BPF_TCX_INGRESS`` (UAPI, kernel 6.6+): TC ingress through a bpf_link (tcx). Not in
#: Debian 12's headers (6.1), so spelled out here; the value is fixed by the UAPI.
BPF_TCX_INGRESS = 46


def attach_tcx(prog: Program, ifindex: int) -> Link:
    """Attach a SCHED_CLS program at TC ingress of ``ifindex`` as a bpf_link (tcx), after
    any tcx program already there. A link, as for XDP: pinned it outlives its process, and
    :meth:`Link.update_program` swaps the program atomically. Programs attached the old
    way (clsact filters, host_tc's) still run after it when it returns TC_ACT_UNSPEC."""
    fd = lib.bpf_link_create(prog.fd, ifindex, BPF_TCX_INGRESS, new_opts("bpf_link_create_opts"))
    return Link(check(fd, f"bpf_link_create(tcx ingress {prog.name}, ifindex {ifindex})"))


def tcx_programs(ifindex: int) -> list[int]:
    """Ids of the programs attached at tcx ingress of ``ifindex``, in the order they run
    (BPF_PROG_QUERY; its target is the ifindex for tcx)."""
    ids = ffi.new("__u32[]", 64)
    cnt = ffi.new("__u32 *", 64)
    check(
        lib.bpf_prog_query(ifindex, BPF_TCX_INGRESS, 0, ffi.NULL, ids, cnt),
        f"bpf_prog_query(tcx ingress, ifindex {ifindex})",
    )
    return [int(ids[i]) for i in range(cnt[0])]


def _tc_hook(ifindex: int, ingress: bool) -> object:
    point = lib.BPF_TC_INGRESS if ingress else lib.BPF_TC_EGRESS
    return new_opts("bpf_tc_hook", ifindex=ifindex, attach_point=point)


def _where(ifindex: int, ingress: bool) -> str:
    return f"ifindex {ifindex} {'ingress' if ingress else 'egress'}"


def tc_attach(
    prog: Program, ifindex: int, *, ingress: bool = True, priority: int = 1, handle: int = 1
) -> None:
    """Attach a SCHED_CLS program direct-action on clsact, replacing any filter at the
    same (priority, handle). Creates the clsact qdisc when missing."""
    hook = _tc_hook(ifindex, ingress)
    ret = lib.bpf_tc_hook_create(hook)
    if ret != -errno.EEXIST:
        check(ret, f"bpf_tc_hook_create({_where(ifindex, ingress)})")
    opts = new_opts(
        "bpf_tc_opts",
        prog_fd=prog.fd,
        handle=handle,
        priority=priority,
        flags=lib.BPF_TC_F_REPLACE,
    )
    check(lib.bpf_tc_attach(hook, opts), f"bpf_tc_attach({prog.name}, {_where(ifindex, ingress)})")


def tc_detach(ifindex: int, *, ingress: bool = True, priority: int = 1, handle: int = 1) -> None:
    """Remove the filter at (priority, handle); the clsact qdisc stays."""
    opts = new_opts("bpf_tc_opts", handle=handle, priority=priority)
    check(
        lib.bpf_tc_detach(_tc_hook(ifindex, ingress), opts),
        f"bpf_tc_detach({_where(ifindex, ingress)})",
    )


def tc_query(
    ifindex: int, *, ingress: bool = True, priority: int = 1, handle: int = 1
) -> int | None:
    """Id of the program attached at (priority, handle), or None."""
    opts = new_opts("bpf_tc_opts", handle=handle, priority=priority)
    ret = lib.bpf_tc_query(_tc_hook(ifindex, ingress), opts)
    if ret in (-errno.ENOENT, -errno.EINVAL):  # no filter / no clsact qdisc
        return None
    check(ret, f"bpf_tc_query({_where(ifindex, ingress)})")
    return int(opts.prog_id)


def tc_hook_destroy(ifindex: int) -> None:
    """Delete the clsact qdisc (both directions, with their filters)."""
    hook = new_opts(
        "bpf_tc_hook", ifindex=ifindex, attach_point=lib.BPF_TC_INGRESS | lib.BPF_TC_EGRESS
    )
    ret = lib.bpf_tc_hook_destroy(hook)
    if ret != -errno.ENOENT:
        check(ret, f"bpf_tc_hook_destroy(ifindex {ifindex})")


def attach_link(prog: Program, target_fd: int, attach_type: int, what: str) -> Link:
    """A bpf_link of ``prog`` on ``target_fd``: a cgroup directory's fd for the cgroup
    hooks (``lib.BPF_CGROUP_INET4_CONNECT``, ...), a network namespace's fd
    (/proc/self/ns/net) for ``lib.BPF_SK_LOOKUP``. Closing the link (unpinned) detaches."""
    fd = lib.bpf_link_create(prog.fd, target_fd, attach_type, new_opts("bpf_link_create_opts"))
    return Link(check(fd, f"bpf_link_create({prog.name}, {what})"))


def run_iter(prog: Program, limit: int = 1 << 24) -> bytes:
    """Run an iterator program (SEC("iter/...")) once over its objects and return what it
    wrote with bpf_seq_printf/bpf_seq_write (at most ``limit`` bytes read)."""
    with attach_link(prog, 0, lib.BPF_TRACE_ITER, "iter") as link:
        fd = check(lib.bpf_iter_create(link.fd), f"bpf_iter_create({prog.name})")
        out = bytearray()
        try:
            while len(out) < limit:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out += chunk
        finally:
            close_fd(fd)
    return bytes(out)


#: SO_ATTACH_REUSEPORT_EBPF (asm-generic/socket.h); not in Python's socket module.
SO_ATTACH_REUSEPORT_EBPF = 52
SO_DETACH_REUSEPORT_BPF = 68


def attach_reuseport(prog: Program, sock: socket.socket) -> None:
    """Attach an sk_reuseport program to the SO_REUSEPORT group of ``sock`` (bound): it
    then selects the socket for every packet or connection to the group."""
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_EBPF, struct.pack("i", prog.fd))
