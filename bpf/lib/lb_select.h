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
	__u32 nhops;
	__u32 be_id;
	__u32 hash;
};

/* Step 6: the exact (dst, dport, proto) entry, else the port-0 wildcard. */
static __always_inline const struct xdplb_vip_info *
lb_vip_lookup(const struct lb_pkt *pkt)
{
	struct xdplb_vip_key key = {};
	const struct xdplb_vip_info *vip;

	__builtin_memcpy(key.addr, pkt->flow.dst, sizeof(key.addr));
	key.port = pkt->flow.dport;
	key.proto = pkt->flow.proto;
	key.family = pkt->family;
	vip = bpf_map_lookup_elem(&lb_vips, &key);
	if (vip)
		return vip;
	key.port = 0;
	return bpf_map_lookup_elem(&lb_vips, &key);
}

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
 * Step 8.  fhash is xdplb_flow_hash(&pkt->flow, seed): the set (with
 * cfg->conn_mask) and the tag.
 * Returns 1 on a usable hit (tgt filled in), 0 otherwise.
 */
static __always_inline int lb_conn_lookup(const struct lb_pkt *pkt,
					  const struct xdplb_config *cfg, __u32 fhash,
					  struct lb_target *tgt)
{
	__u32 be_id = 0, hash = 0;

	if (!lb_conn_get(fhash, cfg->conn_mask, &pkt->flow, &be_id, &hash))
		return 0;
	tgt->be = lb_backend(be_id);
	if (!tgt->be) {
		/* Backend went away: re-hash, and the insert below replaces this entry. */
		lb_count_event(XDPLB_EV_CONN_STALE);
		return 0;
	}
	tgt->be_id = be_id;
	tgt->hash = hash;
	lb_count_event(XDPLB_EV_CONN_HIT);
	return 1;
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
 * Step 9's hash: the flow hash, or with XDPLB_VIP_F_SRC_HASH everything but
 * src hashed as zero.
 */
static __always_inline __u32 lb_flow_hash(const struct lb_pkt *pkt,
					  const struct xdplb_vip_info *vip, __u32 seed,
					  __u32 fhash)
{
	struct xdplb_flow_key src_only = {};

	if (!(vip->flags & XDPLB_VIP_F_SRC_HASH))
		return fhash;
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
					 const struct xdplb_config *cfg, __u32 fhash,
					 struct lb_target *tgt)
{
	const struct xdplb_bucket *bucket = NULL;
	const __u32 *first;
	__u32 vip_id = vip->vip_id;
	__u32 size = vip->table_size;
	__u32 idx;
	void *table;

	tgt->hash = lb_flow_hash(pkt, vip, cfg->hash_seed, fhash);
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
	 * not know to the next one.  Unusable hops (0, inactive, the other
	 * family) are left out and the rest packed, with constant indexes only:
	 * the verifier does not allow pointers spilled at a variable offset.
	 */
	if (bucket) {
		__u8 family = tgt->be->family;
		const struct xdplb_backend *h1 = lb_later_hop(bucket->hop[1], family);
		const struct xdplb_backend *h2 = lb_later_hop(bucket->hop[2], family);
		const struct xdplb_backend *h3 = lb_later_hop(bucket->hop[3], family);

		if (!h2) {
			h2 = h3;
			h3 = NULL;
		}
		if (!h1) {
			h1 = h2;
			h2 = h3;
			h3 = NULL;
		}
		tgt->next[0] = h1;
		tgt->next[1] = h2;
		tgt->next[2] = h3;
		tgt->nhops = h3 ? 4 : h2 ? 3 : h1 ? 2 : 1;
	}
	return -1;
}

/*
 * Step 9.  Returns -1 with tgt filled in and the connection recorded, or a
 * drop verdict.
 */
static __always_inline int lb_table_lookup(const struct lb_pkt *pkt,
					   const struct xdplb_vip_info *vip,
					   const struct xdplb_config *cfg, __u32 fhash,
					   struct lb_target *tgt)
{
	int rc = lb_table_pick(pkt, vip, cfg, fhash, tgt);

	if (rc >= 0)
		return rc;
	/*
	 * Beamer: only a SYN is sure to start its connection on the first hop.
	 * Any other TCP packet we do not know may belong to a connection a
	 * later hop has: recording it would pin it to the first hop, whose
	 * packets then carry no later hops to daisy-chain to.
	 */
	if (vip->table_kind == XDPLB_TABLE_BEAMER && pkt->flow.proto == IPPROTO_TCP &&
	    !lb_is_syn(pkt)) {
		lb_count_event(XDPLB_EV_CONN_MISS);
		return -1;
	}

	/* Best effort: a full set evicts its least recently used way. */
	if (!lb_under_flood(cfg->flood_max))
		lb_conn_put(fhash, cfg->conn_mask, &pkt->flow, tgt->be_id, tgt->hash);
	else
		lb_count_event(XDPLB_EV_CONN_FLOOD);
	lb_count_event(XDPLB_EV_CONN_MISS);
	return -1;
}

#endif /* XDPLB_LIB_LB_SELECT_H */
