/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The session table (steps 8 and 9 of docs/datapath.md): lb_conns, an ARRAY
 * of sets of XDPLB_CONN_WAYS sessions (struct xdplb_conn_set in xdplb_abi.h):
 * a line of metadata, then a line per way.  A flow lives in set
 * xdplb_sess_hash(key, lb_config.sess_key) & conn_mask, in any of its ways;
 * its tag (that hash) in the metadata line says which ways to compare.  A
 * lookup that misses reads the metadata line only; a hit, that line and its
 * way's; an insert writes the line its lookup chose.  lb_xdp fetches all five
 * lines before the VIP lookup (lb_sess_prefetch), so that none of them is
 * waited for on its own.
 *
 * Correct on every CPU by construction, not by x86's ordering:
 *
 * - A writer claims the set with a compare-and-swap that turns seq odd,
 *   writes, and releases it with an atomic add that makes seq even again.
 *   BPF atomics with fetch are fully ordered (kernel Documentation/bpf/
 *   standardization/instruction-set.rst), so every store of the write is
 *   visible before the release and none before the claim.  A writer that
 *   finds seq odd, or loses the race for it, gives up: an insert is best
 *   effort (counted CONN_BUSY).  Measured: this release costs nothing over a
 *   plain store (docs/benchmarks.md).
 *
 * - A reader loads seq, then the set through a pointer that depends on the
 *   value loaded (lb_dep() adds a zero the compiler cannot see through), then
 *   seq again through a pointer that depends on everything it read.  Address
 *   dependencies order loads on every CPU Linux runs BPF on (the rule
 *   rcu_dereference() rests on; only Alpha breaks it, and it has no BPF JIT),
 *   so the first load happens before the others and the second after them: a
 *   reader accepts what it read only when both loads show the same even seq,
 *   which no writer can have held in between.  A torn session is never
 *   accepted, whatever the CPU.
 *
 * - last_seen is the one field written without the claim: a hit refreshes it
 *   with a plain store (any value it holds is a recent time).
 *
 * - Flushing is a generation: lb_config.conn_gen changes, every session of
 *   another gen is a miss (CONN_GEN_MISS) and a free way for inserts.  User
 *   space writes only under the same claim (src/xdplb/datapath/sessions.c).
 *
 * An insert takes, in order: the way holding the same flow, a free way (never
 * used, another generation, or idle past its timeout), else the way idle the
 * longest (lb_sess_choose()).  The claim is made with the seq the lookup read:
 * if the set changed since, it fails and the insert is skipped.  Two CPUs inserting the
 * same new flow at once may record it twice, both from the same table: a
 * later lookup finds the first.
 */
#ifndef XDPLB_LIB_LB_CONNS_H
#define XDPLB_LIB_LB_CONNS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/lb_maps.h"
#include "lib/counters.h"

#define LB_WAYS		XDPLB_CONN_WAYS
#define LB_NO_WAY	LB_WAYS
#define LB_READ_ONCE(x)	(*(volatile typeof(x) *)&(x))
#define LB_WRITE_ONCE(x, v)	(*(volatile typeof(x) *)&(x) = (v))
/* Reads of a set a writer holds before a lookup gives up on it (a writer holds it ~20 ns). */
#define LB_BUSY_TRIES	4

#ifndef XDPLB_ABI_TEST_NEXT
_Static_assert(sizeof(struct xdplb_conn_meta) == 64 && sizeof(struct xdplb_conn_entry) == 64,
	       "a set is a metadata line and a line per way");
#else
_Static_assert(sizeof(struct xdplb_conn_entry) == 68, "the test layout: one field more");
#endif
_Static_assert(__builtin_offsetof(struct xdplb_conn_entry, proto) == 36,
	       "the key's nine words, then proto, as in xdplb_flow_key");

/* What a lookup found of the flow. */
enum lb_sess_find {
	LB_SESS_NONE = 0,	/* no way holds the flow */
	LB_SESS_HIT,		/* a live session, read whole */
	LB_SESS_GEN,		/* the flow's session, of another generation */
	LB_SESS_EXPIRED,	/* the flow's session, idle past its timeout */
	LB_SESS_BUSY,		/* a writer held the set through every read */
};

/*
 * A lookup's result: the flow's session as read (a copy: the set may change
 * right after) and where an insert of this flow should go.
 */
struct lb_sess {
	__u64 seq;		/* the set's seq the reads were made under */
	__u32 now;		/* the tick of now */
	__u32 way;		/* the flow's way, or LB_NO_WAY */
	__u32 last_seen;
	__u16 hop[XDPLB_MAX_HOPS];
	__u32 hash;
	__u16 gen;
	__u8 state;
	__u8 be_gen;
	__u8 ins_way;		/* where an insert goes (LB_NO_WAY: nowhere) */
	__u8 ins_live;		/* it holds another flow's live session (an eviction) */
	__u8 ins_expired;	/* it holds a session idle past its timeout */
	__u8 flags;		/* the way's XDPLB_SESS_F_* */
};

