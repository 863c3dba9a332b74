// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * hc_tc: TC egress (direct action) of the health-check device (an ifb) on the
 * LB node.  The daemon's checker connects to the VIP itself with SO_MARK
 * set; a policy rule routes marked traffic to that device, and here each
 * packet is encapsulated to the backend its mark names, with the outer
 * headers lb_xdp would write, then sent to the next hop.  So a check travels
 * the path real traffic takes and a backend whose decapsulation is broken
 * fails it (Katran's healthchecking_kern.c does the same).  The reply comes
 * from the VIP straight to our tunnel source: the ordinary socket gets it.
 *
 * Contract: docs/datapath.md, "hc_tc".  Python: src/xdplb/datapath/hc.py.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hc_maps.h"
#include "lib/hc_encap.h"

SEC("tc")
int hc_tc(struct __sk_buff *skb)
{
	const struct xdplb_hc_target *tgt;
	const struct xdplb_config *cfg;
	struct hc_pkt pkt = {};
	__u32 mark = skb->mark;
	__u32 zero = 0;
	__u32 hash;
	int v6;

	tgt = bpf_map_lookup_elem(&hc_targets, &mark);
	if (!tgt)
		return hc_drop(XDPLB_HC_DROP_UNKNOWN_MARK);
	if (hc_linearize(skb) < 0 || hc_parse(skb, &pkt) < 0)
		return hc_drop(XDPLB_HC_DROP_UNSUPPORTED);
	cfg = bpf_map_lookup_elem(&hc_config, &zero);
	v6 = tgt->family == XDPLB_FAMILY_V6;
	if (!cfg || !outer_has_src(cfg, v6))
		return hc_drop(XDPLB_HC_DROP_NO_CONFIG);
	/* Co-located: the tunnel would lead back here; not handled (yet). */
	if (outer_is_src(cfg, tgt->addr, v6))
		return hc_drop(XDPLB_HC_DROP_SELF);

	hash = hc_flow_hash(&pkt, tgt, cfg->hash_seed);
	if (v6) {
		if (tgt->encap == XDPLB_ENCAP_IPIP)
			return hc_encap(skb, &pkt, tgt, cfg, hash, 1, 0);
		return hc_encap(skb, &pkt, tgt, cfg, hash, 1, 1);
	}
	if (tgt->encap == XDPLB_ENCAP_IPIP)
		return hc_encap(skb, &pkt, tgt, cfg, hash, 0, 0);
	return hc_encap(skb, &pkt, tgt, cfg, hash, 0, 1);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
