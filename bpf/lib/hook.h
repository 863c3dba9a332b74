/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * One balancer, two hooks (docs/datapath.md, "Two hooks"): bpf/lib's balancer
 * code takes a struct lb_ctx, which is struct xdp_md in lb_xdp and struct
 * __sk_buff in lb_tc (compiled with XDPLB_HOOK_TC).  What differs between
 * the hooks lives here and nowhere else:
 *
 * - verdicts: the code returns XDP actions in both; lb_tc's entry turns them
 *   into TC ones (lb_tc_verdict), and sends a TX or a redirect itself;
 * - growing the frame in front of the IP packet: bpf_xdp_adjust_head, or
 *   bpf_skb_adjust_room (with the tunnel flags for a GSO packet, which stays
 *   one packet until it is segmented after us; a CHECKSUM_PARTIAL packet
 *   keeps its checksum offsets either way);
 * - shrinking it, reading bytes and the frame's length (an skb may hold more
 *   than its linear part).
 */
#ifndef XDPLB_LIB_HOOK_H
#define XDPLB_LIB_HOOK_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifdef XDPLB_HOOK_TC
#define lb_ctx __sk_buff
#else
#define lb_ctx xdp_md
#endif

/*
 * The frame's first byte and its end, as the verifier wants them: a load of
 * the context field itself.  In an skb's context clang may otherwise hoist
 * the field's address out of its load ("dereference of modified ctx ptr").
 */
#ifdef XDPLB_HOOK_TC
#define LB_CTX_LOAD(ctx, field)                                                     \
	({                                                                          \
		void *__p;                                                          \
		asm volatile("%0 = *(u32 *)(%1 + %2)"                               \
			     : "=r"(__p)                                            \
			     : "r"(ctx), "i"(__builtin_offsetof(struct __sk_buff, field))); \
		__p;                                                                \
	})
#define lb_data(ctx)		LB_CTX_LOAD(ctx, data)
#define lb_data_end(ctx)	LB_CTX_LOAD(ctx, data_end)
#else
#define lb_data(ctx)		((void *)(long)(ctx)->data)
#define lb_data_end(ctx)	((void *)(long)(ctx)->data_end)
#endif

/* The frame's length in bytes: its linear data in XDP; in TC, the skb's (pages too). */
static __always_inline __u32 lb_frame_len(struct lb_ctx *ctx)
{
#ifdef XDPLB_HOOK_TC
	return ctx->len;
#else
	return ctx->data_end - ctx->data;
#endif
}

static __always_inline __u32 lb_rx_queue(struct lb_ctx *ctx)
{
#ifdef XDPLB_HOOK_TC
	return ctx->queue_mapping;
#else
	return ctx->rx_queue_index;
#endif
}

/*
 * The node's self-check (docs/cluster.md) runs a probe packet through the
 * attached program with BPF_PROG_TEST_RUN, carrying lb_config's probe_key: in
 * the skb's mark (lb_tc), in 4 bytes of XDP metadata (lb_xdp).  Nothing from the
 * wire carries either, and a zero key marks nothing.
 */
static __always_inline int lb_is_probe(struct lb_ctx *ctx, __u32 key)
{
#ifdef XDPLB_HOOK_TC
	return key && ctx->mark == key;
#else
	__u32 *meta = (void *)(long)ctx->data_meta;

	if ((void *)(meta + 1) > (void *)(long)ctx->data)
		return 0;
	return key && *meta == key;
#endif
}

static __always_inline int lb_load_bytes(struct lb_ctx *ctx, __u32 off, void *to, __u32 len)
{
#ifdef XDPLB_HOOK_TC
	return bpf_skb_load_bytes(ctx, off, to, len);
#else
	return bpf_xdp_load_bytes(ctx, off, to, len);
#endif
}

/* Back out of the device it came in on: XDP_TX (TC: a redirect to its egress). */
static __always_inline int lb_tx(struct lb_ctx *ctx)
{
#ifdef XDPLB_HOOK_TC
	bpf_redirect(ctx->ingress_ifindex, 0);
#endif
	return XDP_TX;
}

/* Out of another device. */
static __always_inline int lb_redirect(struct lb_ctx *ctx, __u32 ifindex)
{
#ifdef XDPLB_HOOK_TC
	bpf_redirect(ifindex, 0);
	return XDP_REDIRECT;
#else
	return bpf_redirect(ifindex, 0);
#endif
}