/*
 * A lookup's result lives in per-CPU scratch, not on the stack: lb_xdp's frame
 * and that of the deepest function it calls must fit the verifier's 512 bytes.
 * One packet at a time runs on a CPU: one slot a CPU.  Internal, not pinned.
 */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lb_sess);
} lb_sess_scratch SEC(".maps");

static __always_inline struct lb_sess *lb_sess_slot(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&lb_sess_scratch, &zero);
}

/* A zero computed from v that the compiler cannot fold: an address dependency on v. */
static __always_inline __u64 lb_dep(__u64 v)
{
	asm volatile("%0 &= 0" : "+r"(v));
	return v;
}

/*
 * Bring set s's lines towards the CPU before they are needed: one load from
 * each, its value unused.  BPF has no prefetch instruction, but an
 * out-of-order CPU starts these misses at once and runs on while they are
 * served, so that a new flow's reads of the metadata line and its insert into
 * a way line (whose line a store would otherwise wait for) overlap with the
 * work between here and there.  Every way, because which one step 9 takes is
 * known only from the metadata; a known flow reads its own way line anyway.
 * Measured in docs/benchmarks.md: the metadata line alone gains nothing, the
 * way lines are the cost.
 */
static __always_inline void lb_sess_prefetch(const struct xdplb_conn_set *s)
{
	int w;

	if (!s)
		return;
	LB_READ_ONCE(s->meta.seq);
#pragma unroll
	for (w = 0; w < LB_WAYS; w++)
		LB_READ_ONCE(s->way[w].hash);
}

/* XOR of the way's key words with the flow key's: 0 when they are the same flow. */
static __always_inline __u32 lb_key_diff(const struct xdplb_conn_entry *e,
					 const struct xdplb_flow_key *key)
{
	const __u32 *x = e->src, *y = key->src;
	__u32 d = 0;
	int i;

	/* src, dst, then the ports word: nine words at the same offsets from src */
#pragma unroll
	for (i = 0; i < XDPLB_FLOW_WORDS - 1; i++)
		d |= x[i] ^ y[i];
	return d | (e->proto ^ key->proto);
}

_Static_assert(XDPLB_SESS__MAX == 4, "conn_timeout is indexed by state & 3");

/*
 * Ticks since last_seen at tick now: a signed difference, so that ticks wrap harmlessly
 * and a session stamped a tick ahead (by another CPU, or an import) counts as just seen.
 */
static __always_inline __u32 lb_sess_age(__u32 last_seen, __u32 now)
{
	__s32 age = now - last_seen;

	return age < 0 ? 0 : age;
}

/* Idle past its state's timeout at tick now? (Timeouts are below 2^31 ticks.) */
static __always_inline int lb_sess_expired(const struct xdplb_config *cfg, __u32 last_seen,
					   __u32 state, __u32 now)
{
	return lb_sess_age(last_seen, now) > cfg->conn_timeout[state & (XDPLB_SESS__MAX - 1)];
}

/*
 * Step 8's read: the flow's way in set s, read whole under seq.  Only ways
 * whose tag is the flow's are compared, so a miss reads the metadata line
 * alone.  LB_SESS_BUSY if a writer held the set or changed it meanwhile.
 */
static __always_inline int lb_sess_read(struct xdplb_conn_set *s, const struct xdplb_flow_key *key,
					__u32 stag, const struct xdplb_config *cfg, __u32 now,
					struct lb_sess *out)
{
	const struct xdplb_conn_meta *m;
	const struct xdplb_conn_entry *e;
	__u32 acc = 0, found = LB_NO_WAY, w;
	__u64 seq, seq2;

