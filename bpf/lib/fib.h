/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Step 12 of docs/datapath.md: the next hop for the outer header comes from
 * the kernel's FIB and neighbour tables (bpf_fib_lookup), not from a static
 * gateway MAC.
 *
 * A lookup costs ~100 ns for IPv4 and ~240 ns for IPv6 on the 6.18 test
 * machines (policy rules, route, MTU, neighbour): more than the rest of the
 * known-flow path together.  So each CPU caches a successful result per
 * backend for LB_NH_LIFETIME jiffies; failures and "no neighbour yet" are
 * never cached, so they are retried on every packet.
 */
#ifndef XDPLB_LIB_FIB_H
#define XDPLB_LIB_FIB_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/parsing.h"
#include "lib/counters.h"
#include "lib/lb_ptb.h"

/* 64 jiffies: 64 ms at HZ=1000, 256 ms at HZ=250 - how stale a next hop may get. */
#define LB_NH_LIFETIME	64

/* A cached bpf_fib_lookup() success; BPF-internal, never read by user space. */
struct lb_nexthop {
	__u32 addr[4];		/* outer destination it was looked up for */
	__u64 expires;		/* jiffies */
	__u32 in_ifindex;	/* ingress device it was looked up from */
	__u32 out_ifindex;	/* egress device */
	__u16 max_len;		/* largest outer length that passed the MTU check */
	__u8 dmac[ETH_ALEN];
	__u8 smac[ETH_ALEN];
	__u16 pad;
};

/*
 * Backend id -> next hop, per CPU (no locks, no atomics).  Not pinned: a cache
 * that starts cold after a restart, and never meets an old layout in a pin.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct lb_nexthop);
} lb_nexthops SEC(".maps");

/*
 * Three 16-bit moves: struct ethhdr is packed, so a plain memcpy would be
 * compiled to six byte loads and stores.  Both ends are 2-byte aligned.
 */
static __always_inline void mac_copy(void *dst, const void *src)
{
	((__u16 *)dst)[0] = ((const __u16 *)src)[0];
	((__u16 *)dst)[1] = ((const __u16 *)src)[1];
	((__u16 *)dst)[2] = ((const __u16 *)src)[2];
}

/* Send the frame towards a resolved next hop: XDP_TX or a redirect. */
static __always_inline int lb_fib_send(struct lb_ctx *ctx, struct ethhdr *eth,
				       const __u8 *dmac, const __u8 *smac, __u32 out_ifindex)
{
	mac_copy(eth->h_dest, dmac);
	mac_copy(eth->h_source, smac);
	if (out_ifindex == ctx->ingress_ifindex) {
		lb_count_event(XDPLB_EV_TX);
		return lb_tx(ctx);
	}
	lb_count_event(XDPLB_EV_REDIRECT);
	return lb_redirect(ctx, out_ifindex);
}

/* A usable cache entry for this destination, ingress device and length, or NULL. */
static __always_inline struct lb_nexthop *
lb_nh_cached(struct lb_ctx *ctx, __u32 be_id, const __u32 *dst, const int v6, __u32 len)
{
	struct lb_nexthop *nh = bpf_map_lookup_elem(&lb_nexthops, &be_id);

	if (!nh)
		return NULL;
	if (nh->expires <= bpf_jiffies64() || nh->in_ifindex != ctx->ingress_ifindex ||
	    len > nh->max_len || nh->addr[0] != dst[0])
		return NULL;
	if (v6 && (nh->addr[1] != dst[1] || nh->addr[2] != dst[2] || nh->addr[3] != dst[3]))
		return NULL;
	return nh;
}

/*
 * The lookup proper.  dst is the outer destination as four words (IPv4:
 * dst[0], the rest 0), len the outer IP length for the MTU check; ptb the
 * encapsulation overhead when a packet too big is answered (lib/lb_ptb.h),
 * else 0.
 */