/*
 * Make room for hdr_len bytes of outer headers between the Ethernet header
 * and the IP packet at l3_off (past any VLAN tags, which go).  v6: the outer
 * family; udp: the tunnel is UDP (GUE), else IP in IP; inner_proto: the
 * packet's L4 protocol.  0 or an error.
 *
 * TC: the kernel took the outer VLAN tag off the frame already (it is in the
 * skb's metadata); it goes with bpf_skb_vlan_pop, and so do tags still in the
 * frame (QinQ's inner one; a test run's, which nothing untags).
 *
 * A GSO packet is grown with the ENCAP flags, which make it a tunnel packet:
 * its segment size shrinks by hdr_len and it is segmented, with our headers,
 * after us (it never needs a "too big" answer).  Any other packet is grown
 * plainly: a CHECKSUM_PARTIAL one keeps its checksum offsets either way (they
 * count from the skb's head), and only a packet not marked as a tunnel can
 * still become a "too big" answer (bpf_skb_change_tail refuses one that is).
 */
static __always_inline int lb_push_outer(struct lb_ctx *ctx, __u32 l3_off, __u32 hdr_len,
					 const int v6, const int udp, __u8 inner_proto)
{
#ifdef XDPLB_HOOK_TC
	__u64 flags = 0;
	int i;

	if (ctx->gso_size) {
		flags = (v6 ? BPF_F_ADJ_ROOM_ENCAP_L3_IPV6 : BPF_F_ADJ_ROOM_ENCAP_L3_IPV4) |
			(udp ? BPF_F_ADJ_ROOM_ENCAP_L4_UDP : 0);
		/*
		 * UDP GSO (UDP_SEGMENT): the segment size delimits the sender's
		 * datagrams, so the kernel grows it only FIXED: each segment
		 * leaves hdr_len longer.
		 */
		if (inner_proto == IPPROTO_UDP)
			flags |= BPF_F_ADJ_ROOM_FIXED_GSO;
	}

	/*
	 * Every tag goes: one pop takes the tag in the skb's metadata, or the
	 * frame's first (moving the next one there).  The frame then is
	 * Ethernet + IP, whatever l3_off said before.
	 */
#pragma unroll
	for (i = 0; i < 2; i++) {	/* the skb's tag, the frame's one (parse_ethhdr) */
		if (!ctx->vlan_present && ctx->protocol != bpf_htons(ETH_P_8021Q) &&
		    ctx->protocol != bpf_htons(ETH_P_8021AD))
			break;
		if (bpf_skb_vlan_pop(ctx))
			return -1;
	}
	if (ctx->vlan_present)
		return -1;
	return bpf_skb_adjust_room(ctx, hdr_len, BPF_ADJ_ROOM_MAC, flags);
#else
	return bpf_xdp_adjust_head(ctx, (int)l3_off - (int)(ETH_HLEN + hdr_len));
#endif
}

/*
 * Replace the old_len bytes after the Ethernet header with room for new_len,
 * and cut the frame to total bytes: the ICMP "too big" answer (lb_ptb.h).
 */
static __always_inline int lb_reshape(struct lb_ctx *ctx, __u32 old_len, __u32 new_len,
				      __u32 total)
{
#ifdef XDPLB_HOOK_TC
	if (new_len != old_len &&
	    bpf_skb_adjust_room(ctx, (int)new_len - (int)old_len, BPF_ADJ_ROOM_MAC, 0))
		return -1;
	if (bpf_skb_change_tail(ctx, total, 0))
		return -1;
	/* The answer's checksum is summed over its linear data: all of it. */
	return bpf_skb_pull_data(ctx, total);
#else
	void *data, *data_end;

	if (bpf_xdp_adjust_head(ctx, (int)old_len - (int)new_len))
		return -1;
	data = lb_data(ctx);
	data_end = lb_data_end(ctx);
	return bpf_xdp_adjust_tail(ctx, (int)total - (int)(data_end - data));
#endif
}

/*
 * The outer length the FIB checks against the egress MTU (bpf_fib_lookup's
 * tot_len).  TC: 0 for a GSO packet, which is segmented later; the kernel
 * then checks the skb (is_skb_forwardable) instead.
 */
static __always_inline __u32 lb_mtu_len(struct lb_ctx *ctx, __u32 len)
{
#ifdef XDPLB_HOOK_TC
	if (ctx->gso_size)
		return 0;
#endif
	return len;
}

#endif /* XDPLB_LIB_HOOK_H */
