/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Steps 4a-4c of docs/datapath.md: the packets to a VIP address whose ports
 * lb_xdp cannot read from their own header - TCP/UDP fragments and ICMP.
 *
 * - Fragments are balanced by (src, dst, proto) with the ports zero, as the
 *   Maglev paper does (section 3.3.3): every fragment of a datagram, the first
 *   included, goes to one backend, whose kernel reassembles them.  The VIP is
 *   the one lb_vip_addrs names for the protocol (the planner's choice).  Never
 *   recorded in the connection table: a flow's fragments and its whole packets
 *   may go to different backends when the table is keyed by ports.
 * - ICMP errors sent to a VIP quote the backend's reply (VIP:port -> client):
 *   reversed, the quote is the client's flow, and the error goes where that
 *   flow's packets go, so PMTU discovery works through the balancer.
 * - Echo requests are answered here when the address says so.
 */
#ifndef XDPLB_LIB_LB_ICMP_H
#define XDPLB_LIB_LB_ICMP_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/parsing.h"
#include "lib/counters.h"
#include "lib/hash.h"
#include "lib/lb_maps.h"
#include "lib/lb_parse.h"
#include "lib/lb_select.h"
#include "lib/lb_acl.h"

/* <linux/icmp.h> pulls in libc headers: the types we need, by hand. */
#define ICMP_ECHOREPLY		0
#define ICMP_DEST_UNREACH	3
#define ICMP_ECHO		8
#define ICMP_TIME_EXCEEDED	11
#define ICMPV6_DEST_UNREACH	1
#define ICMPV6_PKT_TOOBIG	2
#define ICMPV6_TIME_EXCEED	3
#define ICMPV6_ECHO_REQUEST	128
#define ICMPV6_ECHO_REPLY	129

#define LB_ICMP_HLEN	8	/* type, code, checksum, 4 bytes of rest */
#define LB_REPLY_TTL	64

/*
 * RFC 1624 eqn. 3: *sum after a 16-bit word of its data changes from old to
 * new.  All three in the same (memory) order: one's complement sums do not
 * care which.  The end-around-carry sum of data that is all zero comes out as
 * 0xffff (-0), whose complement 0x0000 receivers reject where a checksum over
 * all-zero data is 0xffff; 0xffff is right in both cases (-0 + -0 = -0), so a
 * zero result is written as 0xffff (an echo request with id, seq and payload
 * all zero is the case that meets it).
 */
static __always_inline void csum_replace16(__u16 *sum, __u16 old, __u16 new)
{
	__u32 s = (__u16)~*sum + (__u32)(__u16)~old + new;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (__u16)~s;
	*sum = s ? s : 0xffff;
}

/* 4a: the VIP a fragment belongs to, in *vipp, or a drop verdict. */
static __always_inline int lb_frag_vip(const struct lb_pkt *pkt,
				       const struct xdplb_vip_addr_info *ai,
				       const struct xdplb_config *cfg,
				       const struct xdplb_vip_info **vipp)
{
	struct xdplb_vip_key key = {};
	int udp = pkt->flow.proto == IPPROTO_UDP;

	if (!(ai->flags & (udp ? XDPLB_VIP_ADDR_F_FRAG_UDP : XDPLB_VIP_ADDR_F_FRAG_TCP)))
		return lb_drop(XDPLB_DROP_FRAGMENT);
	__builtin_memcpy(key.addr, pkt->flow.dst, sizeof(key.addr));
	key.port = udp ? ai->frag_port[1] : ai->frag_port[0];
	key.proto = pkt->flow.proto;
	key.family = pkt->family;
	*vipp = cfg ? lb_vip_find(&key, lb_vip_base(cfg), cfg->vip_index_mask) : NULL;
	if (!*vipp)
		return lb_drop(XDPLB_DROP_FRAGMENT);
	return LB_CONTINUE;
}

/*
 * 4c: answer an echo request in place: MACs and addresses swapped, TTL /
 * hop limit 64, type echo reply, checksums updated incrementally (swapping
 * the addresses changes neither the IPv4 header sum nor the ICMPv6
 * pseudo-header sum).
 */
static __always_inline int lb_icmp_echo(struct lb_ctx *ctx, const struct lb_pkt *pkt,
					struct lb_cursor *cur, __u8 *icmp)
{
	void *data = lb_data(ctx);
	void *data_end = lb_data_end(ctx);
	__u16 *eth = data;
	__u16 old, w;

	if ((void *)(eth + 6) > data_end)
		return lb_drop(XDPLB_DROP_ICMP);
	w = eth[0], eth[0] = eth[3], eth[3] = w;
	w = eth[1], eth[1] = eth[4], eth[4] = w;
	w = eth[2], eth[2] = eth[5], eth[5] = w;

	if (pkt->family == XDPLB_FAMILY_V4) {
		struct iphdr *iph = cur->l3;
		__u32 a;

		if ((void *)(iph + 1) > data_end)
			return lb_drop(XDPLB_DROP_ICMP);
		a = iph->saddr, iph->saddr = iph->daddr, iph->daddr = a;
		old = *(__u16 *)&iph->ttl;	/* TTL and protocol: one checksum word */
		iph->ttl = LB_REPLY_TTL;
		csum_replace16(&iph->check, old, *(__u16 *)&iph->ttl);
		old = *(__u16 *)icmp;		/* type and code */
		icmp[0] = ICMP_ECHOREPLY;
	} else {
		struct ipv6hdr *ip6h = cur->l3;
		struct in6_addr a;

		if ((void *)(ip6h + 1) > data_end)
			return lb_drop(XDPLB_DROP_ICMP);
		a = ip6h->saddr, ip6h->saddr = ip6h->daddr, ip6h->daddr = a;
		ip6h->hop_limit = LB_REPLY_TTL;
		old = *(__u16 *)icmp;
		icmp[0] = ICMPV6_ECHO_REPLY;
	}
	csum_replace16((__u16 *)(icmp + 2), old, *(__u16 *)icmp);
	lb_count_event(XDPLB_EV_ICMP_ECHO);
	return lb_tx(ctx);
}

/*
 * 4b: the quote of an ICMP error (its IP header + at least the ports) must be
 * a TCP/UDP packet from this very VIP address (not a later fragment, IPv6:
 * TCP/UDP right after the fixed header); reversed, it becomes pkt->flow - the
 * client's flow.  Returns LB_CONTINUE, or a drop verdict.
 */
static __always_inline int lb_icmp_quote(struct lb_ctx *ctx, struct lb_pkt *pkt, __u8 *icmp)
{
	void *data_end = lb_data_end(ctx);
	__u8 *q = icmp + LB_ICMP_HLEN;
	__u32 left = pkt->l4_len - LB_ICMP_HLEN;	/* l4_len >= 8: checked */
	__u16 *ports;
	__u8 proto;

	if (pkt->family == XDPLB_FAMILY_V4) {
		struct iphdr *qip = (void *)q;
		__u32 hl;

		if ((void *)(qip + 1) > data_end || left < sizeof(*qip))
			return lb_drop(XDPLB_DROP_ICMP);
		hl = *q;
		if ((hl >> 4) != 4)
			return lb_drop(XDPLB_DROP_ICMP);
		hl = (hl & 0x0f) * 4;
		proto = qip->protocol;
		if (hl < sizeof(*qip) || left < hl + 4 ||
		    (qip->frag_off & bpf_htons(IP_OFFSET)) ||
		    (proto != IPPROTO_TCP && proto != IPPROTO_UDP) ||
		    qip->saddr != pkt->flow.dst[0])
			return lb_drop(XDPLB_DROP_ICMP);
		ports = (void *)(q + hl);
		if ((void *)(ports + 2) > data_end)
			return lb_drop(XDPLB_DROP_ICMP);
		pkt->flow.src[0] = qip->daddr;
	} else {
		struct ipv6hdr *qip6 = (void *)q;
		const __u32 *qs;

		if ((void *)(qip6 + 1) + 4 > data_end || left < sizeof(*qip6) + 4)
			return lb_drop(XDPLB_DROP_ICMP);
		proto = qip6->nexthdr;
		qs = (const __u32 *)&qip6->saddr;
		if ((*q >> 4) != 6 || (proto != IPPROTO_TCP && proto != IPPROTO_UDP) ||
		    qs[0] != pkt->flow.dst[0] || qs[1] != pkt->flow.dst[1] ||
		    qs[2] != pkt->flow.dst[2] || qs[3] != pkt->flow.dst[3])
			return lb_drop(XDPLB_DROP_ICMP);
		ports = (void *)(qip6 + 1);
		__builtin_memcpy(pkt->flow.src, &qip6->daddr, 16);
	}
	/* The quote is VIP:port -> client:port; the flow is client -> VIP. */
	pkt->flow.sport = ports[1];
	pkt->flow.dport = ports[0];
	pkt->flow.proto = proto;
	return LB_CONTINUE;
}

/*
 * Steps 4a-4c for a packet lb_parse_l4() called LB_SLOW.  Returns a verdict,
 * or LB_CONTINUE with *vipp and tgt filled in: encapsulate it.  cfg is
 * lb_config[0], NULL if missing.
 */
static __always_inline int lb_icmp_frag(struct lb_ctx *ctx, struct lb_pkt *pkt,
					struct lb_cursor *cur,
					const struct xdplb_config *cfg, __u32 now,
					const struct xdplb_vip_info **vipp,
					struct lb_target *tgt)
{
	void *data_end = lb_data_end(ctx);
	const struct xdplb_vip_addr_info *ai;
	struct xdplb_addr key = {};
	__u8 *icmp = cur->l4;
	struct xdplb_conn_set *cs;
	struct lb_sess *ss;
	__u32 shash, set;
	enum xdplb_event ev;
	int rc;

	__builtin_memcpy(key.addr, pkt->flow.dst, sizeof(key.addr));
	key.family = pkt->family;
	ai = bpf_map_lookup_elem(&lb_vip_addrs, &key);
	if (!ai)
		return lb_pass(XDPLB_EV_PASS_NOT_VIP);

	if (pkt->frag) {
		rc = lb_frag_vip(pkt, ai, cfg, vipp);
		/* 6a: the VIP's ACL holds for its fragments (not for routers' ICMP errors) */
		if (rc == LB_CONTINUE)
			rc = lb_acl_vip(pkt, *vipp);
		ev = XDPLB_EV_FRAGMENT;
	} else {
		if ((void *)(icmp + LB_ICMP_HLEN) > data_end || pkt->l4_len < LB_ICMP_HLEN)
			return lb_drop(XDPLB_DROP_ICMP);
		if (pkt->family == XDPLB_FAMILY_V4) {
			if (icmp[0] == ICMP_ECHO && (ai->flags & XDPLB_VIP_ADDR_F_ECHO))
				return lb_icmp_echo(ctx, pkt, cur, icmp);
			if (icmp[0] != ICMP_DEST_UNREACH && icmp[0] != ICMP_TIME_EXCEEDED)
				return lb_pass(XDPLB_EV_PASS_NOT_VIP);
		} else {
			/* Answered only without extension headers (a routing header...). */
			if (icmp[0] == ICMPV6_ECHO_REQUEST && (ai->flags & XDPLB_VIP_ADDR_F_ECHO) &&
			    pkt->l4_len == pkt->ip_len - sizeof(struct ipv6hdr))
				return lb_icmp_echo(ctx, pkt, cur, icmp);
			if (icmp[0] != ICMPV6_DEST_UNREACH && icmp[0] != ICMPV6_PKT_TOOBIG &&
			    icmp[0] != ICMPV6_TIME_EXCEED)
				return lb_pass(XDPLB_EV_PASS_NOT_VIP);
		}
		rc = lb_icmp_quote(ctx, pkt, icmp);
		if (rc != LB_CONTINUE)
			return rc;
		*vipp = lb_vip_lookup(pkt, cfg);
		if (!*vipp)
			return lb_drop(XDPLB_DROP_ICMP);
		ev = XDPLB_EV_ICMP_ERROR;
	}
	if (rc != LB_CONTINUE)
		return rc;

	if (!cfg)
		return lb_drop(XDPLB_DROP_NO_CONFIG);
	/* The flow's own packets: connection table, then the VIP's table; nothing recorded. */
	shash = xdplb_sess_hash((const __u32 *)&pkt->flow, cfg->sess_key);
	set = shash & cfg->conn_mask;
	cs = ev == XDPLB_EV_FRAGMENT ? NULL : bpf_map_lookup_elem(&lb_conns, &set);
	ss = lb_sess_slot();
	if (!ss || !lb_conn_lookup(pkt, *vipp, cfg, cs, set, shash, now, 0, 0, ss, tgt)) {
		rc = lb_table_pick(pkt, *vipp, cfg, tgt);
		if (rc >= 0)
			return rc;
	}
	lb_count_event(ev);
	return LB_CONTINUE;
}

#endif /* XDPLB_LIB_LB_ICMP_H */
