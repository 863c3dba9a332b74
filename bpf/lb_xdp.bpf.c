// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lb_xdp: tier-1 edge balancer at the XDP hook.  The decision is lb_run()
 * (lib/lb_run.h, numbered as docs/datapath.md), shared with lb_tc.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lib/lb_run.h"

SEC("xdp")
int lb_xdp(struct xdp_md *ctx)
{
	struct lb_pkt pkt = {};
	int rc = lb_run(ctx, &pkt);

	lb_capture_end(ctx, &pkt, rc);
	return LB_VERDICT(rc);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
