/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * hc_tc's work (docs/datapath.md, "hc_tc"): parse a locally generated packet,
 * put lb_xdp's outer headers in front of it, route the result.
 *
 * The outer headers are byte for byte those of lb_encap() (lib/encap.h) for a
 * one-hop packet: same fields, same TTL, same GUE source port from the same
 * flow hash.  The code is an skb twin rather than a shared helper because
 * the XDP version grows the head with bpf_xdp_adjust_head() and keeps a
 * per-CPU next-hop cache whose map hc_tc must not carry.
 */
#ifndef XDPLB_LIB_HC_ENCAP_H
#define XDPLB_LIB_HC_ENCAP_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/csum.h"
#include "lib/gue.h"
#include "lib/hash.h"
#include "lib/hc_maps.h"
#include "lib/outer.h"
#include "lib/parsing.h"

#define HC_OUTER_TTL	64	/* lib/encap.h: LB_OUTER_TTL */

/* Longest header stack hc_parse() reads: Ethernet, IPv4 with options, ports. */
#define HC_MAX_HDR	(ETH_HLEN + 60 + 4)

/* The inner packet, as the flow hash and the outer header need it. */
struct hc_pkt {
	struct xdplb_flow_key flow;	/* every other byte 0, as lb_xdp keys it */
	__u32 ip_len;		/* inner IP length: tot_len, or 40 + payload_len */
	__u8 family;		/* enum xdplb_family of the inner packet */
	__u8 tos;		/* inner TOS / traffic class, copied to the outer header */
};

/* Every drop goes through here, under a named reason. */
static __always_inline int hc_drop(enum xdplb_hc_event reason)
{
	hc_count(reason);
	return TC_ACT_SHOT;
}

/* Sockets may leave payload in page fragments: make the headers direct-readable. */
static __always_inline int hc_linearize(struct __sk_buff *skb)
{
	__u32 want = skb->len < HC_MAX_HDR ? skb->len : HC_MAX_HDR;

	if ((long)skb->data + want <= (long)skb->data_end)
		return 0;
	return bpf_skb_pull_data(skb, want);
}

/*
 * IPv4 (options allowed, no fragment) or IPv6 (no extension header) carrying
 * TCP or UDP, on Ethernet without a VLAN tag (what the stack hands a NOARP
 * device).  0 with @pkt filled in, or -1: lb_xdp could not balance it either.
 */
static __always_inline int hc_parse(struct __sk_buff *skb, struct hc_pkt *pkt)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__u32 hdrsize;
	__u8 proto;
	void *l4;

	if ((void *)(eth + 1) > data_end)
		return -1;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *iph = (void *)(eth + 1);

		if ((void *)(iph + 1) > data_end)
			return -1;
		hdrsize = *(__u8 *)iph;
		if ((hdrsize >> 4) != 4)
			return -1;
		hdrsize = (hdrsize & 0x0f) * 4;
		if (hdrsize < sizeof(*iph))
			return -1;
		/* A check sends no fragments; lb_xdp would hash one on its addresses
		 * alone (datapath.md step 4a), which this encapsulation does not model. */
		if (iph->frag_off & bpf_htons(IP_MF | IP_OFFSET))
			return -1;
		pkt->ip_len = bpf_ntohs(iph->tot_len);
		pkt->family = XDPLB_FAMILY_V4;
		pkt->tos = iph->tos;
		pkt->flow.src[0] = iph->saddr;
		pkt->flow.dst[0] = iph->daddr;
		proto = iph->protocol;
		l4 = (void *)iph + hdrsize;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6h = (void *)(eth + 1);

		if ((void *)(ip6h + 1) > data_end)
			return -1;
		if ((*(__u8 *)ip6h >> 4) != 6)
			return -1;
		hdrsize = sizeof(*ip6h);
		pkt->ip_len = sizeof(*ip6h) + bpf_ntohs(ip6h->payload_len);
		pkt->family = XDPLB_FAMILY_V6;
		/* Traffic class straddles the first two bytes. */
		pkt->tos = (ip6h->priority << 4) | (ip6h->flow_lbl[0] >> 4);
		__builtin_memcpy(pkt->flow.src, &ip6h->saddr, 16);
		__builtin_memcpy(pkt->flow.dst, &ip6h->daddr, 16);
		proto = ip6h->nexthdr;
		l4 = ip6h + 1;
	} else {
		return -1;
	}
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return -1;
	/* The IP length must cover the header and the ports, and the skb the IP length. */
	if (pkt->ip_len < hdrsize + 4 || pkt->ip_len > skb->len - ETH_HLEN)
		return -1;
	if (l4 + 4 > data_end)
		return -1;
	/* sport then dport in memory, exactly as in the L4 header (lib/lb_parse.h). */
	__builtin_memcpy(&pkt->flow.sport, l4, 4);
	pkt->flow.proto = proto;
	return 0;
}

