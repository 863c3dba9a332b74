/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Steps 1-5 and 7 of docs/datapath.md: from a frame to a flow key, or to the
 * verdict for a frame that is not ours to balance.  Two halves with the
 * global ACL between them (lb_xdp.bpf.c): lb_parse_ip() (1-2: Ethernet, IP,
 * IPv6 extension headers) knows the addresses, lb_parse_l4() (3-5) the ports.
 */
#ifndef XDPLB_LIB_LB_PARSE_H
#define XDPLB_LIB_LB_PARSE_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/parsing.h"
#include "lib/hash.h"
#include "lib/lb_maps.h"
#include "lib/counters.h"

/* lb_parse_*() result meaning "go on": a TCP/UDP packet with a flow key. */
#define LB_CONTINUE	(-1)
/* lb_parse_l4() result: a TCP/UDP fragment, or ICMP: lib/lb_icmp.h takes it. */
#define LB_SLOW		(-2)

/* What the later steps need to know about the packet, parsed once. */
struct lb_pkt {
	struct xdplb_flow_key flow;	/* step 7: every other byte 0 */
	__u32 l3_off;		/* inner IP header offset: 14, or 18 with a VLAN tag */
	__u32 ip_len;		/* inner IP length: tot_len, or 40 + payload_len */
	__u32 l4_len;		/* IP payload after the IPv4 options / IPv6 extension headers */
	__u8 family;		/* enum xdplb_family of the inner packet */
	__u8 tos;		/* inner TOS / traffic class, copied to the outer header */
	__u8 tcp_flags;		/* TCP flags byte; 0 for UDP */
	__u8 frag;		/* a fragment: IPv4 MF or offset, IPv6 fragment header with either */
};

/* Where the headers are; packet pointers, kept apart from lb_pkt's plain values. */
struct lb_cursor {
	void *l3;		/* the IP header */
	void *l4;		/* the upper-layer header (TCP, UDP, ICMP) */
};

/*
 * Step 2': could this destination be a VIP's address?  One bit of lb_vip_filter
 * (xdplb_addr_filter_bit): clear is a certain no, set a maybe that the later
 * steps settle.  Cheaper than any hash map lookup, so traffic for the host
 * itself pays almost nothing.
 */
static __always_inline int lb_maybe_vip_addr(const struct lb_pkt *pkt)
{
	__u32 bit = xdplb_addr_filter_bit(pkt->flow.dst);
	__u32 idx = bit / 64;
	const __u64 *word = bpf_map_lookup_elem(&lb_vip_filter, &idx);

	return word && ((*word >> (bit % 64)) & 1);
}

_Static_assert(XDPLB_VIP_FILTER_BITS == 16, "xdplb_addr_filter_bit() gives 16 bits");

/* The session table's clock: jiffies, which the JIT inlines into a load (a helper call is ~15 ns). */
static __always_inline __u32 lb_now(void)
{
	return bpf_jiffies64();
}

/* Is this destination the address of some VIP? (for packets without ports) */
static __always_inline int lb_is_vip_addr(const struct lb_pkt *pkt)
{
	struct xdplb_addr key = {};

	__builtin_memcpy(key.addr, pkt->flow.dst, sizeof(key.addr));
	key.family = pkt->family;
	return bpf_map_lookup_elem(&lb_vip_addrs, &key) != NULL;
}

/* A VIP packet we cannot balance is dropped; anyone else's is passed on. */
static __always_inline int lb_vip_drop_or_pass(const struct lb_pkt *pkt,
					       enum xdplb_drop_reason reason)
{
	if (lb_is_vip_addr(pkt))
		return lb_drop(reason);
	return lb_pass(XDPLB_EV_PASS_NOT_VIP);
}

