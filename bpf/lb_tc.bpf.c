// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lb_tc: the balancer at the TC hook (tcx or clsact ingress, direct action),
 * for veth, containers and traffic of the host itself, where XDP would copy
 * every frame out of its skb and lose its GSO and checksum state.  The same
 * decision as lb_xdp (lib/lb_run.h), the same maps (pinned by name), another
 * context (lib/hook.h).
 */
#define XDPLB_HOOK_TC 1

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "lib/lb_run.h"

/*
 * Headers the parse needs in the linear data: Ethernet, IPv6 with a few
 * extension headers, TCP with options.  A GSO or GRO skb keeps its payload
 * in pages; its headers are normally linear already, and pulled if not.
 */
#define LB_TC_PULL	192

/*
 * XDP action -> TC verdict.  PASS is TC_ACT_UNSPEC: the next program of the
 * hook (tcx) or the next filter (clsact), host_tc among them, still sees the
 * packet.  lb_tx() and lb_redirect() set the redirect's target already.
 */
static __always_inline int lb_tc_verdict(int action)
{
	switch (action) {
	case XDP_PASS:
		return TC_ACT_UNSPEC;
	case XDP_TX:
	case XDP_REDIRECT:
		return TC_ACT_REDIRECT;
	default:
		return TC_ACT_SHOT;
	}
}

SEC("tc")
int lb_tc(struct __sk_buff *ctx)
{
	void *data = lb_data(ctx);
	void *data_end = lb_data_end(ctx);
	struct lb_pkt pkt = {};
	int rc;

	if (data + LB_TC_PULL > data_end && ctx->len > data_end - data)
		bpf_skb_pull_data(ctx, ctx->len < LB_TC_PULL ? ctx->len : LB_TC_PULL);
	rc = lb_run(ctx, &pkt);
	lb_capture_end(ctx, &pkt, rc);
	return lb_tc_verdict(LB_VERDICT(rc));
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