static __always_inline int lb_fib_finish(struct lb_ctx *ctx, struct ethhdr *eth,
					 struct bpf_fib_lookup *fib, __u32 be_id,
					 const __u32 *dst, __u32 len, __u32 ptb)
{
	/* Flags 0: a normal lookup through the policy rules, with the MTU check. */
	int rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	struct lb_nexthop *nh;

	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		nh = bpf_map_lookup_elem(&lb_nexthops, &be_id);
		if (nh) {
			/* A miss means expired, another hop, or a longer packet: len is the new bound. */
			__builtin_memcpy(nh->addr, dst, sizeof(nh->addr));
			nh->expires = bpf_jiffies64() + LB_NH_LIFETIME;
			nh->in_ifindex = ctx->ingress_ifindex;
			nh->out_ifindex = fib->ifindex;
			nh->max_len = len;
			mac_copy(nh->dmac, fib->dmac);
			mac_copy(nh->smac, fib->smac);
		}
		return lb_fib_send(ctx, eth, fib->dmac, fib->smac, fib->ifindex);
	}
	/*
	 * The frame still carries its original MACs (ours as destination), so
	 * the kernel takes it, forwards it and resolves the neighbour meanwhile.
	 */
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return lb_pass(XDPLB_EV_FIB_PASS);
	/* The path to the backend needs an MTU of client MTU + tunnel overhead. */
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) {
		if (ptb)
			return lb_icmp_ptb(ctx, fib->mtu_result, ptb);
		return lb_drop(XDPLB_DROP_TOO_BIG);
	}
	return lb_drop(XDPLB_DROP_FIB);
}

static __always_inline int lb_fib_forward4(struct lb_ctx *ctx, struct ethhdr *eth,
					   const struct iphdr *iph, __u32 be_id, __u32 ptb)
{
	__u32 dst[4] = { iph->daddr, 0, 0, 0 };
	__u32 len = lb_mtu_len(ctx, bpf_ntohs(iph->tot_len));
	struct bpf_fib_lookup fib = {};
	struct lb_nexthop *nh;

	nh = lb_nh_cached(ctx, be_id, dst, 0, len);
	if (nh)
		return lb_fib_send(ctx, eth, nh->dmac, nh->smac, nh->out_ifindex);

	fib.family = XDPLB_AF_INET;
	fib.tos = iph->tos;
	fib.l4_protocol = iph->protocol;
	fib.tot_len = len;
	fib.ifindex = ctx->ingress_ifindex;
	fib.ipv4_src = iph->saddr;
	fib.ipv4_dst = dst[0];
	return lb_fib_finish(ctx, eth, &fib, be_id, dst, len, ptb);
}

static __always_inline int lb_fib_forward6(struct lb_ctx *ctx, struct ethhdr *eth,
					   const struct ipv6hdr *ip6h, __u32 be_id, __u32 ptb)
{
	__u32 len = lb_mtu_len(ctx, sizeof(*ip6h) + bpf_ntohs(ip6h->payload_len));
	const __u32 *dst = (const __u32 *)&ip6h->daddr;
	struct bpf_fib_lookup fib = {};
	struct lb_nexthop *nh;

	nh = lb_nh_cached(ctx, be_id, dst, 1, len);
	if (nh)
		return lb_fib_send(ctx, eth, nh->dmac, nh->smac, nh->out_ifindex);

	fib.family = XDPLB_AF_INET6;
	fib.flowinfo = *(const __be32 *)ip6h & bpf_htonl(0x0fffffff);
	fib.l4_protocol = ip6h->nexthdr;
	fib.tot_len = len;
	fib.ifindex = ctx->ingress_ifindex;
	__builtin_memcpy(fib.ipv6_src, &ip6h->saddr, sizeof(fib.ipv6_src));
	__builtin_memcpy(fib.ipv6_dst, dst, sizeof(fib.ipv6_dst));
	return lb_fib_finish(ctx, eth, &fib, be_id, dst, len, ptb);
}

#endif /* XDPLB_LIB_FIB_H */
