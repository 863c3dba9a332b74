/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Steps 6, 8 and 9 of docs/datapath.md: which VIP, then which backend -
 * from the connection table, or by hashing into the VIP's lookup table.
 */
#ifndef XDPLB_LIB_LB_SELECT_H
#define XDPLB_LIB_LB_SELECT_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hash.h"
#include "lib/lb_maps.h"
#include "lib/counters.h"
#include "lib/lb_parse.h"
#include "lib/lb_conns.h"

/*
 * Bounded connection-table writes (docs/design.md §1, "bounded writes under a
 * new-connection flood", as Katran does): past cfg->flood_max new flows in one
 * XDPLB_FLOOD_WINDOW_NS on a CPU, new flows are still balanced by the table
 * but not recorded.  An insert evicts a cold entry and costs a cache miss or
 * two; a flood would spend that (and the table) on flows that never come back.
 */
struct lb_flood {
	__u64 start;		/* ktime of the window's start */
	__u64 count;		/* new flows seen in it */
};

/* Per-CPU flood window; BPF-internal, not pinned (it is a rate, not state). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lb_flood);
} lb_flood SEC(".maps");

/*
 * Count a new flow; true when this CPU is over its budget (max per window,
 * 0: no limit) for the window.  The clock is read only when the budget is used
 * up (or the window is fresh, count 0: at load, or zeroed by user space): a
 * window ends at its first new flow past the budget that comes
 * XDPLB_FLOOD_WINDOW_NS or more after its start.  So a flood is only declared
 * after more than max new flows within the window, at most max are recorded
 * per window, and the common case (no flood) costs no helper call.
 */
static __always_inline int lb_under_flood(__u32 max)
{
	__u32 zero = 0;
	struct lb_flood *fl;
	__u64 now;

	if (!max)
		return 0;
	fl = bpf_map_lookup_elem(&lb_flood, &zero);
	if (!fl)
		return 0;
	if (!fl->count)
		fl->start = bpf_ktime_get_coarse_ns();
	if (++fl->count <= max)
		return 0;
	now = bpf_ktime_get_coarse_ns();
	if (now - fl->start >= XDPLB_FLOOD_WINDOW_NS) {
		fl->start = now;
		fl->count = 1;
		return 0;
	}
	return 1;
}

#define LB_TCP_SYN	0x02
#define LB_TCP_ACK	0x10

/*
 * The outcome of selection: who gets the packet, and the flow's hash.  A
 * Beamer bucket adds its usable later hops: next[0 .. nhops - 2], packed
 * (every one non-NULL), in the bucket's order.  nhops 0 counts as 1.
 */
struct lb_target {
	const struct xdplb_backend *be;
	const struct xdplb_backend *next[XDPLB_MAX_HOPS - 1];
	__u32 next_id[XDPLB_MAX_HOPS - 1];	/* their ids, for the session */
	__u32 nhops;
	__u32 be_id;
	__u32 hash;
};

/*
 * A VIP key's slot in lb_vip_index, or -1: open addressing, linear probing in
 * the live table (base: its first slot).
 */
static __always_inline int lb_vip_slot(const struct xdplb_vip_key *key, __u32 base, __u32 mask)
{
	const __u32 *k = (const __u32 *)key;
	const struct xdplb_vip_slot *slot;
	__u32 h, i, idx;

	if (!key)
		return -1;
	h = xdplb_vip_slot_hash(key->addr, k[4]);
	for (i = 0; i < XDPLB_VIP_PROBES; i++) {
		idx = base + ((h + i) & mask);
		slot = bpf_map_lookup_elem(&lb_vip_index, &idx);
		if (!slot || !slot->key.family)
			return -1;
		if (!((slot->key.addr[0] ^ k[0]) | (slot->key.addr[1] ^ k[1]) |
		      (slot->key.addr[2] ^ k[2]) | (slot->key.addr[3] ^ k[3]) |
		      (*(const __u32 *)&slot->key.port ^ k[4])))
			return idx;
	}
	return -1;
}

static __always_inline const struct xdplb_vip_info *
lb_vip_find(const struct xdplb_vip_key *key, __u32 base, __u32 mask)
{
	const struct xdplb_vip_slot *slot;
	int idx = lb_vip_slot(key, base, mask);
	__u32 i;

	if (idx < 0)
		return NULL;
	i = idx;
	slot = bpf_map_lookup_elem(&lb_vip_index, &i);
	return slot ? &slot->info : NULL;
}

