/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Step 11 of docs/datapath.md: put Ethernet + outer IP (+ UDP + GUE) in
 * front of the original IP packet, then route the result (step 12).
 *
 * lb_encap() is always inlined with constant (family, GUE, hop count), so
 * each variant gets constant header sizes: one lb_push_outer() (hook.h), one
 * bounds check, fixed-offset stores.  The hop count is 1..XDPLB_MAX_HOPS:
 * the first hop, then tgt->next[0 .. hops - 2].
 */
#ifndef XDPLB_LIB_ENCAP_H
#define XDPLB_LIB_ENCAP_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/parsing.h"
#include "lib/csum.h"
#include "lib/gue.h"
#include "lib/counters.h"
#include "lib/fib.h"
#include "lib/lb_parse.h"
#include "lib/lb_select.h"
#include "lib/outer.h"

#define LB_OUTER_TTL	64

static __always_inline int lb_encap(struct lb_ctx *ctx, const struct lb_pkt *pkt,
				    const struct lb_target *tgt,
				    const struct xdplb_config *cfg,
				    const int v6, const int gue, const int hops)
{
	const __u32 l3_len = v6 ? sizeof(struct ipv6hdr) : sizeof(struct iphdr);
	const __u32 hop_len = v6 ? 16 : 4;
	const __u32 gue_len = gue ? sizeof(struct udphdr) + sizeof(struct xdplb_gue_hdr) +
				    sizeof(struct xdplb_gue_priv) +
				    hops * hop_len : 0;
	const __u32 outer_len = l3_len + gue_len;
	const __u8 inner_proto = pkt->family == XDPLB_FAMILY_V4 ? IPPROTO_IPIP : IPPROTO_IPV6;
	void *data = lb_data(ctx);
	void *data_end = lb_data_end(ctx);
	__u32 mac0, mac1, mac2, ptb;
	struct ethhdr *eth;
	void *l3;

	if (!outer_has_src(cfg, v6))
		return lb_drop(XDPLB_DROP_NO_CONFIG);
	/* lb_table_lookup() packed the later hops; the verifier wants to see it. */
	if ((gue && hops > 1 && !tgt->next[0]) || (gue && hops > 2 && !tgt->next[1]) ||
	    (gue && hops > 3 && !tgt->next[2]))
		return lb_drop(XDPLB_DROP_NO_BACKEND);

	/* Keep the original MACs: they stay in place if the FIB has no neighbour. */
	if (data + ETH_HLEN > data_end)
		return lb_drop(XDPLB_DROP_ENCAP);
	mac0 = ((__u32 *)data)[0];
	mac1 = ((__u32 *)data)[1];
	mac2 = ((__u32 *)data)[2];

	/* Grow the head so the inner IP header (after any VLAN tag) follows ours. */
	if (lb_push_outer(ctx, pkt->l3_off, outer_len, v6, gue, pkt->flow.proto))
		return lb_drop(XDPLB_DROP_ENCAP);

	/* Growing invalidated every packet pointer: reload and re-check. */
	data = lb_data(ctx);
	data_end = lb_data_end(ctx);
	if (data + ETH_HLEN + outer_len > data_end)
		return lb_drop(XDPLB_DROP_ENCAP);

	eth = data;
	((__u32 *)data)[0] = mac0;
	((__u32 *)data)[1] = mac1;
	((__u32 *)data)[2] = mac2;
	eth->h_proto = v6 ? bpf_htons(ETH_P_IPV6) : bpf_htons(ETH_P_IP);
	l3 = data + ETH_HLEN;

	if (!v6) {
		struct iphdr *iph = l3;

		/* Version 4 and IHL 5 share a byte with nothing: one store with TOS. */
		*(__be16 *)iph = bpf_htons(0x4500 | pkt->tos);
		iph->tot_len = bpf_htons(outer_len + pkt->ip_len);
		iph->id = 0;
		iph->frag_off = bpf_htons(IP_DF);
		iph->ttl = LB_OUTER_TTL;
		iph->protocol = gue ? IPPROTO_UDP : inner_proto;
		iph->check = 0;
		iph->saddr = cfg->src4;
		iph->daddr = tgt->be->addr[0];
		iph->check = ipv4_hdr_csum(iph);
	} else {
		struct ipv6hdr *ip6h = l3;

		/* Version 6, traffic class, flow label 0. */
		*(__be32 *)ip6h = bpf_htonl(0x60000000 | ((__u32)pkt->tos << 20));
		ip6h->payload_len = bpf_htons(gue_len + pkt->ip_len);
		ip6h->nexthdr = gue ? IPPROTO_UDP : inner_proto;
		ip6h->hop_limit = LB_OUTER_TTL;
		__builtin_memcpy(&ip6h->saddr, cfg->src6, 16);
		__builtin_memcpy(&ip6h->daddr, tgt->be->addr, 16);
	}

	if (gue) {
		struct udphdr *udp = l3 + l3_len;
		struct xdplb_gue_hdr *gh = (void *)(udp + 1);
		struct xdplb_gue_priv *gp = (void *)(gh + 1);
		__u32 *hop = (void *)(gp + 1);

		/* The hash in the source port spreads flows over ECMP paths and RSS queues. */
		udp->source = bpf_htons(0x8000 | (tgt->hash & 0x7fff));
		udp->dest = cfg->gue_port;
		udp->len = bpf_htons(gue_len + pkt->ip_len);
		/* RFC 6935: zero UDP checksum for a tunnel over IPv6 too. */
		udp->check = 0;

		/* Version 0, C 0, hlen = words of private data after the base header. */
		gh->hlen_ver = 1 + hops * (hop_len / 4);
		gh->proto = inner_proto;
		gh->flags = 0;
		/* glb-director's hop list; the first hop is the outer destination. */
		gp->type = 0;
		gp->next_hop = 0;
		gp->hop_count = hops;
		if (!v6) {
			hop[0] = tgt->be->addr[0];
			if (hops > 1)
				hop[1] = tgt->next[0]->addr[0];
			if (hops > 2)
				hop[2] = tgt->next[1]->addr[0];
			if (hops > 3)
				hop[3] = tgt->next[2]->addr[0];
		} else {
			__builtin_memcpy(hop, tgt->be->addr, 16);
			if (hops > 1)
				__builtin_memcpy(hop + 4, tgt->next[0]->addr, 16);
			if (hops > 2)
				__builtin_memcpy(hop + 8, tgt->next[1]->addr, 16);
			if (hops > 3)
				__builtin_memcpy(hop + 12, tgt->next[2]->addr, 16);
		}
	}

	/*
	 * Co-located (Unimog): the hop is this very host (its address is our tunnel
	 * source).  The frame still has our MAC as destination, so the stack takes
	 * it and host_tc on TC ingress decapsulates it: no trip through the wire.
	 */
	if (outer_is_src(cfg, tgt->be->addr, v6))
		return lb_pass(XDPLB_EV_LOCAL);
	/* Too big for the egress MTU: answered with the overhead the client must leave room for. */
	ptb = (cfg->flags & XDPLB_CFG_F_PTB) ? outer_len : 0;
	if (!v6)
		return lb_fib_forward4(ctx, eth, l3, tgt->be_id, ptb);
	return lb_fib_forward6(ctx, eth, l3, tgt->be_id, ptb);
}

/* lb_encap() with its variant's constants: IPIP, or GUE with 1..4 hops. */
static __always_inline int lb_encap_variant(struct lb_ctx *ctx, const struct lb_pkt *pkt,
					    const struct lb_target *tgt,
					    const struct xdplb_config *cfg, __u8 encap,
					    const int v6)
{
	if (encap == XDPLB_ENCAP_IPIP)
		return lb_encap(ctx, pkt, tgt, cfg, v6, 0, 1);
	switch (tgt->nhops) {
	case 2:
		return lb_encap(ctx, pkt, tgt, cfg, v6, 1, 2);
	case 3:
		return lb_encap(ctx, pkt, tgt, cfg, v6, 1, 3);
	case 4:
		return lb_encap(ctx, pkt, tgt, cfg, v6, 1, 4);
	default:
		return lb_encap(ctx, pkt, tgt, cfg, v6, 1, 1);
	}
}

#endif /* XDPLB_LIB_ENCAP_H */
