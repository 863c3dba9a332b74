// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * host_tc: TC ingress (direct action) on a backend host.  Decapsulates GUE
 * and IPIP / IP6IP6 / 4in6 / 6in4 packets addressed to this host, in BPF,
 * because the target kernels may have no ipip, fou or gre modules.  The
 * inner packet goes up the stack to the VIP on the loopback, and the reply
 * goes straight to the client (direct server return).
 *
 * A GUE packet of a TCP connection that no local socket owns is forwarded to
 * the next hop of its hop list instead (daisy chaining, lib/host_chain.h).
 *
 * Contract: docs/datapath.md, "host_tc".
 */
#include <linux/bpf.h>
#include <linux/if_packet.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/host_maps.h"
#include "lib/host_decap.h"
#include "lib/host_chain.h"

SEC("tc")
int host_tc(struct __sk_buff *skb)
{
	struct host_tunnel t = {};

	/* Out of memory: leave the packet to the kernel rather than drop it. */
	if (host_linearize(skb) < 0) {
		host_count(XDPLB_HOST_PASS);
		return TC_ACT_OK;
	}

	switch (host_parse(skb, &t)) {
	case HOST_V_PASS:
		host_count(XDPLB_HOST_PASS);
		return TC_ACT_OK;
	case HOST_V_MALFORMED:
		/* Addressed to our tunnel endpoint but unusable: nobody else wants it. */
		host_count(XDPLB_HOST_DROP_MALFORMED);
		return TC_ACT_SHOT;
	case HOST_V_DECAP:
		break;
	}

	/* Only GUE carries a hop list; IPIP is always for this host. */
	if (t.event == XDPLB_HOST_DECAP_GUE) {
		struct xdplb_addr hop = {};
		__u32 ev = host_chain_decide(skb, &t, &hop);

		if (ev == XDPLB_HOST_FORWARD) {
			int rc = host_chain_forward(skb, &t, &hop);

			if (rc >= 0) {
				host_count(XDPLB_HOST_FORWARD);
				return rc;
			}
			/* Better a reset from us than a silent drop. */
			ev = XDPLB_HOST_FORWARD_FAILED;
		}
		host_count(ev);
	}

	if (host_segment_via_lo(skb, &t))
		return bpf_redirect(HOST_LOOPBACK_IFINDEX, 0);

	if (host_decap(skb, &t) < 0) {
		host_count(XDPLB_HOST_DROP_DECAP);
		return TC_ACT_SHOT;
	}
	/*
	 * On lo, a datagram of a packet sent there to be segmented: lo took the
	 * frame's destination MAC, the NIC's, for another host's.
	 */
	if (skb->ifindex == HOST_LOOPBACK_IFINDEX)
		bpf_skb_change_type(skb, PACKET_HOST);
	host_count(t.event);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