/* The first slot of lb_vip_index's live table. */
static __always_inline __u32 lb_vip_base(const struct xdplb_config *cfg)
{
	__u32 zero = 0;
	const __u32 *sel = bpf_map_lookup_elem(&lb_vip_sel, &zero);

	return sel && (*sel & 1) ? cfg->vip_index_mask + 1 : 0;
}

/* Step 6: the exact (dst, dport, proto) entry, else the port-0 wildcard. */
static __always_inline const struct xdplb_vip_info *
lb_vip_lookup(const struct lb_pkt *pkt, const struct xdplb_config *cfg)
{
	struct xdplb_vip_key key = {};
	const struct xdplb_vip_info *vip;
	__u32 base;

	if (!cfg)
		return NULL;
	base = lb_vip_base(cfg);
	__builtin_memcpy(key.addr, pkt->flow.dst, sizeof(key.addr));
	key.port = pkt->flow.dport;
	key.proto = pkt->flow.proto;
	key.family = pkt->family;
	vip = lb_vip_find(&key, base, cfg->vip_index_mask);
	if (vip)
		return vip;
	key.port = 0;
	return lb_vip_find(&key, base, cfg->vip_index_mask);
}

_Static_assert(sizeof(struct xdplb_vip_key) == 20, "four address words, then port, proto, family");

/* An active backend, or NULL.  Id 0 is "none" even if slot 0 were filled. */
static __always_inline const struct xdplb_backend *lb_backend(__u32 id)
{
	const struct xdplb_backend *be;

	if (!id)
		return NULL;
	be = bpf_map_lookup_elem(&lb_backends, &id);
	if (!be || !(be->flags & XDPLB_BACKEND_F_ACTIVE))
		return NULL;
	return be;
}

/* A TCP SYN without ACK: the first packet of a connection. */
static __always_inline int lb_is_syn(const struct lb_pkt *pkt)
{
	return pkt->flow.proto == IPPROTO_TCP &&
	       (pkt->tcp_flags & (LB_TCP_SYN | LB_TCP_ACK)) == LB_TCP_SYN;
}

/*
 * A later hop of a Beamer bucket rides along when it is an active backend of
 * the first hop's family (a hop list holds addresses of one family only).
 */
static __always_inline const struct xdplb_backend *lb_later_hop(__u32 id, __u8 family)
{
	const struct xdplb_backend *be = lb_backend(id);

	if (be && be->family == family)
		return be;
	return NULL;
}

/*
 * The later hops of a bucket or a session, packed: each rides along when it is
 * an active backend of the first hop's family (a hop list holds addresses of
 * one family only).  Constant indexes only: the verifier does not allow
 * pointers spilled at a variable offset.
 */
static __always_inline void lb_pack_hops(struct lb_target *tgt, __u32 a, __u32 b, __u32 c)
{
	__u8 family = tgt->be->family;

	/*
	 * Ids first, as scalars, then their slots: clang folds selects between
	 * pointers into bitwise operations the verifier refuses on pointers.
	 */
	if (!lb_later_hop(a, family))
		a = 0;
	if (!lb_later_hop(b, family))
		b = 0;
	if (!lb_later_hop(c, family))
		c = 0;
	if (!b) {
		b = c;
		c = 0;
	}
	if (!a) {
		a = b;
		b = c;
		c = 0;
	}
	tgt->next_id[0] = a;
	tgt->next_id[1] = b;
	tgt->next_id[2] = c;
	tgt->next[0] = lb_later_hop(a, family);
	tgt->next[1] = lb_later_hop(b, family);
	tgt->next[2] = lb_later_hop(c, family);
	tgt->nhops = c ? 4 : b ? 3 : a ? 2 : 1;
}

/* The state of backend be_id in VIP vip_id's lb_members (XDPLB_MEMBER_NONE if none). */
static __always_inline __u32 lb_member_state(__u32 vip_id, __u32 be_id)
{
	__u32 idx = be_id / XDPLB_MEMBERS_PER_WORD;
	const __u64 *word;
	void *members;

	members = bpf_map_lookup_elem(&lb_members, &vip_id);
	if (!members)
		return XDPLB_MEMBER_NONE;
	word = bpf_map_lookup_elem(members, &idx);
	if (!word)
		return XDPLB_MEMBER_NONE;
	return (*word >> (2 * (be_id % XDPLB_MEMBERS_PER_WORD))) & 3;
}

