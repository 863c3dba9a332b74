/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Tunnel parsing and decapsulation for host_tc (docs/datapath.md, "host_tc").
 *
 * Parsing walks the outer headers with a pointer cursor and a bounds check
 * right before each access; it returns what to do with the packet and, for
 * a tunnel packet, how many bytes of outer headers sit between the Ethernet
 * header and the inner IP header.
 */
#ifndef XDPLB_LIB_HOST_DECAP_H
#define XDPLB_LIB_HOST_DECAP_H

#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/gue.h"
#include "lib/host_maps.h"

/*
 * bpf_skb_adjust_room() flags that set skb->protocol to the inner family on
 * decap (kernel 6.3+).  The 6.1 UAPI header we build against lacks them, and
 * newer headers define them as enum constants, which #ifndef cannot see:
 * hence our own names.
 */
#define XDPLB_ADJ_ROOM_DECAP_L3_IPV4	(1ULL << 7)
#define XDPLB_ADJ_ROOM_DECAP_L3_IPV6	(1ULL << 8)

#ifndef IP_MF
#define IP_MF		0x2000
#define IP_OFFSET	0x1fff
#endif

/* Longest header stack we read: Ethernet, IPv4 with options, UDP, GUE with
 * the largest hlen, then the inner IPv4 header with options and the base TCP
 * header that the daisy-chaining decision looks at (host_chain.h). */
#define HOST_MAX_HDR	(ETH_HLEN + 60 + sizeof(struct udphdr) + \
			 XDPLB_GUE_LEN(31) + 60 + sizeof(struct tcphdr))

enum host_verdict {
	HOST_V_PASS,		/* not a tunnel packet for us */
	HOST_V_DECAP,		/* tunnel packet, parsed: strip outer_len bytes */
	HOST_V_MALFORMED,	/* tunnel packet for us that does not parse */
};

/*
 * What parsing found.  Offsets, not pointers: the daisy-chaining code runs
 * after helper calls and re-derives its packet pointers from skb->data.
 */
struct host_tunnel {
	__u32 outer_len;	/* bytes from the end of Ethernet to the inner IP header */
	__u16 udp_off;		/* GUE only: outer UDP header, from the frame start */
	__u8 outer_family;	/* enum xdplb_family */
	__u8 inner_family;	/* enum xdplb_family */
	__u8 event;		/* XDPLB_HOST_DECAP_GUE or XDPLB_HOST_DECAP_IPIP */
	__u8 next_hop;		/* GUE only: hop index the packet was sent to */
	__u8 hop_count;		/* GUE only: hops in the list */
	__u8 gso_udp;		/* a GSO packet of inner UDP datagrams */
};

/*
 * Direct packet access only sees the linear part of the skb.  Frames built
 * by a NIC driver or by GRO may keep headers in fragments, so pull the most
 * we may parse (never more than the packet: the helper fails past skb->len).
 * The check is cheap and the pull happens only when headers are not linear.
 */
static __always_inline int host_linearize(struct __sk_buff *skb)
{
	__u32 want = skb->len < HOST_MAX_HDR ? skb->len : HOST_MAX_HDR;

	if ((long)skb->data + want <= (long)skb->data_end)
		return 0;
	return bpf_skb_pull_data(skb, want);
}

/* The inner header must be the family the outer header announced. */
static __always_inline int host_inner_ok(void *inner, void *data_end, __u8 proto)
{
	if (proto == IPPROTO_IPIP) {
		struct iphdr *ip = inner;

		if ((void *)(ip + 1) > data_end)
			return 0;
		return ip->version == 4 && ip->ihl >= 5;
	}
	if (proto == IPPROTO_IPV6) {
		struct ipv6hdr *ip6 = inner;

		if ((void *)(ip6 + 1) > data_end)
			return 0;
		return ip6->version == 6;
	}
	return 0;
}

/* GUE header at @gue; on success @inner_out points at the inner IP header. */
static __always_inline enum host_verdict
host_parse_gue(void *gue, void *data_end, struct host_tunnel *t, void **inner_out,
	       __u8 *proto_out)
{
	struct xdplb_gue_hdr *gh = gue;
	struct xdplb_gue_priv *priv;
	__u32 hlen, hop_words;
	void *inner;

	if ((void *)(gh + 1) > data_end)
		return HOST_V_MALFORMED;
	/* C = 1 is a control message: the balancer never sends one. */
	if (XDPLB_GUE_VER(gh->hlen_ver) != 0 || XDPLB_GUE_C(gh->hlen_ver))
		return HOST_V_MALFORMED;
	hlen = XDPLB_GUE_HLEN(gh->hlen_ver);
	/* The private data word (type, next hop, hop count) is mandatory. */
	if (hlen < 1)
		return HOST_V_MALFORMED;
	priv = (void *)(gh + 1);
	if ((void *)(priv + 1) > data_end)
		return HOST_V_MALFORMED;
	hop_words = t->outer_family == XDPLB_FAMILY_V4 ? XDPLB_GUE_HOP_WORDS_V4 :
							  XDPLB_GUE_HOP_WORDS_V6;
	if (1 + (__u32)priv->hop_count * hop_words > hlen)
		return HOST_V_MALFORMED;

	inner = gue + XDPLB_GUE_LEN(hlen);
	if (!host_inner_ok(inner, data_end, gh->proto))
		return HOST_V_MALFORMED;
	t->next_hop = priv->next_hop;
	t->hop_count = priv->hop_count;
	*inner_out = inner;
	*proto_out = gh->proto;
	return HOST_V_DECAP;
}

