/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Per-CPU counters: events, named drops, VIP and backend traffic.  Per-CPU
 * arrays need no atomics; user space sums the CPUs.
 */
#ifndef XDPLB_LIB_COUNTERS_H
#define XDPLB_LIB_COUNTERS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/lb_maps.h"

static __always_inline void lb_count_event(enum xdplb_event ev)
{
	__u64 *cnt = bpf_map_lookup_elem(&lb_events, &ev);

	if (cnt)
		*cnt += 1;
}

/*
 * lb_pass and lb_drop return the verdict with its event / reason above the
 * low byte, for capture.h; lb_xdp returns LB_VERDICT() of it to the kernel.
 */
#define LB_REASON_SHIFT	8
#define LB_VERDICT(rc)	((rc) & ((1 << LB_REASON_SHIFT) - 1))
#define LB_REASON(rc)	((__u32)(rc) >> LB_REASON_SHIFT)

/* Count an event and hand the packet to the kernel unchanged. */
static __always_inline int lb_pass(enum xdplb_event ev)
{
	lb_count_event(ev);
	return XDP_PASS | (ev << LB_REASON_SHIFT);
}

/* Every drop goes through here, under a named reason. */
static __always_inline int lb_drop(enum xdplb_drop_reason reason)
{
	__u64 *cnt = bpf_map_lookup_elem(&lb_drops, &reason);

	if (cnt)
		*cnt += 1;
	return XDP_DROP | (reason << LB_REASON_SHIFT);
}

/* Step 10: packets and inner IP bytes, plus new_flows on a table hit. */
static __always_inline void lb_count_traffic(__u32 vip_id, __u32 be_id,
					     __u32 ip_len, __u32 new_flow)
{
	struct xdplb_stats *st;

	st = bpf_map_lookup_elem(&lb_vip_stats, &vip_id);
	if (st) {
		st->packets += 1;
		st->bytes += ip_len;
		st->new_flows += new_flow;
	}
	st = bpf_map_lookup_elem(&lb_be_stats, &be_id);
	if (st) {
		st->packets += 1;
		st->bytes += ip_len;
		st->new_flows += new_flow;
	}
}

#endif /* XDPLB_LIB_COUNTERS_H */
