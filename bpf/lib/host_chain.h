/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Daisy chaining on a backend host (docs/datapath.md, "host_tc"): the
 * "second chance" of glb-director's redirect module, as Beamer and Unimog
 * use it.
 *
 * When a balancer's table moves a bucket, it sends the bucket's packets to
 * the new owner (first hop) with the previous owners (up to XDPLB_MAX_HOPS - 1,
 * most recent first) as later hops in the GUE hop list.  New connections start
 * at the first hop; a packet of a connection that a hop does not know belongs
 * to a later hop, so each hop in turn passes it on until its owner (or the
 * last hop, as last resort) takes it.  So, before a GUE
 * packet is decapsulated, host_chain_decide() asks this host's TCP stack
 * whether it owns the inner 4-tuple, and when nobody here does,
 * host_chain_forward() sends the packet on with only the outer addresses and
 * the next hop index changed.
 */
#ifndef XDPLB_LIB_HOST_CHAIN_H
#define XDPLB_LIB_HOST_CHAIN_H

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
#include "lib/csum.h"
#include "lib/gue.h"
#include "lib/host_decap.h"
#include "lib/host_maps.h"

/* AF_* for bpf_fib_lookup(): <linux/socket.h> does not give them to BPF. */
#define HOST_AF_INET	2
#define HOST_AF_INET6	10

/* host_sk_owner(): no local socket owns the tuple. */
#define HOST_NOT_OWNED	XDPLB_HOST_EV__MAX

/* Bytes from the start of the outer UDP header to hop[0]. */
#define HOST_HOPS_OFF	(sizeof(struct udphdr) + sizeof(struct xdplb_gue_hdr) + \
			 sizeof(struct xdplb_gue_priv))

/*
 * Does a local socket own the inner 4-tuple?  Any socket that is not a
 * listener does: established, time-wait (its peer may still retransmit a
 * FIN), or a request socket (handshake in progress).  A listener owns only
 * the ACK that completes a handshake it answered with a SYN cookie: that
 * connection exists nowhere but in the cookie.  Returns the ACCEPT_* event,
 * or HOST_NOT_OWNED.
 *
 * bpf_skc_lookup_tcp() and bpf_tcp_check_syncookie() do not touch the packet,
 * so @iph and @th stay valid across them.
 */
static __always_inline __u32 host_sk_owner(struct __sk_buff *skb, struct bpf_sock_tuple *tuple,
					   __u32 tuple_len, void *iph, __u32 iph_len,
					   struct tcphdr *th)
{
	struct bpf_sock *sk;
	__u32 ev = HOST_NOT_OWNED;

	sk = bpf_skc_lookup_tcp(skb, tuple, tuple_len, BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return HOST_NOT_OWNED;
	if (sk->state != BPF_TCP_LISTEN)
		ev = XDPLB_HOST_ACCEPT_OWNED;
	else if (th->ack && !th->rst &&
		 bpf_tcp_check_syncookie(sk, iph, iph_len, th, sizeof(*th)) == 0)
		ev = XDPLB_HOST_ACCEPT_SYNCOOKIE;
	bpf_sk_release(sk);
	return ev;
}

/*
 * The hop after this one, unless there is none (ACCEPT_LAST_RESORT) or it is
 * one of our own addresses (ACCEPT_LOOP: forwarding would bring the packet
 * straight back, so this host is the last resort).
 */
static __always_inline __u32 host_next_hop(struct __sk_buff *skb, const struct host_tunnel *t,
					   struct xdplb_addr *hop)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 idx = (__u32)t->next_hop + 1;
	__u32 off = t->udp_off;
	void *addr;

	if (idx >= t->hop_count)
		return XDPLB_HOST_ACCEPT_LAST_RESORT;
	/* Bounds the verifier can see (parsing put UDP right after the outer IP header). */
	if (off > ETH_HLEN + 60 || idx > 255)
		return XDPLB_HOST_ACCEPT_LAST_RESORT;
	addr = data + off + HOST_HOPS_OFF;
	hop->family = t->outer_family;
	if (t->outer_family == XDPLB_FAMILY_V4) {
		addr += idx * 4;
		/* Parsing checked that hlen covers hop_count hops: cannot fail. */
		if (addr + 4 > data_end)
			return XDPLB_HOST_ACCEPT_LAST_RESORT;
		hop->addr[0] = *(__u32 *)addr;
	} else {
		addr += idx * 16;
		if (addr + 16 > data_end)
			return XDPLB_HOST_ACCEPT_LAST_RESORT;
		__builtin_memcpy(hop->addr, addr, 16);
	}
	if (bpf_map_lookup_elem(&host_addrs, hop))
		return XDPLB_HOST_ACCEPT_LOOP;
	return XDPLB_HOST_FORWARD;
}