/* lib/lb_select.h: the flow hash, or the source-only hash of an XDPLB_VIP_F_SRC_HASH VIP. */
static __always_inline __u32 hc_flow_hash(const struct hc_pkt *pkt,
					  const struct xdplb_hc_target *tgt, __u32 seed)
{
	struct xdplb_flow_key src_only = {};

	if (!(tgt->flags & XDPLB_HC_F_SRC_HASH))
		return xdplb_flow_hash((const __u32 *)&pkt->flow, seed);
	__builtin_memcpy(src_only.src, pkt->flow.src, sizeof(src_only.src));
	return xdplb_flow_hash((const __u32 *)&src_only, seed);
}

/*
 * Route the outer packet (lb_xdp step 12, without its cache): a lookup with
 * flags 0 is an input-style lookup from the device, which therefore must have
 * forwarding on.  It runs with mark 0 (no BPF_FIB_LOOKUP_MARK): the main
 * tables, never the fwmark rule that sent the inner packet here.  A resolved
 * neighbour gives the MACs and bpf_redirect().  An unresolved one is left to
 * bpf_redirect_neigh() without a next hop, after clearing the mark: the
 * helper then routes the packet itself (by mark 0, out of the egress device)
 * and attaches that route.  Given a next hop instead, it would keep the
 * skb's route to our device, and the neighbour layer, once resolved,
 * re-sends queued packets by the skb's route: the first packet left with
 * our device's MACs and was lost (measured: a 1 s SYN retransmission).
 */
