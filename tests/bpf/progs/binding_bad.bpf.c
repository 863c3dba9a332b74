// SPDX-License-Identifier: GPL-2.0
/* Compiles, but the verifier must refuse it: a packet read with no bounds check. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_unchecked(struct xdp_md *ctx)
{
	unsigned char *data = (void *)(long)ctx->data;

	return data[20] ? XDP_PASS : XDP_DROP;
}

char LICENSE[] SEC("license") = "GPL";
