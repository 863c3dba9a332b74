/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The connection table (steps 8 and 9 of docs/datapath.md): a set-associative
 * cache in the ARRAY lb_conns, struct xdplb_conn_set in xdplb_abi.h.
 *
 * A flow lives in set xdplb_flow_hash(key, hash_seed) & (SETS - 1), in one
 * of its XDPLB_CONN_WAYS ways, tagged with that hash.  Replacement is exact
 * LRU within the set: the matching way (an update), else an empty way, else
 * the way of highest rank.
 *
 * Writers (lb_conn_put) hold the set's bpf_spin_lock (no helper calls while
 * it is held) and make seq odd for the time they write, seqcount style.
 * Readers (lb_conn_get) take no lock: they read seq, the ways, then seq
 * again, and a read that saw seq odd or changed is a miss, never a torn
 * entry (the miss path's insert then finds the flow again under the lock).
 * The ordering relies on the compiler barriers below and on x86's ordering
 * of loads with loads and stores with stores (the BPF JIT keeps program
 * order; BPF has no fence instruction to do better on weaker machines).
 * User space copies whole sets with BPF_F_LOCK (datapath/conns.py).
 *
 * Ranks: touching way w with old rank r moves every way ranked below r one
 * down and puts w at 0; a way being filled counts as r = WAYS - 1, so after
 * WAYS inserts into an empty set the ranks are a permutation and stay one.
 */
#ifndef XDPLB_LIB_LB_CONNS_H
#define XDPLB_LIB_LB_CONNS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/lb_maps.h"

#define LB_WAYS		XDPLB_CONN_WAYS
#define lb_barrier()	asm volatile("" ::: "memory")
#define LB_READ_ONCE(x)	(*(volatile typeof(x) *)&(x))
#define LB_WRITE_ONCE(x, v)	(*(volatile typeof(x) *)&(x) = (v))
#define LB_NO_WAY	LB_WAYS

static __always_inline struct xdplb_conn_set *lb_conn_set(__u32 fhash)
{
	__u32 idx = fhash & (XDPLB_CONN_SETS - 1);

	return bpf_map_lookup_elem(&lb_conns, &idx);
}

static __always_inline int lb_conn_key_eq(const struct xdplb_flow_key *a,
					  const struct xdplb_flow_key *b)
{
	const __u32 *x = (const __u32 *)a, *y = (const __u32 *)b;
	__u32 d = 0;
	int i;

#pragma unroll
	for (i = 0; i < XDPLB_FLOW_WORDS; i++)
		d |= x[i] ^ y[i];
	return d == 0;
}

/* The way holding this flow, or LB_NO_WAY.  Lock held. */
static __always_inline __u32 lb_conn_find(const struct xdplb_conn_set *s, __u32 fhash,
					  const struct xdplb_flow_key *key)
{
	int i;

#pragma unroll
	for (i = 0; i < LB_WAYS; i++)
		if (s->tag[i] == fhash && s->backend_id[i] &&
		    lb_conn_key_eq(&s->slot[i].key, key))
			return i;
	return LB_NO_WAY;
}

/* Make way w the most recent; r is its old rank.  Lock held. */
static __always_inline void lb_conn_touch(struct xdplb_conn_set *s, __u32 w, __u8 r)
{
	int i;

#pragma unroll
	for (i = 0; i < LB_WAYS; i++)
		if (s->rank[i] < r)
			s->rank[i]++;
	s->rank[w & (LB_WAYS - 1)] = 0;
}

/* Step 8's read: 1 and the entry if the flow is in the table (and refresh it). */
static __always_inline int lb_conn_get(__u32 fhash, const struct xdplb_flow_key *key,
				       __u32 *backend_id, __u32 *hash)
{
	struct xdplb_conn_set *s = lb_conn_set(fhash);
	__u32 seq, w;

	if (!s)
		return 0;
	seq = LB_READ_ONCE(s->seq);
	if (seq & 1)
		return 0;
	lb_barrier();
	w = lb_conn_find(s, fhash, key);
	if (w >= LB_WAYS)
		return 0;
	w &= LB_WAYS - 1;
	*backend_id = s->backend_id[w];
	*hash = s->hash[w];
	lb_barrier();
	if (LB_READ_ONCE(s->seq) != seq)
		return 0;
	if (s->rank[w]) {
		/* Not the most recent way: refresh, if it still holds the flow. */
		bpf_spin_lock(&s->lock);
		if (s->tag[w] == fhash && s->backend_id[w] == *backend_id)
			lb_conn_touch(s, w, s->rank[w]);
		bpf_spin_unlock(&s->lock);
	}
	return 1;
}

/* Step 9's write: record (or replace) the flow, evicting the set's LRU way if full. */
static __always_inline void lb_conn_put(__u32 fhash, const struct xdplb_flow_key *key,
					__u32 backend_id, __u32 hash)
{
	struct xdplb_conn_set *s = lb_conn_set(fhash);
	__u8 r = LB_WAYS - 1;
	__u32 w;
	int i;

	if (!s)
		return;
	bpf_spin_lock(&s->lock);
	w = lb_conn_find(s, fhash, key);
	if (w < LB_WAYS) {
		r = s->rank[w & (LB_WAYS - 1)];
	} else {
#pragma unroll
		for (i = LB_WAYS - 1; i >= 0; i--)
			if (!s->backend_id[i])
				w = i;
		if (w >= LB_WAYS) {
			__u8 best = 0;

			w = 0;
#pragma unroll
			for (i = 0; i < LB_WAYS; i++)
				if (s->rank[i] > best) {
					best = s->rank[i];
					w = i;
				}
		}
	}
	w &= LB_WAYS - 1;
	LB_WRITE_ONCE(s->seq, s->seq + 1);
	lb_barrier();
	s->tag[w] = fhash;
	s->backend_id[w] = backend_id;
	s->hash[w] = hash;
	__builtin_memcpy(&s->slot[w].key, key, sizeof(*key));
	lb_barrier();
	LB_WRITE_ONCE(s->seq, s->seq + 1);
	lb_conn_touch(s, w, r);
	bpf_spin_unlock(&s->lock);
}

#endif /* XDPLB_LIB_LB_CONNS_H */
