/*
 * The session table from user space: lb_conns mapped into memory (BPF_F_MMAPABLE),
 * read and written with the claim protocol of bpf/lib/lb_conns.h, in C11 atomics so
 * that it holds on every CPU.  Compiled into xdplb.datapath._libbpf_c (libbpf_build.py).
 *
 * - A copy of a set is taken between a load-acquire of its seq and an acquire fence
 *   followed by a second load of seq; it is good when seq is even and unchanged.
 *   last_seen may move meanwhile (hits refresh it without the claim): any value read
 *   is a recent one.
 * - A write claims the set (compare-and-swap of seq, even -> odd, sequentially
 *   consistent), stores with relaxed atomic stores, and releases it (atomic add back
 *   to even, sequentially consistent): the same fully ordered atomics as lb_xdp's
 *   writers, so either side may write any set.
 */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <linux/types.h>

#include "xdplb_abi.h"
#include "lib/hash.h"

#define SESS_WAYS XDPLB_CONN_WAYS
#define SET_WORDS (sizeof(struct xdplb_conn_set) / 8)

_Static_assert(sizeof(struct xdplb_conn_set) == 64 * (1 + SESS_WAYS), "a line, then a line a way");
_Static_assert(sizeof(struct xdplb_session) == 72, "what export and import carry");