/* Steps 1-2: addresses, family, lengths and the upper-layer protocol (flow.proto). */
static __always_inline int lb_parse_ip(struct lb_ctx *ctx, struct lb_pkt *pkt,
				       struct lb_cursor *cur)
{
	void *data = lb_data(ctx);
	void *data_end = lb_data_end(ctx);
	struct hdr_cursor nh = { .pos = data };
	struct ethhdr *eth;
	int h_proto, proto;
	__u32 skb_left = 0;

	h_proto = parse_ethhdr(&nh, data_end, &eth);
	pkt->l3_off = nh.pos - data;
	cur->l3 = nh.pos;
#ifdef XDPLB_HOOK_TC
	/* A GSO or GRO packet's payload is in pages beyond data_end: lengths are the skb's. */
	skb_left = ctx->len - pkt->l3_off;
#endif

	if (h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph;

		proto = parse_iphdr(&nh, data_end, &iph, &pkt->ip_len, skb_left);
		if (proto < 0)
			return lb_pass(XDPLB_EV_PASS_MALFORMED);
		pkt->family = XDPLB_FAMILY_V4;
		pkt->tos = iph->tos;
		pkt->flow.src[0] = iph->saddr;
		pkt->flow.dst[0] = iph->daddr;
		pkt->frag = (iph->frag_off & bpf_htons(IP_MF | IP_OFFSET)) != 0;
		pkt->l4_len = pkt->ip_len - (nh.pos - (void *)iph);
	} else if (h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6h;

		proto = parse_ip6hdr(&nh, data_end, &ip6h, &pkt->ip_len, skb_left);
		if (proto < 0)
			return lb_pass(XDPLB_EV_PASS_MALFORMED);
		pkt->family = XDPLB_FAMILY_V6;
		/* Traffic class straddles the first two bytes. */
		pkt->tos = (ip6h->priority << 4) | (ip6h->flow_lbl[0] >> 4);
		__builtin_memcpy(pkt->flow.src, &ip6h->saddr, 16);
		__builtin_memcpy(pkt->flow.dst, &ip6h->daddr, 16);
		pkt->l4_len = pkt->ip_len - sizeof(*ip6h);
		/* TCP and UDP right after the fixed header skip the walk. */
		if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
			proto = parse_ip6_exthdrs(&nh, data_end, proto, &pkt->l4_len, &pkt->frag);
			if (proto < 0)
				return lb_pass(XDPLB_EV_PASS_MALFORMED);
		}
	} else {
		return lb_pass(XDPLB_EV_PASS_NOT_IP);
	}
	pkt->flow.proto = proto;
	cur->l4 = nh.pos;
	return LB_CONTINUE;
}

/*
 * Steps 3-5: TCP/UDP fragments and ICMP go to lib/lb_icmp.h (LB_SLOW), other
 * protocols pass, then the ports of TCP and UDP.
 */
static __always_inline int lb_parse_l4(struct lb_ctx *ctx, struct lb_pkt *pkt,
				       struct lb_cursor *cur)
{
	struct hdr_cursor nh = { .pos = cur->l4 };
	void *data_end = lb_data_end(ctx);
	__u8 proto = pkt->flow.proto;
	__u32 ports;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
		if (!pkt->frag && ((proto == IPPROTO_ICMP && pkt->family == XDPLB_FAMILY_V4) ||
				   (proto == IPPROTO_ICMPV6 && pkt->family == XDPLB_FAMILY_V6)))
			return LB_SLOW;
		return lb_pass(XDPLB_EV_PASS_NOT_VIP);
	}
	/* Only the first fragment has ports: every fragment is balanced without them. */
	if (pkt->frag)
		return LB_SLOW;
	if (parse_ports(&nh, data_end, proto, pkt->l4_len, &ports, &pkt->tcp_flags) < 0)
		return lb_vip_drop_or_pass(pkt, XDPLB_DROP_MALFORMED_L4);
	/* sport then dport in memory, exactly as in the L4 header. */
	__builtin_memcpy(&pkt->flow.sport, &ports, sizeof(ports));
	return LB_CONTINUE;
}

#endif /* XDPLB_LIB_LB_PARSE_H */
