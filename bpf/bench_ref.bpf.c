// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * Programs the benchmark compares lb_xdp against (bench/bench.py,
 * docs/benchmarks.md):
 *
 *   bench_ref  the reference: parse Ethernet / IPv4 (or IPv6) / TCP with every
 *              bounds check, swap the MACs, XDP_TX.  Anything else: XDP_PASS.
 *   bench_nop  XDP_PASS at once: wrapper + tail call into it is the harness cost.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

static __always_inline void swap_macs(struct ethhdr *eth)
{
	__u16 *p = (__u16 *)eth;
	__u16 t0 = p[0], t1 = p[1], t2 = p[2];

	p[0] = p[3];
	p[1] = p[4];
	p[2] = p[5];
	p[3] = t0;
	p[4] = t1;
	p[5] = t2;
}

SEC("xdp")
int bench_ref(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct tcphdr *tcp;

	if ((void *)(eth + 1) > data_end)
		return XDP_PASS;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph = (void *)(eth + 1);

		if ((void *)(iph + 1) > data_end)
			return XDP_PASS;
		if (iph->version != 4 || iph->ihl < 5 || iph->protocol != IPPROTO_TCP)
			return XDP_PASS;
		tcp = (void *)iph + iph->ihl * 4;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6h = (void *)(eth + 1);

		if ((void *)(ip6h + 1) > data_end)
			return XDP_PASS;
		if (ip6h->nexthdr != IPPROTO_TCP)
			return XDP_PASS;
		tcp = (void *)(ip6h + 1);
	} else {
		return XDP_PASS;
	}
	if ((void *)(tcp + 1) > data_end || tcp->doff < 5)
		return XDP_PASS;
	swap_macs(eth);
	return XDP_TX;
}

SEC("xdp")
int bench_nop(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