/* Everything after the outer IP header: GUE, IPIP, or not ours. */
static __always_inline enum host_verdict
host_parse_l4(void *data, void *l4, void *data_end, __u8 proto, struct host_tunnel *t,
	      void **inner_out)
{
	enum host_verdict v;
	__u8 inner_proto = proto;

	if (proto == IPPROTO_IPIP || proto == IPPROTO_IPV6) {
		if (!host_inner_ok(l4, data_end, proto))
			return HOST_V_MALFORMED;
		*inner_out = l4;
		t->event = XDPLB_HOST_DECAP_IPIP;
	} else if (proto == IPPROTO_UDP) {
		struct xdplb_host_config *cfg;
		struct udphdr *udp = l4;
		__u32 zero = 0;

		cfg = bpf_map_lookup_elem(&host_config, &zero);
		/* gue_port 0: GUE not configured on this host. */
		if (!cfg || !cfg->gue_port)
			return HOST_V_PASS;
		/* Too short to tell the port: not provably a tunnel packet. */
		if ((void *)(udp + 1) > data_end)
			return HOST_V_PASS;
		if (udp->dest != cfg->gue_port)
			return HOST_V_PASS;
		v = host_parse_gue(udp + 1, data_end, t, inner_out, &inner_proto);
		if (v != HOST_V_DECAP)
			return v;
		t->udp_off = (__u16)((void *)udp - data);
		t->event = XDPLB_HOST_DECAP_GUE;
	} else {
		return HOST_V_PASS;
	}
	t->inner_family = inner_proto == IPPROTO_IPIP ? XDPLB_FAMILY_V4 :
							XDPLB_FAMILY_V6;
	return HOST_V_DECAP;
}

/*
 * A GSO packet must hold one inner packet to be decapsulated as one: lb_tc's
 * tunnel GSO packets do, and so do GRO's merges of IPIP / 6in4 / 4in6 (GRO
 * rewrites every IP length of the stack).  A train of outer datagrams merged
 * by UDP GRO (rx-udp-gro-forwarding, rx-gro-list) does not: its inner IP
 * length covers the first datagram only, and decapsulated it would reach the
 * stack as that datagram followed by bytes the stack trims.  No GUE train
 * reached host_tc on 6.18 with either feature on (docs/operations.md), but
 * one that does is refused, counted as malformed, never delivered cut short.
 * An inner length of 0 is BIG TCP's (the skb's length is the packet's).
 */
static __always_inline int host_gso_whole(struct __sk_buff *skb, void *inner,
					  void *data_end, struct host_tunnel *t)
{
	__u32 rest = skb->len - ETH_HLEN - t->outer_len;
	__u32 len;

	if (!skb->gso_size)
		return 1;
	if (t->inner_family == XDPLB_FAMILY_V4) {
		struct iphdr *ip = inner;

		if ((void *)(ip + 1) > data_end)
			return 0;
		len = bpf_ntohs(ip->tot_len);
		t->gso_udp = ip->protocol == IPPROTO_UDP;
	} else {
		struct ipv6hdr *ip6 = inner;

		if ((void *)(ip6 + 1) > data_end)
			return 0;
		len = bpf_ntohs(ip6->payload_len);
		t->gso_udp = ip6->nexthdr == IPPROTO_UDP;
		if (len)
			len += sizeof(*ip6);
	}
	return len == 0 || len == rest;
}

