// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * host_reuseport: the sk_reuseport program of one service's SO_REUSEPORT
 * group, for zero-downtime restarts (bpf_sk_reuseport, LPC 2021).  Each
 * generation of the server owns a slot of sockets; new TCP connections and
 * new UDP flows go to the ready generation, known UDP flows stay with the
 * generation that had them until it retires, and requests queued in a
 * closing listener (md->migrating_sk, BPF_SK_REUSEPORT_SELECT_OR_MIGRATE)
 * move to the ready generation instead of being reset.
 *
 * The program never drops: whenever it cannot choose, the kernel's own hash
 * selection runs, counted under a named event.
 *
 * Contract: docs/sockets.md, "Generations with sk_reuseport".
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "reuseport_abi.h"
#include "lib/reuseport.h"

SEC("sk_reuseport/migrate")
int host_reuseport(struct sk_reuseport_md *md)
{
	struct rp_view v = {};

	if (rp_read_state(&v) < 0) {
		rp_count(RP_EV_NO_GENERATION);
		return SK_PASS;
	}
	if (md->ip_protocol == RP_IPPROTO_UDP)
		return rp_udp(md, &v);
	return rp_tcp(md, &v);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