#define LB_TCP_FIN	0x01
#define LB_TCP_RST	0x04

/*
 * Step 8: the flow's session in set cs (index set), if it is live.  Returns 1
 * with tgt filled in (the session's backend, later hops and hash), 0 otherwise,
 * each miss counted by its reason; ss keeps where step 9 would record the
 * flow.  Live: the same generation, not idle past its state's timeout, its
 * backend's slot still given to the same address (xdplb_backend.gen), and for
 * UDP its backend ACTIVE or DRAINING in this VIP.  A TCP session outlives its
 * backend's leaving the VIP: established connections keep going where they
 * started.  syn: the packet starts a connection, which follows the table
 * whatever an old session says; the set is read only for step 9's sake.
 * touch (the flow's own packets, not an ICMP error quoting it): refresh
 * last_seen and follow the TCP state.
 */
static __always_inline int lb_conn_lookup(const struct lb_pkt *pkt,
					  const struct xdplb_vip_info *vip,
					  const struct xdplb_config *cfg, struct xdplb_conn_set *cs,
					  __u32 set, __u32 shash, __u32 now, int syn, int touch,
					  struct lb_sess *ss, struct lb_target *tgt)
{
	const struct xdplb_backend *be;
	__u32 be_id;
	__u8 st;
	int rc;

	ss->way = LB_NO_WAY;
	ss->now = now;
	ss->seq = ~0ULL;	/* odd: no claim until a read succeeds */
	if (!cs)
		return 0;
	rc = lb_sess_find(cs, &pkt->flow, shash, cfg, now, ss);
	if (syn)
		return 0;	/* read for step 9 only: a SYN follows the table */
	switch (rc) {
	case LB_SESS_HIT:
		break;
	case LB_SESS_GEN:
		lb_count_event(XDPLB_EV_CONN_GEN_MISS);
		return 0;
	case LB_SESS_EXPIRED:
		lb_count_event(XDPLB_EV_CONN_EXPIRED);
		return 0;
	case LB_SESS_BUSY:
		lb_count_event(XDPLB_EV_CONN_BUSY);
		return 0;
	default:
		return 0;
	}
	be_id = ss->hop[0];
	be = be_id ? bpf_map_lookup_elem(&lb_backends, &be_id) : NULL;
	if (!be || !be->family || be->gen != ss->be_gen ||
	    (pkt->flow.proto != IPPROTO_TCP &&
	     lb_member_state(vip->vip_id, be_id) - XDPLB_MEMBER_ACTIVE > 1)) {
		/* The insert of step 9 then replaces the session. */
		lb_count_event(XDPLB_EV_CONN_STALE);
		return 0;
	}
	tgt->be = be;
	tgt->be_id = be_id;
	tgt->hash = ss->hash;
	if (ss->hop[1] | ss->hop[2] | ss->hop[3])
		lb_pack_hops(tgt, ss->hop[1], ss->hop[2], ss->hop[3]);
	if (touch) {
		lb_sess_touch(cs, ss, now);
		st = ss->state;
		if (pkt->flow.proto == IPPROTO_TCP) {
			if (pkt->tcp_flags & (LB_TCP_FIN | LB_TCP_RST))
				st = XDPLB_SESS_TCP_FIN;
			else if (st == XDPLB_SESS_TCP_SYN)
				st = XDPLB_SESS_TCP_EST;
		}
		if (st != ss->state)
			lb_sess_set_state(cs, ss, st, now, cfg, set);
	}
	lb_count_event(XDPLB_EV_CONN_HIT);
	return 1;
}

/*
 * Step 9's hash: the flow hash (jhash of the key), or with XDPLB_VIP_F_SRC_HASH
 * of a key with everything but src zero.
 */
static __always_inline __u32 lb_flow_hash(const struct lb_pkt *pkt,
					  const struct xdplb_vip_info *vip, __u32 seed)
{
	struct xdplb_flow_key src_only = {};

	if (!(vip->flags & XDPLB_VIP_F_SRC_HASH))
		return xdplb_flow_hash((const __u32 *)&pkt->flow, seed);
	__builtin_memcpy(src_only.src, pkt->flow.src, sizeof(src_only.src));
	return xdplb_flow_hash((const __u32 *)&src_only, seed);
}

/*
 * Step 9 without its bookkeeping: the bucket's hops for this packet.  Returns
 * -1 with tgt filled in, or a drop verdict.  Fragments and ICMP errors
 * (lib/lb_icmp.h) stop here; lb_table_lookup() records new flows.
 */