/*
 * What to do with a parsed GUE packet, before decapsulation: an ACCEPT_*
 * event (decapsulate and deliver here), or XDPLB_HOST_FORWARD with @hop set.
 *
 * Only TCP is chained.  A SYN starts a new connection, which belongs to the
 * first hop by definition.  Anything else that is not a whole TCP header
 * (UDP, ICMP, an inner fragment, an inner IPv6 extension header) has no
 * 4-tuple to ask about, so the first hop takes it, as before chaining.
 */
static __always_inline __u32 host_chain_decide(struct __sk_buff *skb, const struct host_tunnel *t,
					       struct xdplb_addr *hop)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct bpf_sock_tuple tuple = {};
	__u32 off = t->outer_len;
	struct tcphdr *th;
	void *inner;
	__u32 ev;

	if (off > HOST_MAX_HDR)
		return XDPLB_HOST_ACCEPT_NOT_TCP;
	inner = data + ETH_HLEN + off;

	if (t->inner_family == XDPLB_FAMILY_V4) {
		struct iphdr *ip = inner;

		if ((void *)(ip + 1) > data_end)
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		if (ip->protocol != IPPROTO_TCP || (ip->frag_off & bpf_htons(IP_MF | IP_OFFSET)))
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		th = inner + ip->ihl * 4;
		if ((void *)(th + 1) > data_end)
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		if (th->syn && !th->ack)
			return XDPLB_HOST_ACCEPT_SYN;
		tuple.ipv4.saddr = ip->saddr;
		tuple.ipv4.daddr = ip->daddr;
		tuple.ipv4.sport = th->source;
		tuple.ipv4.dport = th->dest;
		ev = host_sk_owner(skb, &tuple, sizeof(tuple.ipv4), ip, sizeof(*ip), th);
	} else {
		struct ipv6hdr *ip6 = inner;

		if ((void *)(ip6 + 1) > data_end)
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		if (ip6->nexthdr != IPPROTO_TCP)
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		th = (void *)(ip6 + 1);
		if ((void *)(th + 1) > data_end)
			return XDPLB_HOST_ACCEPT_NOT_TCP;
		if (th->syn && !th->ack)
			return XDPLB_HOST_ACCEPT_SYN;
		__builtin_memcpy(tuple.ipv6.saddr, &ip6->saddr, sizeof(tuple.ipv6.saddr));
		__builtin_memcpy(tuple.ipv6.daddr, &ip6->daddr, sizeof(tuple.ipv6.daddr));
		tuple.ipv6.sport = th->source;
		tuple.ipv6.dport = th->dest;
		ev = host_sk_owner(skb, &tuple, sizeof(tuple.ipv6), ip6, sizeof(*ip6), th);
	}
	if (ev != HOST_NOT_OWNED)
		return ev;
	return host_next_hop(skb, t, hop);
}

/* One's complement sum of ~old + new over n 32-bit words (RFC 1624), unfolded. */
static __always_inline __u64 host_csum_delta(const __u32 *old, const __u32 *new, int n)
{
	__u64 sum = 0;
	int i;

#pragma unroll
	for (i = 0; i < n; i++)
		sum += (__u32)~old[i] + (__u64)new[i];
	return sum;
}

/* Fold a 64-bit one's complement sum to 32 bits, uncomplemented (a __wsum). */
static __always_inline __u32 host_wsum(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	return (__u32)sum;
}

/*
 * Send the packet to @hop as this host: outer source = the address it came
 * to, outer destination = @hop, next hop index + 1, IPv4 header checksum
 * updated, UDP checksum 0 (the balancer sends 0 and a non-zero one would be
 * stale now; RFC 6935 allows 0 for a tunnel over IPv6 too).  Returns the
 * bpf_redirect() verdict, or -1 with the packet untouched when there is no
 * usable route (the caller then takes the packet locally).
 *
 * The lookup is a plain one (flags 0, as lb_xdp's) from the ingress device:
 * policy routing sees where the packet came from, and the MTU is checked.
 * bpf_fib_lookup() refuses (FWD_DISABLED) unless the ingress device has IP
 * forwarding on, whatever the flags - BPF_FIB_LOOKUP_OUTPUT would only add
 * the constraint that the egress device be the ingress one.  So a host that
 * chains needs net.ipv4.conf.<dev>.forwarding and net.ipv6.conf.<dev>.forwarding
 * set; without them every forward is FORWARD_FAILED.
 */
