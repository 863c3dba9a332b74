/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Header cursor helpers in the style of xdp-tools' parsing_helpers.h: each
 * helper checks bounds right before it reads, advances the cursor past the
 * header it parsed and returns what comes next (or -1).
 */
#ifndef XDPLB_LIB_PARSING_H
#define XDPLB_LIB_PARSING_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdplb_abi.h"

/* Not in <linux/socket.h> for BPF targets; bpf_fib_lookup() wants these. */
#define XDPLB_AF_INET	2
#define XDPLB_AF_INET6	10

#define IP_MF		0x2000
#define IP_OFFSET	0x1fff
#define IP_DF		0x4000

struct hdr_cursor {
	void *pos;
};

/* 802.1Q / 802.1ad tag; the uapi headers do not export it. */
struct vlan_hdr {
	__be16 h_vlan_TCI;
	__be16 h_vlan_encapsulated_proto;
};

/*
 * Ethernet plus at most one 802.1Q or 802.1ad tag.  Returns the EtherType
 * (network order) of what follows, or -1 when the frame is too short.
 */
static __always_inline int parse_ethhdr(struct hdr_cursor *nh, void *data_end,
					struct ethhdr **ethhdr)
{
	struct ethhdr *eth = nh->pos;
	struct vlan_hdr *vlh;
	__be16 h_proto;

	if ((void *)(eth + 1) > data_end)
		return -1;
	*ethhdr = eth;
	nh->pos = eth + 1;
	h_proto = eth->h_proto;

	if (h_proto == bpf_htons(ETH_P_8021Q) ||
	    h_proto == bpf_htons(ETH_P_8021AD)) {
		vlh = nh->pos;
		if ((void *)(vlh + 1) > data_end)
			return -1;
		nh->pos = vlh + 1;
		h_proto = vlh->h_vlan_encapsulated_proto;
	}
	return h_proto;
}

/*
 * IPv4 header with options.  Accepts version 4, IHL >= 5, the whole header
 * in the frame and ihl*4 <= tot_len <= bytes left.  Returns the protocol,
 * or -1.  *ip_len is tot_len; the cursor ends on the L4 header.
 *
 * skb_left: 0 where the frame ends at data_end; else the bytes an skb holds
 * from the IP header on, its linear data and its pages (lb_tc, hook.h).
 */
static __always_inline int parse_iphdr(struct hdr_cursor *nh, void *data_end,
				       struct iphdr **iphdr, __u32 *ip_len, __u32 skb_left)
{
	struct iphdr *iph = nh->pos;
	__u32 hdrsize, tot_len;

	if ((void *)(iph + 1) > data_end)
		return -1;
	/* One byte holds version and IHL: read it once, not as two bitfields. */
	hdrsize = *(__u8 *)iph;
	if ((hdrsize >> 4) != 4)
		return -1;
	hdrsize = (hdrsize & 0x0f) * 4;
	if (hdrsize < sizeof(*iph))
		return -1;
	/* Variable-length header: the verifier wants the check on the sum itself. */
	if (nh->pos + hdrsize > data_end)
		return -1;
	tot_len = bpf_ntohs(iph->tot_len);
	if (tot_len < hdrsize)
		return -1;
	if (skb_left ? tot_len > skb_left : nh->pos + tot_len > data_end)
		return -1;

	*iphdr = iph;
	*ip_len = tot_len;
	nh->pos += hdrsize;
	return iph->protocol;
}

/*
 * Fixed IPv6 header; extension headers: parse_ip6_exthdrs().  Accepts
 * 40 + payload_len <= bytes left.  Returns the next header, or -1.
 * skb_left as for parse_iphdr().
 */
static __always_inline int parse_ip6hdr(struct hdr_cursor *nh, void *data_end,
					struct ipv6hdr **ip6hdr, __u32 *ip_len, __u32 skb_left)
{
	struct ipv6hdr *ip6h = nh->pos;
	__u32 len;