static __always_inline int lb_table_pick(const struct lb_pkt *pkt,
					 const struct xdplb_vip_info *vip,
					 const struct xdplb_config *cfg, struct lb_target *tgt)
{
	const struct xdplb_bucket *bucket = NULL;
	const __u32 *first;
	__u32 vip_id = vip->vip_id;
	__u32 size = vip->table_size;
	__u32 idx;
	void *table;

	tgt->hash = lb_flow_hash(pkt, vip, cfg->hash_seed);
	/* BPF's x % 0 == x: a zero size counts as no table (below), idx unused. */
	idx = tgt->hash % size;
	/*
	 * The table is in the outer map of the VIP's kind: lb_btables holds
	 * Beamer buckets (XDPLB_MAX_HOPS ids), lb_tables Maglev ones (one id:
	 * a quarter of the footprint for the one random read a new flow makes).
	 */
	if (vip->table_kind == XDPLB_TABLE_BEAMER) {
		table = bpf_map_lookup_elem(&lb_btables, &vip_id);
		bucket = table && size ? bpf_map_lookup_elem(table, &idx) : NULL;
		first = bucket ? &bucket->hop[0] : NULL;
	} else {
		table = bpf_map_lookup_elem(&lb_tables, &vip_id);
		first = table && size ? bpf_map_lookup_elem(table, &idx) : NULL;
	}
	if (!table || !size)
		return lb_drop(XDPLB_DROP_NO_TABLE);
	if (!first)
		return lb_drop(XDPLB_DROP_NO_BACKEND);
	tgt->be_id = *first;
	tgt->be = lb_backend(tgt->be_id);
	if (!tgt->be)
		return lb_drop(XDPLB_DROP_NO_BACKEND);

	/*
	 * Beamer: the bucket's previous owners ride along in the GUE hop list,
	 * most recent first, so that a hop can daisy-chain connections it does
	 * not know to the next one.
	 */
	if (bucket)
		lb_pack_hops(tgt, bucket->hop[1], bucket->hop[2], bucket->hop[3]);
	return -1;
}

/*
 * Step 9.  Returns -1 with tgt filled in and the session recorded where the
 * lookup (ss) chose, or a drop verdict.  A session keeps the hop list when it
 * may need it: a Beamer TCP flow met mid-connection may belong to any of the
 * bucket's hops, while a SYN starts at the first hop and host_tc takes other
 * protocols at the first.
 */
static __always_inline int lb_table_lookup(const struct lb_pkt *pkt,
					   const struct xdplb_vip_info *vip,
					   const struct xdplb_config *cfg, struct xdplb_conn_set *cs,
					   __u32 set, struct lb_sess *ss, __u32 shash, __u32 now,
					   struct lb_target *tgt)
{
	struct lb_sess_new n = {};
	int rc = lb_table_pick(pkt, vip, cfg, tgt);

	if (rc >= 0)
		return rc;
	lb_count_event(XDPLB_EV_CONN_MISS);
	/* Bounded writes: past the budget a new flow is balanced, not recorded. */
	if (lb_under_flood(cfg->flood_max)) {
		lb_count_event(XDPLB_EV_CONN_FLOOD);
		return -1;
	}
	if (!cs)
		return -1;
	lb_sess_choose(cs, cfg, shash, ss);
	n.hop[0] = tgt->be_id;
	n.hash = tgt->hash;
	n.be_gen = tgt->be->gen;
	if (pkt->flow.proto != IPPROTO_TCP) {
		n.state = XDPLB_SESS_UDP;
	} else if (lb_is_syn(pkt)) {
		n.state = XDPLB_SESS_TCP_SYN;
	} else {
		/* met mid-connection; already closing if this is the client's FIN or RST */
		n.state = pkt->tcp_flags & (LB_TCP_FIN | LB_TCP_RST) ? XDPLB_SESS_TCP_FIN :
								       XDPLB_SESS_TCP_EST;
		if (vip->table_kind == XDPLB_TABLE_BEAMER) {
			n.hop[1] = tgt->next_id[0];
			n.hop[2] = tgt->next_id[1];
			n.hop[3] = tgt->next_id[2];
		}
	}
	lb_sess_put(cs, set, ss, &pkt->flow, &n, cfg, now, shash);
	return -1;
}

#endif /* XDPLB_LIB_LB_SELECT_H */