	seq = LB_READ_ONCE(s->meta.seq);
	if (seq & 1)
		return LB_SESS_BUSY;
	/* Every load below depends on seq's value, so none is done before it. */
	m = (const void *)&s->meta + lb_dep(seq);
#pragma unroll
	for (w = 0; w < LB_WAYS; w++) {
		acc ^= m->flags[w] ^ m->tag[w];
		if (!(m->flags[w] & XDPLB_SESS_F_USED) || m->tag[w] != stag)
			continue;
		e = (const void *)&s->way[w] + lb_dep(seq);
		acc ^= lb_key_diff(e, key);
		if (lb_key_diff(e, key))
			continue;
		out->hop[0] = e->hop[0];
		out->hop[1] = e->hop[1];
		out->hop[2] = e->hop[2];
		out->hop[3] = e->hop[3];
		out->hash = e->hash;
		out->be_gen = e->be_gen;
		out->last_seen = m->last_seen[w];
		out->state = m->state[w];
		out->gen = m->gen[w];
		out->flags = m->flags[w];
		acc ^= out->hop[0] ^ out->hop[1] ^ out->hop[2] ^ out->hop[3] ^ out->hash ^
		       out->be_gen ^ out->state ^ out->gen;
		found = w;
		break;
	}
	/* ... and the second read of seq depends on every one of them. */
	seq2 = LB_READ_ONCE(*(__u64 *)((void *)&s->meta.seq + lb_dep(acc)));
#ifndef XDPLB_TEST_NO_VALIDATE	/* broken on purpose: tests/bpf/test_concurrency.py */
	if (seq2 != seq)
		return LB_SESS_BUSY;
#endif
	out->seq = seq;
	out->way = found;
	if (found == LB_NO_WAY)
		return LB_SESS_NONE;
	if (out->gen != cfg->conn_gen)
		return LB_SESS_GEN;
	if (lb_sess_expired(cfg, out->last_seen, out->state, now))
		return LB_SESS_EXPIRED;
	return LB_SESS_HIT;
}

/* Step 8's read, retried while a writer holds the set (it does for ~20 ns). */
static __always_inline int lb_sess_find(struct xdplb_conn_set *s, const struct xdplb_flow_key *key,
					__u32 stag, const struct xdplb_config *cfg, __u32 now,
					struct lb_sess *out)
{
	int t, rc = LB_SESS_BUSY;

	for (t = 0; t < LB_BUSY_TRIES && rc == LB_SESS_BUSY; t++)
		rc = lb_sess_read(s, key, stag, cfg, now, out);
	return rc;
}

/*
 * Where step 9 records a flow its lookup (out) did not find live: the flow's
 * own way, else a free way (never used, another generation, idle past its
 * timeout), else the way idle the longest, ties going to a way the flow's
 * hash picks.  Plain reads: the claim (lb_sess_put) fails if the set has
 * changed since the lookup's seq, so a choice made on a stale view is never
 * carried out.
 */
static __always_inline void lb_sess_choose(struct xdplb_conn_set *s,
					   const struct xdplb_config *cfg, __u32 stag,
					   struct lb_sess *out)
{
	const struct xdplb_conn_meta *m = &s->meta;
	__u32 free = LB_NO_WAY, old = LB_NO_WAY, old_age = 0, age, w, i;
	__u32 now = out->now, first = stag >> 30;

	out->ins_live = 0;
	out->ins_expired = 0;
	if (out->way < LB_WAYS) {
		/* its own session, of another generation or expired: replaced */
		out->ins_way = out->way;
		return;
	}
#pragma unroll
	for (i = 0; i < LB_WAYS; i++) {
		w = (first + i) & (LB_WAYS - 1);
		if (!(m->flags[w] & XDPLB_SESS_F_USED) || m->gen[w] != cfg->conn_gen) {
			free = w;
			break;
		}
		if (lb_sess_expired(cfg, m->last_seen[w], m->state[w], now)) {
			free = w;
			out->ins_expired = 1;
			break;
		}
		age = lb_sess_age(m->last_seen[w], now);
		if (old == LB_NO_WAY || age > old_age) {
			old = w;
			old_age = age;
		}
	}
	out->ins_live = free == LB_NO_WAY;
	out->ins_way = free != LB_NO_WAY ? free : old;
}

/* A hit's bookkeeping: last_seen when the tick moved (the one unclaimed store). */
static __always_inline void lb_sess_touch(struct xdplb_conn_set *s, const struct lb_sess *ss,
					  __u32 now)
{
	__u32 w = ss->way & (LB_WAYS - 1);

	if (ss->last_seen != now)
		LB_WRITE_ONCE(s->meta.last_seen[w], now);
	/*
	 * A peer's session used here is this node's now: session sync refreshes it to the
	 * peers (only sessions used here are, so that a refresh is never echoed back).
	 * Unclaimed, like last_seen: a writer that took the way meanwhile loses at most
	 * the mark on its own session, which then is refreshed once more.
	 */
	if (ss->flags & XDPLB_SESS_F_IMPORTED)
		LB_WRITE_ONCE(s->meta.flags[w], ss->flags & ~XDPLB_SESS_F_IMPORTED);
}

#ifndef XDPLB_TEST_NO_CLAIM	/* broken on purpose: tests/bpf/test_concurrency.py */
/* Claim the set as the lookup saw it; 0 if a writer has been there since. */
static __always_inline int lb_sess_claim(struct xdplb_conn_set *s, __u64 seq)
{
	return __sync_val_compare_and_swap(&s->meta.seq, seq, seq + 1) == seq;
}

