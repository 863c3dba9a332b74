// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * clock: the session table's clock for user space.  lb_xdp stamps sessions
 * with jiffies (bpf_jiffies64(), inlined by the JIT), which user space cannot
 * read; BPF_PROG_TEST_RUN of this program writes them, with CLOCK_MONOTONIC,
 * into its context (xdplb.datapath.clock: "now" for imports and listings, and
 * the kernel's HZ from two readings).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

struct clock_ctx {
	__u64 jiffies;
	__u64 mono_ns;
};

SEC("syscall")
int clock_read(struct clock_ctx *ctx)
{
	ctx->jiffies = bpf_jiffies64();
	ctx->mono_ns = bpf_ktime_get_ns();
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
