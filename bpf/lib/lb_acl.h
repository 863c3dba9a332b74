/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Source ACLs (global and per VIP) and the per-source-prefix rate limit of
 * new flows: docs/datapath.md, steps 5a, 6a and 8a.  Both cost nothing when
 * unused: a scope without rules is never looked up (a flag in lb_config or
 * the VIP), and the rate limit is off while rl_rate is 0.
 */
#ifndef XDPLB_LIB_LB_ACL_H
#define XDPLB_LIB_LB_ACL_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "xdplb_abi.h"
#include "lib/lb_maps.h"
#include "lib/counters.h"
#include "lib/lb_parse.h"
#include "lib/lb_select.h"

/* Source prefix rules of every scope, one trie per family (xdplb_abi.h). */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPLB_ACL_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct xdplb_acl_key4);
	__type(value, struct xdplb_acl_rule);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_acl4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, XDPLB_ACL_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct xdplb_acl_key6);
	__type(value, struct xdplb_acl_rule);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_acl6 SEC(".maps");

/* (scope slot, list) -> packets: slot * XDPLB_ACL__MAX + enum xdplb_acl_list. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_ACL_HITS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_acl_hits SEC(".maps");

/*
 * Source prefix -> token bucket.  Shared by all CPUs and updated without a
 * lock: two CPUs refilling or taking from one bucket at once may lose an
 * update, so a prefix whose new flows arrive on n CPUs at once can get up to
 * n - 1 flows more than its rate (never fewer).  LRU: a full map forgets the
 * prefixes quiet the longest, which then start again with a full bucket.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, XDPLB_RATE_ENTRIES);
	__type(key, struct xdplb_addr);
	__type(value, struct xdplb_rate);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_rate SEC(".maps");

/*
 * The rule of scope for the packet's source, counted: 1 when the packet is
 * denied, 0 when it may go on.  slot indexes lb_acl_hits.
 */
static __always_inline int lb_acl_denied(const struct lb_pkt *pkt, __u32 scope, __u32 slot,
					 int default_deny)
{
	const struct xdplb_acl_rule *rule;
	__u32 list, idx;
	__u64 *cnt;

	if (pkt->family == XDPLB_FAMILY_V4) {
		struct xdplb_acl_key4 key = {
			.prefixlen = 32 + 32,
			.scope = scope,
			.addr = pkt->flow.src[0],
		};

		rule = bpf_map_lookup_elem(&lb_acl4, &key);
	} else {
		struct xdplb_acl_key6 key = {
			.prefixlen = 32 + 128,
			.scope = scope,
		};

		__builtin_memcpy(key.addr, pkt->flow.src, sizeof(key.addr));
		rule = bpf_map_lookup_elem(&lb_acl6, &key);
	}
	if (rule)
		list = rule->action == XDPLB_ACL_ALLOW ? XDPLB_ACL_ALLOW : XDPLB_ACL_DENY;
	else if (default_deny)
		list = XDPLB_ACL_DEFAULT;
	else
		return 0;	/* the common case of a deny list: not counted */
	idx = slot * XDPLB_ACL__MAX + list;
	cnt = bpf_map_lookup_elem(&lb_acl_hits, &idx);
	if (cnt)
		*cnt += 1;
	return list != XDPLB_ACL_ALLOW;
}

/*
 * Step 2a: the global ACL, for every packet to a VIP address (the port does not
 * matter).  LB_CONTINUE, or the drop verdict.  Nothing is read but cfg (lb_config[0],
 * NULL if missing: then nothing is filtered) while the global scope has no rules.
 */
static __always_inline int lb_acl_global(const struct lb_pkt *pkt,
					 const struct xdplb_config *cfg)
{
	if (!cfg || !(cfg->flags & (XDPLB_CFG_F_ACL | XDPLB_CFG_F_ACL_DENY)))
		return LB_CONTINUE;
	if (!lb_is_vip_addr(pkt))
		return LB_CONTINUE;	/* not ours: never filtered */
	if (lb_acl_denied(pkt, XDPLB_ACL_GLOBAL, 0,
			  cfg->flags & XDPLB_CFG_F_ACL_DENY))
		return lb_drop(XDPLB_DROP_ACL);
	return LB_CONTINUE;
}