static __always_inline int host_chain_forward(struct __sk_buff *skb, const struct host_tunnel *t,
					      const struct xdplb_addr *hop)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct bpf_fib_lookup fib = {};
	struct ethhdr *eth = data;
	struct xdplb_gue_priv *priv;
	__u32 old[10], new[10];
	struct udphdr *udp;
	__u32 off = t->udp_off;
	__u64 delta;
	int rc;

	if (off > ETH_HLEN + 60)
		return -1;
	udp = data + off;
	priv = (void *)(udp + 1) + sizeof(struct xdplb_gue_hdr);
	if ((void *)(priv + 1) > data_end)
		return -1;

	fib.l4_protocol = IPPROTO_UDP;
	fib.sport = udp->source;
	fib.dport = udp->dest;
	fib.ifindex = skb->ifindex;
	if (t->outer_family == XDPLB_FAMILY_V4) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end)
			return -1;
		fib.family = HOST_AF_INET;
		fib.tos = ip->tos;
		fib.tot_len = bpf_ntohs(ip->tot_len);
		fib.ipv4_src = ip->daddr;
		fib.ipv4_dst = hop->addr[0];
		/* bpf_fib_lookup() leaves the packet alone: ip, udp, priv stay valid. */
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
			return -1;
		/* Words 2-4: TTL/protocol/checksum, source, destination. */
		__builtin_memcpy(old, (__u32 *)ip + 2, 12);
		ip->saddr = ip->daddr;
		ip->daddr = hop->addr[0];
		/* RFC 1624 eqn. 3 on the two address words; native order throughout. */
		ip->check = csum_fold64((__u16)~ip->check + host_csum_delta(old + 1,
									  (__u32 *)ip + 3, 2));
		__builtin_memcpy(new, (__u32 *)ip + 2, 12);
		delta = host_csum_delta(old, new, 3);
	} else {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		fib.family = HOST_AF_INET6;
		fib.flowinfo = *(__be32 *)ip6 & bpf_htonl(0x0fffffff);
		fib.tot_len = sizeof(*ip6) + bpf_ntohs(ip6->payload_len);
		__builtin_memcpy(fib.ipv6_src, &ip6->daddr, 16);
		__builtin_memcpy(fib.ipv6_dst, hop->addr, 16);
		rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
			return -1;
		/* Source and destination: eight words. */
		__builtin_memcpy(old, &ip6->saddr, 32);
		__builtin_memcpy(&ip6->saddr, &ip6->daddr, 16);
		__builtin_memcpy(&ip6->daddr, hop->addr, 16);
		__builtin_memcpy(new, &ip6->saddr, 32);
		delta = host_csum_delta(old, new, 8);
	}

	/* UDP length/checksum word and the GUE private word: both 4-byte aligned
	 * from the network header, which is what skb->csum sums from. */
	old[0] = *((__u32 *)udp + 1);
	old[1] = *(__u32 *)priv;
	udp->check = 0;
	priv->next_hop = t->next_hop + 1;
	new[0] = *((__u32 *)udp + 1);
	new[1] = *(__u32 *)priv;
	delta += host_csum_delta(old, new, 2);
	/*
	 * With CHECKSUM_COMPLETE, skb->csum is the driver's sum of what follows
	 * the MAC header: keep it true for whoever receives the skb next (a veth
	 * peer verifies with it).  A no-op for other checksum states.
	 */
	bpf_csum_update(skb, host_wsum(delta));

	/*
	 * No neighbour yet: let the kernel resolve it and fill in the MACs
	 * (bpf_redirect_neigh) rather than reset a connection another host owns.
	 */
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return bpf_redirect_neigh(fib.ifindex, NULL, 0, 0);
	__builtin_memcpy(eth->h_dest, fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib.smac, ETH_ALEN);
	return bpf_redirect(fib.ifindex, 0);
}

#endif /* XDPLB_LIB_HOST_CHAIN_H */