/* One validated copy of set s into out: 0, or -1 if a writer held it or changed it. */
static int set_copy(struct xdplb_conn_set *s, struct xdplb_conn_set *out)
{
	uint64_t *src = (uint64_t *)s, buf[SET_WORDS];
	uint64_t seq, seq2;
	size_t i;

	seq = __atomic_load_n(&s->meta.seq, __ATOMIC_ACQUIRE);
	if (seq & 1)
		return -1;
	buf[0] = seq;
	for (i = 1; i < SET_WORDS; i++)
		buf[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	seq2 = __atomic_load_n(&s->meta.seq, __ATOMIC_RELAXED);
	if (seq2 != seq)
		return -1;
	memcpy(out, buf, sizeof(buf));
	return 0;
}

/*
 * Between two tries: nothing at first (a writer holds a set for ~20 ns), then the CPU
 * (a writer in user space may have been preempted while it held the set: spinning on
 * would only wait out its time slice).
 */
static void backoff(uint32_t t)
{
	if (t >= 64 && !(t & 15))
		sched_yield();
}

static int set_copy_tries(struct xdplb_conn_set *s, struct xdplb_conn_set *out, uint32_t tries)
{
	uint32_t t;

	for (t = 0; t < tries; t++) {
		if (!set_copy(s, out))
			return 0;
		backoff(t);
	}
	return -1;
}

/* Way w of a copied set as a session record. */
static void session_of(const struct xdplb_conn_set *c, uint32_t w, struct xdplb_session *out)
{
	out->last_seen = c->meta.last_seen[w];
	out->gen = c->meta.gen[w];
	out->state = c->meta.state[w];
	out->flags = c->meta.flags[w];
	out->entry = c->way[w];
}

static int key_equal(const struct xdplb_conn_entry *e, const struct xdplb_conn_entry *k)
{
	return !memcmp(e->src, k->src, sizeof(e->src)) && !memcmp(e->dst, k->dst, sizeof(e->dst)) &&
	       e->sport == k->sport && e->dport == k->dport && e->proto == k->proto;
}

/* The session hash of an entry's key (the flow key, padding zero). */
static uint32_t entry_hash(const struct xdplb_conn_entry *e, const __u64 *keys)
{
	struct xdplb_flow_key key = {};

	memcpy(key.src, e->src, sizeof(key.src));
	memcpy(key.dst, e->dst, sizeof(key.dst));
	key.sport = e->sport;
	key.dport = e->dport;
	key.proto = e->proto;
	return xdplb_sess_hash((const __u32 *)&key, keys);
}

/*
 * Copy every way in use of sets [start, start + count) into out, with its position
 * (set * WAYS + way) in pos; at most cap of them.  A set a writer keeps holding through
 * `tries` copies is counted in *busy and left out.  Returns how many were copied.
 */
int xdplb_sess_read(void *base, uint32_t start, uint32_t count, struct xdplb_session *out,
		    uint32_t *pos, uint32_t cap, uint32_t tries, uint32_t *busy)
{
	struct xdplb_conn_set *sets = base, c;
	uint32_t n = 0, s, w;

	*busy = 0;
	for (s = start; s < start + count; s++) {
		if (set_copy_tries(&sets[s], &c, tries)) {
			(*busy)++;
			continue;
		}
		for (w = 0; w < SESS_WAYS; w++) {
			if (!(c.meta.flags[w] & XDPLB_SESS_F_USED))
				continue;
			session_of(&c, w, &out[n]);
			pos[n] = s * SESS_WAYS + w;
			if (++n == cap)
				return n;
		}
	}
	return n;
}

/* Result of one import, per session. */
enum {
	XDPLB_IMPORT_WRITTEN = 0,	/* into a free way (never used, old generation, idle) */
	XDPLB_IMPORT_REPLACED = 1,	/* over the flow's own session (replace) */
	XDPLB_IMPORT_EVICTED = 2,	/* over another flow's live session (the set was full) */
	XDPLB_IMPORT_PRESENT = 3,	/* the flow has a live session and replace was not asked */
	XDPLB_IMPORT_BUSY = 4,		/* the set stayed held by other writers */
};

/* What an import does with a flow that has a live session (the `replace` argument). */
enum {
	XDPLB_IMPORT_KEEP = 0,		/* leave it (PRESENT) */
	XDPLB_IMPORT_OVERWRITE = 1,	/* overwrite it (REPLACED) */
	XDPLB_IMPORT_NEWER = 2,		/* advance its last_seen to the import's when that is
					 * later (REPLACED), else leave it (PRESENT): a peer's
					 * refresh, which must not move the flow */
};

/* Ticks since last_seen, as lb_sess_age(): signed, a stamp ahead of now is just seen. */
static uint32_t sess_age(uint32_t last_seen, uint32_t now)
{
	int32_t age = (int32_t)(now - last_seen);

	return age < 0 ? 0 : (uint32_t)age;
}

static int way_live(const struct xdplb_conn_set *c, uint32_t w, uint16_t gen, uint32_t now,
		    const uint32_t *timeouts)
{
	return (c->meta.flags[w] & XDPLB_SESS_F_USED) && c->meta.gen[w] == gen &&
	       sess_age(c->meta.last_seen[w], now) <=
		       timeouts[c->meta.state[w] & (XDPLB_SESS__MAX - 1)];
}

/*
 * A validated copy of set s's metadata line and of the ways whose tag is tag (the only
 * ways that can hold that flow): one or two lines read, not five.  0, or -1 if a writer
 * held the set or changed it.
 */
static int set_copy_tagged(struct xdplb_conn_set *s, uint32_t tag, struct xdplb_conn_set *out)
{
	uint64_t *src = (uint64_t *)&s->meta, *dst = (uint64_t *)&out->meta, seq, seq2;
	size_t i, w;

	seq = __atomic_load_n(&s->meta.seq, __ATOMIC_ACQUIRE);
	if (seq & 1)
		return -1;
	dst[0] = seq;
	for (i = 1; i < sizeof(out->meta) / 8; i++)
		dst[i] = __atomic_load_n(&src[i], __ATOMIC_RELAXED);
	for (w = 0; w < SESS_WAYS; w++) {
		uint64_t *es = (uint64_t *)&s->way[w], *ed = (uint64_t *)&out->way[w];

		if (!(out->meta.flags[w] & XDPLB_SESS_F_USED) || out->meta.tag[w] != tag)
			continue;
		for (i = 0; i < sizeof(out->way[w]) / 8; i++)
			ed[i] = __atomic_load_n(&es[i], __ATOMIC_RELAXED);
	}
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
	seq2 = __atomic_load_n(&s->meta.seq, __ATOMIC_RELAXED);
	return seq2 == seq ? 0 : -1;
}

/* Write one session into its set (the lookup's choice of way, as lb_xdp makes it). */
static int sess_put(struct xdplb_conn_set *s, const struct xdplb_session *in, uint32_t tag,
		    uint16_t gen, uint32_t now, const uint32_t *timeouts, int replace)
{
	uint32_t same = SESS_WAYS, free_way = SESS_WAYS, old = SESS_WAYS, old_age = 0, w;
	struct xdplb_conn_set c;
	uint64_t seq, *dst, *src;
	size_t i;

	if (set_copy_tagged(s, tag, &c))
		return XDPLB_IMPORT_BUSY;
	for (w = 0; w < SESS_WAYS; w++) {
		if (!(c.meta.flags[w] & XDPLB_SESS_F_USED)) {
			if (free_way == SESS_WAYS)
				free_way = w;
			continue;
		}
		if (same == SESS_WAYS && c.meta.tag[w] == tag && key_equal(&c.way[w], &in->entry)) {
			same = w;
			continue;
		}
		if (!way_live(&c, w, gen, now, timeouts)) {
			if (free_way == SESS_WAYS)
				free_way = w;
			continue;
		}
		if (old == SESS_WAYS || sess_age(c.meta.last_seen[w], now) > old_age) {
			old = w;
			old_age = sess_age(c.meta.last_seen[w], now);
		}
	}
	if (same != SESS_WAYS && replace != XDPLB_IMPORT_OVERWRITE &&
	    way_live(&c, same, gen, now, timeouts)) {
		if (replace != XDPLB_IMPORT_NEWER ||
		    (int32_t)(in->last_seen - c.meta.last_seen[same]) <= 0)
			return XDPLB_IMPORT_PRESENT;
		seq = c.meta.seq;
		if (!__atomic_compare_exchange_n(&s->meta.seq, &seq, seq + 1, 0, __ATOMIC_SEQ_CST,
						 __ATOMIC_RELAXED))
			return XDPLB_IMPORT_BUSY;
		__atomic_store_n(&s->meta.last_seen[same], in->last_seen, __ATOMIC_RELAXED);
		__atomic_fetch_add(&s->meta.seq, 1, __ATOMIC_SEQ_CST);
		return XDPLB_IMPORT_REPLACED;
	}
	w = same != SESS_WAYS ? same : free_way != SESS_WAYS ? free_way : old;
	seq = c.meta.seq;
	if (!__atomic_compare_exchange_n(&s->meta.seq, &seq, seq + 1, 0, __ATOMIC_SEQ_CST,
					 __ATOMIC_RELAXED))
		return XDPLB_IMPORT_BUSY;
	/* Held: the set as copied, with way w replaced, stored word by word. */
	c.meta.tag[w] = tag;
	c.meta.last_seen[w] = in->last_seen;
	c.meta.gen[w] = gen;
	c.meta.state[w] = in->state;
	c.meta.flags[w] = XDPLB_SESS_F_USED | XDPLB_SESS_F_IMPORTED;
	c.way[w] = in->entry;
	dst = (uint64_t *)&s->way[w];
	src = (uint64_t *)&c.way[w];
	for (i = 0; i < sizeof(c.way[w]) / 8; i++)
		__atomic_store_n(&dst[i], src[i], __ATOMIC_RELAXED);
	__atomic_store_n(&s->meta.tag[w], tag, __ATOMIC_RELAXED);
	__atomic_store_n(&s->meta.last_seen[w], in->last_seen, __ATOMIC_RELAXED);
	__atomic_store_n(&s->meta.gen[w], gen, __ATOMIC_RELAXED);
	__atomic_store_n(&s->meta.state[w], in->state, __ATOMIC_RELAXED);
	__atomic_store_n(&s->meta.flags[w], c.meta.flags[w], __ATOMIC_RELAXED);
	__atomic_fetch_add(&s->meta.seq, 1, __ATOMIC_SEQ_CST);
	if (w == same)
		return XDPLB_IMPORT_REPLACED;
	return w == free_way ? XDPLB_IMPORT_WRITTEN : XDPLB_IMPORT_EVICTED;
}

#define IMPORT_AHEAD 16

/* Every line of a set, for writing: its metadata and whichever way the import takes. */
static void prefetch_set(struct xdplb_conn_set *s)
{
	size_t w;

	__builtin_prefetch(&s->meta, 1);
	for (w = 0; w < SESS_WAYS; w++)
		__builtin_prefetch(&s->way[w], 1);
}

/*
 * Import n sessions: each goes to set xdplb_sess_hash(key, seed) & mask, under this
 * table's generation gen; its last_seen is kept as given (ticks of this host's
 * clock).  replace (XDPLB_IMPORT_KEEP, _OVERWRITE, _NEWER): what becomes of a flow's
 * live session.  A set
 * held by a writer is tried again up to `tries` times.  result[i] gets each outcome.
 * Returns how many were written (WRITTEN, REPLACED or EVICTED).
 */
uint32_t xdplb_sess_import(void *base, uint32_t mask, uint32_t seed, uint16_t gen, uint32_t now,
			   const uint32_t *timeouts, const struct xdplb_session *in, uint32_t n,
			   int replace, uint32_t tries, uint8_t *result)
{
	struct xdplb_conn_set *sets = base;
	uint32_t i, t, written = 0, tags[IMPORT_AHEAD];
	__u64 keys[XDPLB_SESS_KEYS];

	xdplb_sess_keys(seed, keys);

	/* The sets are random lines of a large table: ask for them IMPORT_AHEAD sessions
	 * early (for writing), so that their misses overlap instead of following each other. */
	for (i = 0; i < n && i < IMPORT_AHEAD; i++) {
		tags[i] = entry_hash(&in[i].entry, keys);
		prefetch_set(&sets[tags[i] & mask]);
	}
	for (i = 0; i < n; i++) {
		uint32_t tag = tags[i % IMPORT_AHEAD];
		int rc = XDPLB_IMPORT_BUSY;

		if (i + IMPORT_AHEAD < n) {
			tags[i % IMPORT_AHEAD] = entry_hash(&in[i + IMPORT_AHEAD].entry, keys);
			prefetch_set(&sets[tags[i % IMPORT_AHEAD] & mask]);
		}
		for (t = 0; t < tries && rc == XDPLB_IMPORT_BUSY; t++) {
			rc = sess_put(&sets[tag & mask], &in[i], tag, gen, now, timeouts, replace);
			if (rc == XDPLB_IMPORT_BUSY)
				backoff(t);
		}
		result[i] = rc;
		written += rc <= XDPLB_IMPORT_EVICTED;
	}
	return written;
}

/*
 * The flow's session as lb_xdp's lookup would find it, before its liveness is judged:
 * 0 with *out and *pos, 1 if no way holds it, -1 if its set kept being held.
 */
int xdplb_sess_get(void *base, uint32_t mask, uint32_t seed, const struct xdplb_flow_key *key,
		   uint32_t tries, struct xdplb_session *out, uint32_t *pos)
{
	struct xdplb_conn_set *sets = base, c;
	struct xdplb_conn_entry k = {};
	__u64 keys[XDPLB_SESS_KEYS];
	uint32_t tag, set, w;

	xdplb_sess_keys(seed, keys);
	tag = xdplb_sess_hash((const __u32 *)key, keys);
	set = tag & mask;

	memcpy(k.src, key->src, sizeof(k.src));
	memcpy(k.dst, key->dst, sizeof(k.dst));
	k.sport = key->sport;
	k.dport = key->dport;
	k.proto = key->proto;
	if (set_copy_tries(&sets[set], &c, tries))
		return -1;
	for (w = 0; w < SESS_WAYS; w++) {
		if ((c.meta.flags[w] & XDPLB_SESS_F_USED) && c.meta.tag[w] == tag &&
		    key_equal(&c.way[w], &k)) {
			session_of(&c, w, out);
			*pos = set * SESS_WAYS + w;
			return 0;
		}
	}
	return 1;
}
