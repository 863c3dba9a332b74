/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * What the test-run wrappers share (bench_wrap.bpf.c for the benchmark,
 * tests/bpf/progs/conc_wrap.bpf.c for the concurrency test): BPF_PROG_TEST_RUN
 * with repeat > 1 runs a program again and again on one buffer, so each
 * iteration first puts the original frame back, then makes it the flow it
 * wants, then tail-calls the program under test.  Not part of the balancer.
 */
#ifndef XDPLB_LIB_WRAP_H
#define XDPLB_LIB_WRAP_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

/*
 * The original frame back: the head moved to where it was (the programs under
 * test only ever grow it; called even when nothing moved, so that every case
 * pays the same), then its len bytes from orig.  0, or -1 if either failed.
 * The caller has checked 14 <= len <= the size of orig.
 */
static __always_inline int wrap_restore(struct xdp_md *ctx, void *orig, __u32 len)
{
	int cur = (int)(ctx->data_end - ctx->data);

	if (bpf_xdp_adjust_head(ctx, cur - (int)len))
		return -1;
	return bpf_xdp_store_bytes(ctx, 0, orig, len) ? -1 : 0;
}

/* The 16-bit word at off in the frame, or NULL if it is not inside the first max bytes. */
static __always_inline __u16 *wrap_u16(struct xdp_md *ctx, __u32 off, __u32 max)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u16 *p;

	if (off > max - 2)
		return NULL;
	p = data + off;
	if ((void *)(p + 1) > data_end)
		return NULL;
	return p;
}

#endif /* XDPLB_LIB_WRAP_H */