static __always_inline int hc_fib_send(struct __sk_buff *skb, struct ethhdr *eth,
				       const void *l3, const int v6, __u32 len, __u8 l4_proto)
{
	struct bpf_fib_lookup fib = {};
	int rc;

	fib.ifindex = skb->ifindex;
	fib.l4_protocol = l4_proto;
	/*
	 * TCP always hands the device GSO packets (Linux 6.0+, whatever the
	 * device's features): their segments, not their length, must fit the
	 * MTU.  tot_len 0 has the helper check the skb instead, which lets GSO
	 * packets through; the device's MTU bounds their segments.
	 */
	fib.tot_len = skb->gso_size ? 0 : len;
	if (!v6) {
		const struct iphdr *iph = l3;

		fib.family = XDPLB_AF_INET;
		fib.tos = iph->tos;
		fib.ipv4_src = iph->saddr;
		fib.ipv4_dst = iph->daddr;
	} else {
		const struct ipv6hdr *ip6h = l3;

		fib.family = XDPLB_AF_INET6;
		fib.flowinfo = *(const __be32 *)ip6h & bpf_htonl(0x0fffffff);
		__builtin_memcpy(fib.ipv6_src, &ip6h->saddr, sizeof(fib.ipv6_src));
		__builtin_memcpy(fib.ipv6_dst, &ip6h->daddr, sizeof(fib.ipv6_dst));
	}

	rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		__builtin_memcpy(eth->h_dest, fib.dmac, ETH_ALEN);
		__builtin_memcpy(eth->h_source, fib.smac, ETH_ALEN);
		hc_count(XDPLB_HC_REDIRECT);
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		skb->mark = 0;
		hc_count(XDPLB_HC_REDIRECT_NEIGH);
		return bpf_redirect_neigh(fib.ifindex, NULL, 0, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return hc_drop(XDPLB_HC_DROP_TOO_BIG);
	return hc_drop(XDPLB_HC_DROP_FIB);
}

/*
 * lb_encap() for an skb and one hop, always inlined with constant (v6, gue)
 * so that header sizes are constants.  bpf_skb_adjust_room() opens the gap
 * after the Ethernet header; the ENCAP flags set skb->protocol to the outer
 * family (4in6, 6in4) and mark the inner headers for GSO.
 */
static __always_inline int hc_encap(struct __sk_buff *skb, const struct hc_pkt *pkt,
				    const struct xdplb_hc_target *tgt,
				    const struct xdplb_config *cfg, __u32 hash,
				    const int v6, const int gue)
{
	const __u32 l3_len = v6 ? sizeof(struct ipv6hdr) : sizeof(struct iphdr);
	const __u32 hop_len = v6 ? 16 : 4;
	const __u32 gue_len = gue ? sizeof(struct udphdr) + sizeof(struct xdplb_gue_hdr) +
				    sizeof(struct xdplb_gue_priv) + hop_len : 0;
	const __u32 outer_len = l3_len + gue_len;
	const __u8 inner_proto = pkt->family == XDPLB_FAMILY_V4 ? IPPROTO_IPIP : IPPROTO_IPV6;
	const __u8 l4_proto = gue ? IPPROTO_UDP : inner_proto;
	__u64 flags = v6 ? BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 : BPF_F_ADJ_ROOM_ENCAP_L3_IPV4;
	void *data, *data_end, *l3;
	struct ethhdr *eth;

	if (gue)
		flags |= BPF_F_ADJ_ROOM_ENCAP_L4_UDP;
	if (bpf_skb_adjust_room(skb, outer_len, BPF_ADJ_ROOM_MAC, flags))
		return hc_drop(XDPLB_HC_DROP_ENCAP);

	/* adjust_room invalidated every packet pointer: reload and re-check. */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	if (data + ETH_HLEN + outer_len > data_end)
		return hc_drop(XDPLB_HC_DROP_ENCAP);
	eth = data;
	eth->h_proto = v6 ? bpf_htons(ETH_P_IPV6) : bpf_htons(ETH_P_IP);
	l3 = data + ETH_HLEN;

	if (!v6) {
		struct iphdr *iph = l3;

		*(__be16 *)iph = bpf_htons(0x4500 | pkt->tos);
		iph->tot_len = bpf_htons(outer_len + pkt->ip_len);
		iph->id = 0;
		iph->frag_off = bpf_htons(IP_DF);
		iph->ttl = HC_OUTER_TTL;
		iph->protocol = l4_proto;
		iph->check = 0;
		iph->saddr = cfg->src4;
		iph->daddr = tgt->addr[0];
		iph->check = ipv4_hdr_csum(iph);
	} else {
		struct ipv6hdr *ip6h = l3;

		*(__be32 *)ip6h = bpf_htonl(0x60000000 | ((__u32)pkt->tos << 20));
		ip6h->payload_len = bpf_htons(gue_len + pkt->ip_len);
		ip6h->nexthdr = l4_proto;
		ip6h->hop_limit = HC_OUTER_TTL;
		__builtin_memcpy(&ip6h->saddr, cfg->src6, 16);
		__builtin_memcpy(&ip6h->daddr, tgt->addr, 16);
	}

	if (gue) {
		struct udphdr *udp = l3 + l3_len;
		struct xdplb_gue_hdr *gh = (void *)(udp + 1);
		struct xdplb_gue_priv *gp = (void *)(gh + 1);
		__u32 *hop = (void *)(gp + 1);

		udp->source = bpf_htons(0x8000 | (hash & 0x7fff));
		udp->dest = cfg->gue_port;
		udp->len = bpf_htons(gue_len + pkt->ip_len);
		udp->check = 0;
		gh->hlen_ver = 1 + hop_len / 4;
		gh->proto = inner_proto;
		gh->flags = 0;
		gp->type = 0;
		gp->next_hop = 0;
		gp->hop_count = 1;
		if (!v6)
			hop[0] = tgt->addr[0];
		else
			__builtin_memcpy(hop, tgt->addr, 16);
	}
	return hc_fib_send(skb, eth, l3, v6, outer_len + pkt->ip_len, l4_proto);
}

#endif /* XDPLB_LIB_HC_ENCAP_H */
