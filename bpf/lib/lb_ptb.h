/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Step 12's "too big" answer (XDPLB_CFG_F_PTB): an encapsulated packet that
 * exceeds the egress MTU becomes, in place, an ICMP "fragmentation needed"
 * (IPv4, inner DF set) or ICMPv6 "packet too big" from the VIP to the client,
 * carrying MTU = egress MTU - encapsulation overhead, sent back out (XDP_TX).
 * The client's stack lowers its path MTU to the VIP, so its next packets fit
 * the tunnel (RFC 1191, RFC 8201).
 *
 * Not rate limited: one answer per packet that was too big, each shorter than
 * that packet.  A slow path, out of line: one copy for every encap variant.
 *
 * Never an answer to ICMP: the only ICMP lb_xdp encapsulates are routers'
 * errors it forwards (step 4b), and no error may be sent about an error (RFC
 * 1122 3.2.2, RFC 4443 2.4(e)); those are dropped TOO_BIG.  IPv6: judged by
 * the first next header (an error behind extension headers would be answered;
 * routers do not send such errors).
 */
#ifndef XDPLB_LIB_LB_PTB_H
#define XDPLB_LIB_LB_PTB_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/parsing.h"
#include "lib/csum.h"
#include "lib/counters.h"

#define LB_PTB_HLEN4	(20 + 8)	/* IPv4 + ICMP headers */
#define LB_PTB_HLEN6	(40 + 8)	/* IPv6 + ICMPv6 headers */
/* Quotes: RFC 1812 4.3.2.3 (576 bytes in all), RFC 4443 2.4(c) (1280 bytes in all). */
#define LB_PTB_QUOTE4	(576 - LB_PTB_HLEN4)
#define LB_PTB_QUOTE6	(1280 - LB_PTB_HLEN6)
#define LB_PTB_TTL	64

/*
 * One's complement sum of n 32-bit words at p (n <= (8 + LB_PTB_QUOTE6) / 4),
 * each bounds-checked: a loop, not unrolled (up to 310 words).
 */
static __always_inline __u64 lb_ptb_sum(const __u32 *p, __u32 n, void *data_end, __u64 sum)
{
	__u32 i;

#pragma clang loop unroll(disable)
	for (i = 0; i < (8 + LB_PTB_QUOTE6) / 4; i++) {
		if (i >= n || (void *)(p + i + 1) > data_end)
			break;
		sum += p[i];
	}
	return sum;
}

/*
 * The frame is [Ethernet][outer headers: overhead bytes][original IP packet...]
 * with the original MACs.  It becomes [Ethernet, MACs swapped][IP][ICMP][the
 * original packet's first qlen bytes], qlen = min(IP length, quote) rounded
 * down to 4 bytes.  mtu is bpf_fib_lookup()'s mtu_result.
 */