static __always_inline enum host_verdict
host_parse(struct __sk_buff *skb, struct host_tunnel *t)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct xdplb_addr dst = {};
	enum host_verdict v;
	void *inner = NULL;
	void *l4;
	__u8 proto;

	if ((void *)(eth + 1) > data_end)
		return HOST_V_PASS;

	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		/* A bad outer header is the kernel's to drop, tunnel or not. */
		if ((void *)(ip + 1) > data_end)
			return HOST_V_PASS;
		if (ip->version != 4 || ip->ihl < 5)
			return HOST_V_PASS;
		dst.addr[0] = ip->daddr;
		dst.family = XDPLB_FAMILY_V4;
		if (!bpf_map_lookup_elem(&host_addrs, &dst))
			return HOST_V_PASS;
		/*
		 * The balancer sets DF, so fragments are not ours to decap: a
		 * non-first fragment has no UDP/GUE header, and stripping the
		 * outer header of a first fragment would orphan the rest.
		 */
		if (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET))
			return HOST_V_PASS;
		proto = ip->protocol;
		l4 = (void *)ip + ip->ihl * 4;
		t->outer_family = XDPLB_FAMILY_V4;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end)
			return HOST_V_PASS;
		if (ip6->version != 6)
			return HOST_V_PASS;
		__builtin_memcpy(dst.addr, &ip6->daddr, sizeof(dst.addr));
		dst.family = XDPLB_FAMILY_V6;
		if (!bpf_map_lookup_elem(&host_addrs, &dst))
			return HOST_V_PASS;
		/* Extension headers are not walked (as in lb_xdp, which adds none). */
		proto = ip6->nexthdr;
		l4 = ip6 + 1;
		t->outer_family = XDPLB_FAMILY_V6;
	} else {
		/* ARP, LLDP, and VLAN tags the driver did not strip. */
		return HOST_V_PASS;
	}

	v = host_parse_l4(data, l4, data_end, proto, t, &inner);
	if (v != HOST_V_DECAP)
		return v;
	t->outer_len = (__u32)(inner - (void *)(eth + 1));
	if (!host_gso_whole(skb, inner, data_end, t))
		return HOST_V_MALFORMED;
	return HOST_V_DECAP;
}

/*
 * Remove the outer headers, keeping the Ethernet header in front of the inner
 * packet.  The helper moves the MAC header, keeps skb->csum consistent for
 * CHECKSUM_COMPLETE, and downgrades CHECKSUM_UNNECESSARY (which vouched for
 * the outer headers only).
 */
/*
 * A GUE packet that is a GSO packet of UDP datagrams (lb_tc encapsulates a
 * sender's UDP_SEGMENT send whole) must not be decapsulated whole: the skb
 * would keep its UDP-tunnel GSO state, which no helper clears on 6.18
 * (BPF_F_ADJ_ROOM_DECAP_L4_UDP came later), and a socket without UDP_GRO,
 * which has the kernel segment what it receives, would lose every datagram
 * uncounted (the kernel segments it as a tunnel packet again).  IPIP's GSO
 * state is harmless there, and TCP never segments what it receives.
 *
 * Such a packet goes out through lo instead: lo offers no tunnel GSO, so the
 * kernel segments it there, as the tunnel packet it still is, into GUE
 * datagrams, and host_tc on lo's ingress decapsulates each.  Never on lo
 * itself: what comes back is no longer GSO, but the check keeps a loop out.
 */
#define HOST_LOOPBACK_IFINDEX	1

static __always_inline int host_segment_via_lo(const struct __sk_buff *skb,
					       const struct host_tunnel *t)
{
	return t->event == XDPLB_HOST_DECAP_GUE && t->gso_udp &&
	       skb->ifindex != HOST_LOOPBACK_IFINDEX;
}

static __always_inline int host_decap(struct __sk_buff *skb, const struct host_tunnel *t)
{
	__u64 decap = 0;
	__be16 eth_proto;

	if (t->inner_family != t->outer_family)
		decap = t->inner_family == XDPLB_FAMILY_V4 ? XDPLB_ADJ_ROOM_DECAP_L3_IPV4 :
							     XDPLB_ADJ_ROOM_DECAP_L3_IPV6;
	/*
	 * A GSO packet (lb_tc's, or one GRO merged) keeps its segment size: grown
	 * by the outer headers, it could exceed what a short last segment leaves
	 * and the kernel would drop the packet when it segments it (Calico saw
	 * this, projectcalico/calico#11252).  No-op for any other packet.
	 */
	if (bpf_skb_adjust_room(skb, -(__s32)t->outer_len, BPF_ADJ_ROOM_MAC,
				decap | BPF_F_ADJ_ROOM_FIXED_GSO))
		return -1;
	if (!decap)
		return 0;
	/*
	 * The stack dispatches on skb->protocol, which the DECAP flag set; the
	 * frame's EtherType is fixed too so that the frame is self-consistent
	 * for anything that reads the MAC header again (redirects, test_run).
	 */
	eth_proto = t->inner_family == XDPLB_FAMILY_V4 ? bpf_htons(ETH_P_IP) :
							 bpf_htons(ETH_P_IPV6);
	return bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_proto), &eth_proto,
				   sizeof(eth_proto), 0);
}

#endif /* XDPLB_LIB_HOST_DECAP_H */