static __always_inline void lb_sess_release(struct xdplb_conn_set *s)
{
	__sync_fetch_and_add(&s->meta.seq, 1);
}
#else
/* Test builds only (tests/bpf/progs/lb_xdp_noclaim.bpf.c): writers take nothing. */
static __always_inline int lb_sess_claim(struct xdplb_conn_set *s, __u64 seq)
{
	return 1;
}

static __always_inline void lb_sess_release(struct xdplb_conn_set *s)
{
}
#endif

/* Publish way w of set s to the export ring (XDPLB_CFG_F_EXPORT); no room is counted. */
static __noinline void lb_sess_publish(struct xdplb_conn_set *s, __u32 set, __u32 w, __u32 type)
{
	struct xdplb_export_rec *r;

	w &= LB_WAYS - 1;
	r = bpf_ringbuf_reserve(&lb_sess_export, sizeof(*r), 0);
	if (!r) {
		lb_count_event(XDPLB_EV_EXPORT_DROP);
		return;
	}
	r->type = type;
	r->set = set;
	r->way = w;
	r->pad = 0;
	/* Called by the writer while it holds the set: not torn. */
	r->sess.last_seen = s->meta.last_seen[w];
	r->sess.gen = s->meta.gen[w];
	r->sess.state = s->meta.state[w];
	r->sess.flags = s->meta.flags[w];
	__builtin_memcpy(&r->sess.entry, &s->way[w], sizeof(r->sess.entry));
	bpf_ringbuf_submit(r, BPF_RB_NO_WAKEUP);
}

/*
 * Move the flow's session (read as ss) to state st, claimed so that no reader
 * sees half of it.  A set changed since the read, or held, is left alone: the
 * next packet tries again.
 */
static __always_inline void lb_sess_set_state(struct xdplb_conn_set *s, struct lb_sess *ss,
					      __u8 st, __u32 now, const struct xdplb_config *cfg,
					      __u32 set)
{
	__u32 w = ss->way & (LB_WAYS - 1);

	if (!lb_sess_claim(s, ss->seq))
		return;
	s->meta.state[w] = st;
	s->meta.last_seen[w] = now;
	if (cfg->flags & XDPLB_CFG_F_EXPORT)
		lb_sess_publish(s, set, w, XDPLB_EXPORT_UPDATE);
	lb_sess_release(s);
	ss->state = st;
}

/* A new session, as step 9 makes it. */
struct lb_sess_new {
	__u16 hop[XDPLB_MAX_HOPS];
	__u32 hash;
	__u8 state;
	__u8 be_gen;
};

/*
 * Step 9's write: record the flow in set s (index set) at the way its lookup
 * (ss) chose, if the set has not changed since.
 */
static __always_inline void lb_sess_put(struct xdplb_conn_set *s, __u32 set,
					const struct lb_sess *ss, const struct xdplb_flow_key *key,
					const struct lb_sess_new *n,
					const struct xdplb_config *cfg, __u32 now, __u32 stag)
{
	struct xdplb_conn_entry *e;
	__u32 w = ss->ins_way;

	/* seq odd: the lookup found the set held (and counted CONN_BUSY once for the packet) */
	if (ss->seq & 1)
		return;
	if (w >= LB_WAYS || !lb_sess_claim(s, ss->seq)) {
		lb_count_event(XDPLB_EV_CONN_BUSY);
		return;
	}
	w &= LB_WAYS - 1;
	e = &s->way[w];
	__builtin_memcpy(e->src, key->src, sizeof(e->src));
	__builtin_memcpy(e->dst, key->dst, sizeof(e->dst));
	e->sport = key->sport;
	e->dport = key->dport;
	e->proto = key->proto;
	e->be_gen = n->be_gen;
	e->pad = 0;
	e->hop[0] = n->hop[0];
	e->hop[1] = n->hop[1];
	e->hop[2] = n->hop[2];
	e->hop[3] = n->hop[3];
	e->hash = n->hash;
	e->nat[0] = 0;
	e->nat[1] = 0;
	e->nat[2] = 0;
	s->meta.tag[w] = stag;
	s->meta.last_seen[w] = now;
	s->meta.gen[w] = cfg->conn_gen;
	s->meta.state[w] = n->state;
	s->meta.flags[w] = XDPLB_SESS_F_USED;
	if (cfg->flags & XDPLB_CFG_F_EXPORT)
		lb_sess_publish(s, set, w, XDPLB_EXPORT_NEW);
	lb_sess_release(s);

	lb_count_event(XDPLB_EV_CONN_INSERT);
	if (ss->ins_live)
		lb_count_event(XDPLB_EV_CONN_EVICT);
	else if (ss->ins_expired)
		lb_count_event(XDPLB_EV_CONN_EXPIRED);
}

#endif /* XDPLB_LIB_LB_CONNS_H */