static __noinline int lb_icmp_ptb(struct lb_ctx *ctx, __u32 mtu, __u32 overhead)
{
	void *data = lb_data(ctx);
	void *data_end = lb_data_end(ctx);
	__u8 *inner = data + ETH_HLEN + overhead;
	__u32 mac[3], addr[8], ip_len, qlen, hlen, i;
	__u16 *eth;
	__u64 sum;
	int v6;

	if ((void *)(inner + sizeof(struct ipv6hdr)) > data_end || overhead > 128)
		return lb_drop(XDPLB_DROP_TOO_BIG);
	mac[0] = ((__u32 *)data)[0];
	mac[1] = ((__u32 *)data)[1];
	mac[2] = ((__u32 *)data)[2];
	v6 = (inner[0] >> 4) == 6;
	if (!v6) {
		struct iphdr *iph = (void *)inner;

		/* Without DF the sender allows fragmentation; we do not fragment: drop. */
		if (!(iph->frag_off & bpf_htons(IP_DF)) || iph->protocol == IPPROTO_ICMP)
			return lb_drop(XDPLB_DROP_TOO_BIG);
		ip_len = bpf_ntohs(iph->tot_len);
		addr[0] = iph->saddr;
		addr[1] = iph->daddr;
		qlen = ip_len < LB_PTB_QUOTE4 ? ip_len : LB_PTB_QUOTE4;
		hlen = LB_PTB_HLEN4;
	} else {
		struct ipv6hdr *ip6h = (void *)inner;

		if (ip6h->nexthdr == IPPROTO_ICMPV6)
			return lb_drop(XDPLB_DROP_TOO_BIG);
		ip_len = sizeof(*ip6h) + bpf_ntohs(ip6h->payload_len);
		__builtin_memcpy(addr, &ip6h->saddr, 16);
		__builtin_memcpy(addr + 4, &ip6h->daddr, 16);
		qlen = ip_len < LB_PTB_QUOTE6 ? ip_len : LB_PTB_QUOTE6;
		hlen = LB_PTB_HLEN6;
	}
	qlen &= ~3U;
	mtu -= overhead;

	/* The new headers end where the original packet starts; the quote ends the frame. */
	if (lb_reshape(ctx, overhead, hlen, ETH_HLEN + hlen + qlen))
		return lb_drop(XDPLB_DROP_TOO_BIG);
	data = lb_data(ctx);
	data_end = lb_data_end(ctx);
	if (data + ETH_HLEN + LB_PTB_HLEN6 > data_end)
		return lb_drop(XDPLB_DROP_TOO_BIG);

	eth = data;
	/* Back where it came from: the client's side is the old source MAC. */
	eth[0] = ((__u16 *)mac)[3];
	eth[1] = ((__u16 *)mac)[4];
	eth[2] = ((__u16 *)mac)[5];
	eth[3] = ((__u16 *)mac)[0];
	eth[4] = ((__u16 *)mac)[1];
	eth[5] = ((__u16 *)mac)[2];

	if (!v6) {
		struct iphdr *iph = data + ETH_HLEN;
		__u8 *icmp = (void *)(iph + 1);

		eth[6] = bpf_htons(ETH_P_IP);
		*(__be16 *)iph = bpf_htons(0x4500);
		iph->tot_len = bpf_htons(LB_PTB_HLEN4 + qlen);
		iph->id = 0;
		iph->frag_off = 0;
		iph->ttl = LB_PTB_TTL;
		iph->protocol = IPPROTO_ICMP;
		iph->check = 0;
		iph->saddr = addr[1];
		iph->daddr = addr[0];
		iph->check = ipv4_hdr_csum(iph);
		/* Type 3 code 4, checksum, unused, next-hop MTU (RFC 1191). */
		*(__be32 *)icmp = bpf_htonl(0x03040000);
		*(__be32 *)(icmp + 4) = bpf_htonl(mtu & 0xffff);
		sum = lb_ptb_sum((const __u32 *)icmp, (8 + qlen) / 4, data_end, 0);
		*(__u16 *)(icmp + 2) = csum_fold64(sum);
	} else {
		struct ipv6hdr *ip6h = data + ETH_HLEN;
		__u8 *icmp = (void *)(ip6h + 1);

		eth[6] = bpf_htons(ETH_P_IPV6);
		*(__be32 *)ip6h = bpf_htonl(0x60000000);
		ip6h->payload_len = bpf_htons(8 + qlen);
		ip6h->nexthdr = IPPROTO_ICMPV6;
		ip6h->hop_limit = LB_PTB_TTL;
		__builtin_memcpy(&ip6h->saddr, addr + 4, 16);
		__builtin_memcpy(&ip6h->daddr, addr, 16);
		/* Type 2 code 0, checksum, MTU (RFC 4443 3.2). */
		*(__be32 *)icmp = bpf_htonl(0x02000000);
		*(__be32 *)(icmp + 4) = bpf_htonl(mtu);
		/* Pseudo header: addresses, upper-layer length, next header. */
		sum = 0;
		for (i = 0; i < 8; i++)
			sum += addr[i];
		sum += (__u64)bpf_htonl(8 + qlen) + bpf_htonl(IPPROTO_ICMPV6);
		sum = lb_ptb_sum((const __u32 *)icmp, (8 + qlen) / 4, data_end, sum);
		*(__u16 *)(icmp + 2) = csum_fold64(sum);
	}
	lb_count_event(XDPLB_EV_ICMP_PTB);
	return lb_tx(ctx);
}

#endif /* XDPLB_LIB_LB_PTB_H */
