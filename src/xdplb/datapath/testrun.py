"""BPF_PROG_TEST_RUN: run a loaded program on one packet in the kernel, no device needed."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from xdplb.datapath._ffi import check, ffi, lib, new_opts

BPF_PROG_TYPE_XDP: int = lib.BPF_PROG_TYPE_XDP

#: Extra room in the output buffer so encapsulation (bpf_xdp_adjust_head) fits.
OUT_HEADROOM = 256

BPF_PROG_TYPE_SCHED_CLS: int = lib.BPF_PROG_TYPE_SCHED_CLS

#: Offsets in ``struct __sk_buff`` (UAPI, stable) of fields a TC test run may set: the
#: kernel refuses a context with any other field non-zero. ``ifindex`` is skb->dev.
SKB_MARK, SKB_INGRESS_IFINDEX, SKB_IFINDEX = 8, 36, 40
SKB_GSO_SEGS, SKB_GSO_SIZE = 164, 176
SKB_CTX_LEN = 44
#: The whole struct, for a context that sets the GSO fields (or reads them back).
SKB_CTX_FULL_LEN = 192


def skb_ctx(
    *,
    mark: int = 0,
    ifindex: int = 0,
    ingress_ifindex: int = 0,
    gso_size: int = 0,
    gso_segs: int = 0,
) -> bytes:
    """A ``struct __sk_buff`` prefix for a TC (SCHED_CLS) test run: the packet's mark, the
    devices it is on (resolved in the calling thread's network namespace) and, for a GSO
    packet, its segment size and count."""
    gso = gso_size or gso_segs
    ctx = bytearray(SKB_CTX_FULL_LEN if gso else SKB_CTX_LEN)
    struct.pack_into("<I", ctx, SKB_MARK, mark)
    struct.pack_into("<II", ctx, SKB_INGRESS_IFINDEX, ingress_ifindex, ifindex)
    if gso:
        struct.pack_into("<I", ctx, SKB_GSO_SEGS, gso_segs)
        struct.pack_into("<I", ctx, SKB_GSO_SIZE, gso_size)
    return bytes(ctx)


def skb_gso(ctx_out: bytes) -> tuple[int, int]:
    """(gso_size, gso_segs) of the skb as a TC test run left it (a full context)."""
    (segs,) = struct.unpack_from("<I", ctx_out, SKB_GSO_SEGS)
    (size,) = struct.unpack_from("<I", ctx_out, SKB_GSO_SIZE)
    return size, segs


@dataclasses.dataclass(frozen=True)
class TestRunResult:
    """What one BPF_PROG_TEST_RUN returned."""

    __test__ = False  # not a pytest test class, despite the name

    #: The program's return code (an XDP action, a TC verdict, ...).
    retval: int
    #: The packet as the program left it.
    data: bytes
    #: The kernel's average run time per repetition, in nanoseconds.
    duration_ns: int
    #: The context as the program left it, when one was given (the kernel's whole struct).
    ctx_out: bytes | None = None


def test_run(
    prog_fd: int,
    prog_type: int,
    data: bytes,
    *,
    repeat: int = 1,
    ingress_ifindex: int = 0,
    data_size_out: int | None = None,
    ctx: bytes | None = None,
    meta: bytes = b"",
    what: str = "prog",
) -> TestRunResult:
    """bpf_prog_test_run_opts on ``data``. With ``repeat`` > 1 the kernel reuses one
    buffer, so a rewriting program sees its own output from the second run on.

    ``ctx`` is the program's context as bytes (e.g. :func:`skb_ctx` for TC); for XDP,
    ``ingress_ifindex`` and ``meta`` (the frame's metadata, in front of it: a multiple
    of 4 bytes) build one instead. The result's data is the frame without metadata."""
    if meta and (prog_type != BPF_PROG_TYPE_XDP or len(meta) % 4):
        raise ValueError("metadata is for XDP, in multiples of 4 bytes")
    data = meta + data
    size_out = len(data) + OUT_HEADROOM if data_size_out is None else data_size_out
    data_in = ffi.from_buffer(data)
    data_out = ffi.new("char[]", max(size_out, 1))
    opts = new_opts(
        "bpf_test_run_opts",
        data_in=data_in,
        data_size_in=len(data),
        data_out=data_out,
        data_size_out=size_out,
        repeat=repeat,
    )
    c_ctx: Any = None
    c_ctx_out: Any = None
    if ctx is not None:
        c_ctx = ffi.from_buffer(ctx)
        # The kernel copies its whole context struct back, or fails with ENOSPC.
        ctx_out_len = max(len(ctx), SKB_CTX_FULL_LEN)
        c_ctx_out = ffi.new("char[]", ctx_out_len)
        opts.ctx_in = c_ctx
        opts.ctx_size_in = len(ctx)
        opts.ctx_out = c_ctx_out
        opts.ctx_size_out = ctx_out_len
    elif prog_type == BPF_PROG_TYPE_XDP and (ingress_ifindex or meta):
        # The kernel wants data_meta=0, data=the metadata's length, data_end=len, and
        # resolves the ifindex in our netns.
        c_ctx = ffi.new(
            "struct xdp_md *",
            {"data": len(meta), "data_end": len(data), "ingress_ifindex": ingress_ifindex},
        )
        opts.ctx_in = c_ctx
        opts.ctx_size_in = ffi.sizeof("struct xdp_md")
    check(lib.bpf_prog_test_run_opts(prog_fd, opts), f"bpf_prog_test_run_opts({what})")
    return TestRunResult(
        retval=opts.retval,
        # An XDP run's output starts at the metadata (which moves with the frame).
        data=ffi.buffer(data_out, opts.data_size_out)[len(meta) :],
        duration_ns=opts.duration,
        ctx_out=ffi.buffer(c_ctx_out, opts.ctx_size_out)[:] if ctx is not None else None,
    )
