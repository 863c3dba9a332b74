/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Maps of host_tc, pinned by name under the instance's pin root so that the
 * control plane can refill them without reloading the program.
 */
#ifndef XDPLB_LIB_HOST_MAPS_H
#define XDPLB_LIB_HOST_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xdplb_host_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_config SEC(".maps");

/* Every address of this host that a balancer may tunnel to; value unused (1). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPLB_MAX_HOST_ADDRS);
	__type(key, struct xdplb_addr);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_addrs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_HOST_EV__MAX);
	__type(key, enum xdplb_host_event);	/* also puts the enum in the BTF */
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} host_events SEC(".maps");

static __always_inline void host_count(enum xdplb_host_event ev)
{
	__u32 key = ev;
	__u64 *cnt = bpf_map_lookup_elem(&host_events, &key);

	if (cnt)
		*cnt += 1;
}

#endif /* XDPLB_LIB_HOST_MAPS_H */
