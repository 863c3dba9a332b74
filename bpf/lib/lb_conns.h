/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The connection table (steps 8 and 9 of docs/datapath.md): a set-associative
 * cache in the ARRAY lb_conns, struct xdplb_conn_set in xdplb_abi.h.
 *
 * A flow lives in set xdplb_flow_hash(key, hash_seed) & lb_config.conn_mask,
 * in one of its XDPLB_CONN_WAYS ways, tagged with that hash.  The number of
 * sets is lb_conns' max_entries, set by the loader from the configuration
 * (limits.conn_table), and conn_mask is that number - 1 (a power of 2): user
 * space checks mask + 1 <= max_entries before it writes lb_config, and a set
 * index beyond the map would only make the lookup below fail (no entry: every
 * flow is new), never read outside it.  Replacement is exact
 * LRU within the set: the matching way (an update), else an empty way, else
 * the way of highest rank.
 *
 * Writers (lb_conn_put) take no lock either: a writer claims the set by
 * turning seq from even to odd with one compare-and-swap (64 bits wide, on
 * the word {seq, pad}: clang's default BPF CPU has no 32-bit atomics), writes,
 * then makes seq even again, seqcount style.  A writer that finds seq odd or
 * loses the CAS (another CPU is writing the set) skips its insert: inserts are
 * best effort anyway, and the flow's next packet misses and tries again.
 * Readers (lb_conn_get) read seq, the ways, then seq again, and a read that
 * saw seq odd or changed is a miss, never a torn entry (the miss path's insert
 * then finds the flow again).  The ordering relies on the locked CAS being a
 * full barrier on x86, on the compiler barriers below and on x86's ordering
 * of loads with loads and stores with stores (the BPF JIT keeps program
 * order; BPF has no fence instruction to do better on weaker machines).
 *
 * The set's bpf_spin_lock is no longer taken by BPF: it only serializes user
 * space's BPF_F_LOCK copies (datapath/conns.py) with each other.  Such a copy
 * is therefore not atomic against lb_xdp's writers: user space validates the
 * sets it reads by their seq (read again until seq is even and unchanged),
 * and a user-space write (ConnTable.flush, or put, which is for tests and
 * tools) can interleave with a BPF writer.  Against one writer that leaves the
 * way being written with each field either the writer's or the user's value
 * (a flush: a miss, or the right backend with a zero hash); but a flush zeroes
 * seq, so a second BPF writer may claim the set while the first is still
 * writing, and two interleaved inserts could in theory pair one flow's key
 * and tag with the other's backend.  That needs a flush landing inside a
 * ~20 ns write window and a second new flow of the same set in that window;
 * the flow would then go to the other flow's backend.
 *
 * Ranks only steer eviction, so a hit refreshes them without claiming the
 * set: racing with a writer or another hit can lose an update (two ways of
 * one rank), which makes eviction approximate for a while, never wrong (a
 * rank stays in 0..WAYS-1, an empty way is still filled first, and an insert
 * into a full set still evicts a way of the highest rank).
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

_Static_assert(__builtin_offsetof(struct xdplb_conn_set, seq) % 8 == 0 &&
	       __builtin_offsetof(struct xdplb_conn_set, pad) ==
	       __builtin_offsetof(struct xdplb_conn_set, seq) + 4,
	       "seq and pad form the 64-bit word the writers claim");

/* The word a writer claims: seq in its low half (little endian), then pad. */
static __always_inline __u64 *lb_conn_seqword(struct xdplb_conn_set *s)
{
	return (__u64 *)&s->seq;
}

static __always_inline struct xdplb_conn_set *lb_conn_set(__u32 fhash, __u32 mask)
{
	__u32 idx = fhash & mask;

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

/* The way holding this flow, or LB_NO_WAY.  Set claimed (or seq validated after). */
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

/* Make way w the most recent; r is its old rank. */
static __always_inline void lb_conn_touch(struct xdplb_conn_set *s, __u32 w, __u8 r)
{
	int i;

#pragma unroll
	for (i = 0; i < LB_WAYS; i++)
		if (s->rank[i] < r)
			s->rank[i]++;
	s->rank[w & (LB_WAYS - 1)] = 0;
}

/*
 * Step 8's read: 1 and the entry if the flow is in the table (and refresh it).
 * mask: lb_config's conn_mask.
 */
static __always_inline int lb_conn_get(__u32 fhash, __u32 mask,
				       const struct xdplb_flow_key *key,
				       __u32 *backend_id, __u32 *hash)
{
	struct xdplb_conn_set *s = lb_conn_set(fhash, mask);
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
	/* Not the most recent way: refresh it, racily (see the top of this file). */
	if (s->rank[w])
		lb_conn_touch(s, w, s->rank[w]);
	return 1;
}

/* Step 9's write: record (or replace) the flow, evicting the set's LRU way if full. */
static __always_inline void lb_conn_put(__u32 fhash, __u32 mask,
					const struct xdplb_flow_key *key,
					__u32 backend_id, __u32 hash)
{
	struct xdplb_conn_set *s = lb_conn_set(fhash, mask);
	__u8 r = LB_WAYS - 1;
	__u64 *sw, v;
	__u32 w;
	int i;

	if (!s)
		return;
	/* Claim the set: seq even -> odd; another writer at work -> skip. */
	sw = lb_conn_seqword(s);
	v = LB_READ_ONCE(*sw);
	if (v & 1)
		return;
	if (__sync_val_compare_and_swap(sw, v, v + 1) != v)
		return;
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
	s->tag[w] = fhash;
	s->backend_id[w] = backend_id;
	s->hash[w] = hash;
	__builtin_memcpy(&s->slot[w].key, key, sizeof(*key));
	lb_conn_touch(s, w, r);
	/* Release: every store above before seq turns even (x86 keeps store order). */
	lb_barrier();
	LB_WRITE_ONCE(*sw, v + 2);
}

#endif /* XDPLB_LIB_LB_CONNS_H */