	if ((void *)(ip6h + 1) > data_end)
		return -1;
	if ((*(__u8 *)ip6h >> 4) != 6)
		return -1;
	len = sizeof(*ip6h) + bpf_ntohs(ip6h->payload_len);
	if (skb_left ? len > skb_left : nh->pos + len > data_end)
		return -1;

	*ip6hdr = ip6h;
	*ip_len = len;
	nh->pos = ip6h + 1;
	return ip6h->nexthdr;
}

#define IPV6_FRAG_OFFSET	0xfff8	/* fragment header: offset, in 8-byte units << 3 */
#define IPV6_FRAG_MF		0x0001	/* fragment header: more fragments */

/*
 * IPv6 extension headers after the fixed header: hop-by-hop options (0),
 * routing (43), destination options (60), each (hdr[1] + 1) * 8 bytes, and
 * fragment (44, 8 bytes), at most XDPLB_MAX_EXTHDRS of them, each inside the
 * *left bytes of IP payload that remain (decreased as the cursor moves).
 * A fragment header with an offset or MF set sets *frag and ends the walk:
 * after it comes payload, not headers (its next header is every fragment's
 * upper-layer protocol).  Returns the upper-layer protocol, or -1 when a
 * header is truncated or more than XDPLB_MAX_EXTHDRS headers come.
 */
static __always_inline int parse_ip6_exthdrs(struct hdr_cursor *nh, void *data_end,
					     int nexthdr, __u32 *left, __u8 *frag)
{
	int i;

#pragma unroll
	for (i = 0; i < XDPLB_MAX_EXTHDRS; i++) {
		__u8 *hdr = nh->pos;
		__u32 len;

		if (nexthdr != IPPROTO_HOPOPTS && nexthdr != IPPROTO_ROUTING &&
		    nexthdr != IPPROTO_DSTOPTS && nexthdr != IPPROTO_FRAGMENT)
			return nexthdr;
		if ((void *)(hdr + 8) > data_end || *left < 8)
			return -1;
		len = nexthdr == IPPROTO_FRAGMENT ? 8 : ((__u32)hdr[1] + 1) * 8;
		if (len > *left)
			return -1;
		*left -= len;
		nh->pos += len;
		if (nexthdr == IPPROTO_FRAGMENT &&
		    (*(__be16 *)(hdr + 2) & bpf_htons(IPV6_FRAG_OFFSET | IPV6_FRAG_MF))) {
			*frag = 1;
			return hdr[0];
		}
		nexthdr = hdr[0];
	}
	if (nexthdr == IPPROTO_HOPOPTS || nexthdr == IPPROTO_ROUTING ||
	    nexthdr == IPPROTO_DSTOPTS || nexthdr == IPPROTO_FRAGMENT)
		return -1;
	return nexthdr;
}

/*
 * TCP or UDP header, l4_len bytes of IP payload.  Returns 0 with both ports
 * (network order, as one word: sport in the low half on little endian) and
 * the TCP flags byte (0 for UDP), or -1 when the header is truncated: TCP
 * needs 20 bytes and 5 <= doff with doff*4 <= l4_len, UDP needs 8.
 */
static __always_inline int parse_ports(struct hdr_cursor *nh, void *data_end,
				       __u8 proto, __u32 l4_len, __u32 *ports, __u8 *tcp_flags)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *tcp = nh->pos;
		__u32 doff;

		if ((void *)(tcp + 1) > data_end || l4_len < sizeof(*tcp))
			return -1;
		doff = tcp->doff;
		if (doff < 5 || doff * 4 > l4_len)
			return -1;
		*tcp_flags = ((__u8 *)tcp)[13];	/* CWR ECE URG ACK PSH RST SYN FIN */
	} else {
		struct udphdr *udp = nh->pos;

		if ((void *)(udp + 1) > data_end || l4_len < sizeof(*udp))
			return -1;
		*tcp_flags = 0;
	}
	/* Both headers start with sport, dport: one 32-bit load. */
	*ports = *(__u32 *)nh->pos;
	return 0;
}

#endif /* XDPLB_LIB_PARSING_H */