/* Step 6a: the VIP's own ACL, right after the VIP lookup. */
static __always_inline int lb_acl_vip(const struct lb_pkt *pkt, const struct xdplb_vip_info *vip)
{
	__u32 vip_id = vip->vip_id;

	if (!(vip->flags & (XDPLB_VIP_F_ACL | XDPLB_VIP_F_ACL_DENY)))
		return LB_CONTINUE;
	/* Beyond the map's slots (never, as sized), the hit is not counted. */
	if (lb_acl_denied(pkt, vip_id, vip_id + 1, vip->flags & XDPLB_VIP_F_ACL_DENY))
		return lb_drop(XDPLB_DROP_ACL);
	return LB_CONTINUE;
}

/* One word of a source prefix's mask: bits is the prefix length left for it. */
static __always_inline __u32 lb_mask_word(int bits)
{
	if (bits <= 0)
		return 0;
	if (bits >= 32)
		return 0xffffffff;
	return bpf_htonl(0xffffffffU << (32 - bits));
}

/*
 * Step 8a: take one new flow from the bucket of the packet's source prefix.
 * 1 when the bucket is empty (the flow is dropped), 0 otherwise.  Only packets
 * that would be balanced by the table as a new flow come here.
 */
static __always_inline int lb_rate_limited(const struct lb_pkt *pkt,
					   const struct xdplb_config *cfg)
{
	struct xdplb_addr key = {};
	struct xdplb_rate *b, fresh;
	__u64 now, cap, rate = cfg->rl_rate, elapsed;
	int plen;

	if (!rate)
		return 0;
	plen = pkt->family == XDPLB_FAMILY_V4 ? cfg->rl_prefix4 : cfg->rl_prefix6;
	key.addr[0] = pkt->flow.src[0] & lb_mask_word(plen);
	if (pkt->family == XDPLB_FAMILY_V6) {
		key.addr[1] = pkt->flow.src[1] & lb_mask_word(plen - 32);
		key.addr[2] = pkt->flow.src[2] & lb_mask_word(plen - 64);
		key.addr[3] = pkt->flow.src[3] & lb_mask_word(plen - 96);
	}
	key.family = pkt->family;
	cap = (__u64)cfg->rl_burst * XDPLB_RATE_ONE;
	now = bpf_ktime_get_coarse_ns();

	b = bpf_map_lookup_elem(&lb_rate, &key);
	if (!b) {
		/* A prefix not seen (or forgotten): a full bucket, less this flow. */
		if (cap < XDPLB_RATE_ONE)
			return 1;
		fresh.tokens = cap - XDPLB_RATE_ONE;
		fresh.stamp = now;
		bpf_map_update_elem(&lb_rate, &key, &fresh, BPF_ANY);
		return 0;
	}
	elapsed = now > b->stamp ? now - b->stamp : 0;
	/* Full again after (cap - tokens) / rate ns: cap the product below 2^64. */
	if (elapsed >= cap / rate)
		b->tokens = cap;
	else if (b->tokens + elapsed * rate > cap)
		b->tokens = cap;
	else
		b->tokens += elapsed * rate;
	b->stamp = now;
	if (b->tokens < XDPLB_RATE_ONE)
		return 1;
	b->tokens -= XDPLB_RATE_ONE;
	return 0;
}

/*
 * Whether the packet starts a flow the rate limit counts: a TCP SYN (without
 * ACK), or anything but TCP (UDP) that missed the connection table.  The
 * caller only asks on the way to the table.
 */
static __always_inline int lb_rate_applies(const struct lb_pkt *pkt)
{
	return pkt->flow.proto != IPPROTO_TCP || lb_is_syn(pkt);
}

#endif /* XDPLB_LIB_LB_ACL_H */
