// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * xdp_pass: passes every frame.  The lab attaches it to the bridge-side peer
 * of the balancer's veth, because a veth drops frames sent with XDP_TX or
 * XDP_REDIRECT unless the receiving peer has an XDP program (or GRO) on.
 * It is also the baseline of per-packet cost measurements (docs/design.md §8).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
