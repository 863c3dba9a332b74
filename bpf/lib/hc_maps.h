/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Maps of hc_tc, pinned by name under the instance's pin root (".../hc"):
 * the daemon refills them across restarts without reloading the program.
 */
#ifndef XDPLB_LIB_HC_MAPS_H
#define XDPLB_LIB_HC_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"

/* Socket mark -> the backend its packets are tunnelled to. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPLB_MAX_HC_TARGETS);
	__type(key, __u32);
	__type(value, struct xdplb_hc_target);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hc_targets SEC(".maps");

/* hc_config[0]: lb_config's settings (outer sources, GUE port, hash seed). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xdplb_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hc_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_HC_EV__MAX);
	__type(key, enum xdplb_hc_event);	/* also puts the enum in the BTF */
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} hc_events SEC(".maps");

static __always_inline void hc_count(enum xdplb_hc_event ev)
{
	__u32 key = ev;
	__u64 *cnt = bpf_map_lookup_elem(&hc_events, &key);

	if (cnt)
		*cnt += 1;
}

#endif /* XDPLB_LIB_HC_MAPS_H */
