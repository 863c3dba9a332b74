/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The balancer's decision for one packet, numbered as in docs/datapath.md
 * (the contract), for both hooks: lb_xdp (bpf/lb_xdp.bpf.c) and lb_tc
 * (bpf/lb_tc.bpf.c) are thin entries around lb_run().
 */
#ifndef XDPLB_LIB_LB_RUN_H
#define XDPLB_LIB_LB_RUN_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/lb_maps.h"
#include "lib/counters.h"
#include "lib/lb_parse.h"
#include "lib/lb_select.h"
#include "lib/lb_acl.h"
#include "lib/lb_icmp.h"
#include "lib/encap.h"
#include "lib/capture.h"

/*
 * One packet, in either hook (hook.h).  The verdict is an XDP action, and
 * may carry its drop reason or pass event above the low byte (counters.h).
 */
static __always_inline int lb_run(struct lb_ctx *ctx, struct lb_pkt *pkt)
{
	const struct xdplb_vip_info *vip;
	const struct xdplb_config *cfg;
	struct lb_target tgt = {};
	struct xdplb_conn_set *cs = NULL;
	struct lb_cursor cur;
	struct lb_sess *ss;
	__u32 zero = 0;
	__u32 new_flow = 0, probe;
	__u32 shash = 0, set = 0, now;
	int rc;

	/* 1-2: Ethernet, IP, IPv6 extension headers; non-IP and malformed end here. */
	rc = lb_parse_ip(ctx, pkt, &cur);
	if (rc != LB_CONTINUE)
		return rc;

	/* 2': no VIP has this destination: nothing else to look at (lb_vip_filter) */
	if (!lb_maybe_vip_addr(pkt))
		return lb_pass(XDPLB_EV_PASS_NOT_VIP);

	/* Read once: the ACL's flags here, the rest from step 8 on (NULL: NO_CONFIG there). */
	cfg = bpf_map_lookup_elem(&lb_config, &zero);

	/* The self-check's probe: steps 6 and 9 only, nothing recorded or counted. */
	probe = cfg && lb_is_probe(ctx, cfg->probe_key);

	/* 2a: the global ACL, for any packet to a VIP address (lb_acl.h) */
	rc = probe ? LB_CONTINUE : lb_acl_global(pkt, cfg);
	if (rc != LB_CONTINUE)
		return rc;

	/* 3-5, 7: other protocols end here, fragments and ICMP take 4a-4c. */
	rc = lb_parse_l4(ctx, pkt, &cur);
	if (rc == LB_SLOW) {
		now = lb_now();
		rc = lb_icmp_frag(ctx, pkt, &cur, cfg, now, &vip, &tgt);
		if (rc != LB_CONTINUE)
			return rc;
		goto forward;
	}
	if (rc != LB_CONTINUE)
		return rc;

	/*
	 * 8's set, fetched before 6 (lb_sess_prefetch): the session hash picks
	 * the session table's set (the table's jhash is left to a miss), and its
	 * lines, cold for a new flow, come in while the VIP lookup runs.
	 */
	if (cfg) {
		shash = xdplb_sess_hash((const __u32 *)&pkt->flow, cfg->sess_key);
		set = shash & cfg->conn_mask;
		cs = bpf_map_lookup_elem(&lb_conns, &set);
		lb_sess_prefetch(cs);
	}

	/* 6, then 6a: the VIP's ACL */
	vip = lb_vip_lookup(pkt, cfg);
	if (!vip)
		return lb_pass(XDPLB_EV_PASS_NOT_VIP);
	if (probe) {
		rc = lb_table_pick(pkt, vip, cfg, &tgt);
		if (rc >= 0)
			return rc;
		goto encap;
	}
	rc = lb_acl_vip(pkt, vip);
	if (rc != LB_CONTINUE)
		return rc;

	if (!cfg)
		return lb_drop(XDPLB_DROP_NO_CONFIG);

	/*
	 * 8 (its set fetched above), then 9 on a miss or a session no longer
	 * live.  A TCP SYN starts a new connection and follows the table whatever
	 * an old session of the same 5-tuple says (a reused port must not reach a
	 * backend that has left the table since: down, drained, reweighted).
	 */
	now = lb_now();
	ss = lb_sess_slot();
	if (!ss)
		return lb_drop(XDPLB_DROP_NO_CONFIG);
	if (!lb_conn_lookup(pkt, vip, cfg, cs, set, shash, now, lb_is_syn(pkt), 1, ss, &tgt)) {
		/* 8a: a new flow over its source prefix's rate goes no further */
		if (lb_rate_applies(pkt) && lb_rate_limited(pkt, cfg))
			return lb_drop(XDPLB_DROP_RATE_LIMIT);
		rc = lb_table_lookup(pkt, vip, cfg, cs, set, ss, shash, now, &tgt);
		if (rc >= 0)
			return rc;
		new_flow = 1;
	}

forward:
	/* capture point FORWARD (capture.h): the client's frame, before step 11 */
	if (lb_capture_on())
		lb_capture_forward(ctx, pkt, vip->vip_id, &tgt, new_flow);

	/* 10 */
	lb_count_traffic(vip->vip_id, tgt.be_id, pkt->ip_len, new_flow);

encap:
	/*
	 * 11, 12: outer family is the backend's; sizes are constant per variant
	 * (family, GUE or not, hop count 1..XDPLB_MAX_HOPS).
	 */
	if (tgt.be->family == XDPLB_FAMILY_V6)
		return lb_encap_variant(ctx, pkt, &tgt, cfg, vip->encap, 1);
	return lb_encap_variant(ctx, pkt, &tgt, cfg, vip->encap, 0);
}

/*
 * The capture points DROP and PASS (capture.h), for the entry's verdict; a
 * forward was seen at its own.
 */
static __always_inline void lb_capture_end(struct lb_ctx *ctx, const struct lb_pkt *pkt, int rc)
{
	if ((LB_VERDICT(rc) == XDP_DROP || LB_VERDICT(rc) == XDP_PASS) && lb_capture_on())
		lb_capture_verdict(ctx, pkt, rc);
}

#endif /* XDPLB_LIB_LB_RUN_H */
