"""BPF_PROG_TEST_RUN in live-frame mode: an XDP program's verdicts are carried out.

With ``BPF_F_TEST_XDP_LIVE_FRAMES`` (kernel >= 5.18) the kernel runs the program
``repeat`` times on copies of one frame, in batches, and really transmits what it
returns ``XDP_TX`` for (out of the context's ingress interface) or redirects. This is
how xdp-trafficgen generates traffic, and how the lab's flood generator does
(:mod:`xdplb.lab.flood`). Nothing comes back but the error code: no output data,
no verdict, no duration.
"""

from __future__ import annotations

from xdplb.datapath._ffi import check, ffi, lib, new_opts

#: <linux/bpf.h>: BPF_F_TEST_XDP_LIVE_FRAMES = 1U << 1.
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
#: The kernel's largest batch (TEST_XDP_MAX_BATCH); its default is 64 (NAPI's budget).
MAX_BATCH = 256


def xdp_live_frames(
    prog_fd: int, frame: bytes, *, ifindex: int, repeat: int, batch_size: int = MAX_BATCH
) -> None:
    """Run XDP program ``prog_fd`` ``repeat`` times on ``frame`` as if it arrived on
    ``ifindex`` (in the calling thread's network namespace), carrying out its verdicts.

    Returns when every repetition ran; a signal interrupts it (EINTR). Frames the
    device fails to send are dropped silently, as in a driver."""
    if not 1 <= batch_size <= MAX_BATCH:
        raise ValueError(f"batch_size must be 1..{MAX_BATCH}, not {batch_size}")
    data_in = ffi.from_buffer(frame)
    # The kernel wants data=0 and data_end=len in the context it is given.
    ctx = ffi.new("struct xdp_md *", {"data_end": len(frame), "ingress_ifindex": ifindex})
    opts = new_opts(
        "bpf_test_run_opts",
        data_in=data_in,
        data_size_in=len(frame),
        ctx_in=ctx,
        ctx_size_in=ffi.sizeof("struct xdp_md"),
        repeat=repeat,
        flags=BPF_F_TEST_XDP_LIVE_FRAMES,
        batch_size=batch_size,
    )
    check(lib.bpf_prog_test_run_opts(prog_fd, opts), "bpf_prog_test_run_opts(live frames)")
