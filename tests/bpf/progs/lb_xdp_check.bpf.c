// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lb_xdp_check: lb_xdp (bpf/lb_xdp.bpf.c, compiled whole) with every session
 * hit checked against the VIP's table, for tests/bpf/test_concurrency.py.
 *
 * The test makes a flow's session a pure function of its key: every writer,
 * lb_xdp's inserts and user space's imports alike, records the backend and
 * hash lb_table_pick() gives the flow.  So a hit whose backend, hash or hop
 * count differs from what lb_table_pick() gives the packet now is a torn
 * session (one flow's key with another's fields).  lb_check counts, per CPU,
 * the hits checked and the mismatches.
 *
 * lb_xdp's one step-8 lookup is interposed by a macro defined just before the
 * source is included, so bpf/lb_xdp.bpf.c has nothing of the test; the
 * headers, included first, keep their own calls (ICMP errors, which the test
 * does not send).  The test checks that every CONN_HIT was checked: a lookup
 * that stopped coming through here would fail it, not pass it silently.
 * lb_xdp_noclaim.bpf.c and lb_xdp_novalidate.bpf.c include this file with a
 * part of the protocol taken out (lib/lb_conns.h): the builds the test must
 * catch.  Never loaded by xdplb.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/lb_select.h"
#include "lib/lb_icmp.h"

enum lb_check_counter {
	LB_CHECK_HITS = 0,	/* session hits checked */
	LB_CHECK_BAD,		/* ... whose session was not the table's answer */
	LB_CHECK__MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, LB_CHECK__MAX);
	__type(key, __u32);
	__type(value, __u64);
} lb_check SEC(".maps");

/* The table's answer, recomputed on a hit: per-CPU scratch (lb_xdp's frame is full). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct lb_target);
} lb_check_want SEC(".maps");

static __always_inline void lb_check_count(__u32 c)
{
	__u64 *cnt = bpf_map_lookup_elem(&lb_check, &c);

	if (cnt)
		*cnt += 1;
}

/* Step 8 as lb_xdp does it, then, on a hit: is the session what the table says? */
static __always_inline int lb_conn_lookup_checked(const struct lb_pkt *pkt,
						  const struct xdplb_vip_info *vip,
						  const struct xdplb_config *cfg,
						  struct xdplb_conn_set *cs, __u32 set, __u32 shash,
						  __u32 now, int syn, int touch, struct lb_sess *ss,
						  struct lb_target *tgt)
{
	int hit = lb_conn_lookup(pkt, vip, cfg, cs, set, shash, now, syn, touch, ss, tgt);
	struct lb_target *want;
	__u32 zero = 0;

	if (!hit)
		return hit;
	lb_check_count(LB_CHECK_HITS);
	want = bpf_map_lookup_elem(&lb_check_want, &zero);
	if (!want)
		return hit;
	__builtin_memset(want, 0, sizeof(*want));
	if (lb_table_pick(pkt, vip, cfg, want) >= 0 || want->be_id != tgt->be_id ||
	    want->hash != tgt->hash || want->nhops != tgt->nhops)
		lb_check_count(LB_CHECK_BAD);
	return hit;
}

#define lb_conn_lookup lb_conn_lookup_checked
#include "lb_xdp.bpf.c"
