/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The maps of lb_xdp, exactly as in docs/datapath.md.  All are pinned by
 * name, so a restarted control plane finds them (and the connection table's
 * contents) under its pin root.  Names stay <= 15 characters (BPF_OBJ_NAME_LEN).
 * The max_entries below are defaults: the loader sets the configured sizes
 * (config "limits:", src/xdplb/limits.py) by map name before creating them.
 */
#ifndef XDPLB_LIB_LB_MAPS_H
#define XDPLB_LIB_LB_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"

/* (address, port, proto) -> VIP; a port-0 entry is the VIP's wildcard. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2 * XDPLB_MAX_VIPS);
	__type(key, struct xdplb_vip_key);
	__type(value, struct xdplb_vip_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vips SEC(".maps");

/* Every VIP address, for packets whose port is unknown (fragments, ICMP, truncated L4). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, XDPLB_MAX_VIP_ADDRS);
	__type(key, struct xdplb_addr);
	__type(value, struct xdplb_vip_addr_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vip_addrs SEC(".maps");

/*
 * BTF anchor for struct xdplb_bucket: the program only reaches it through
 * lb_btables' inner template, where clang 14 emits a bare FWD, so without this
 * the object would not describe the layout tests/bpf/test_abi.py checks.
 * libbpf skips unknown data sections: nothing is loaded for it.
 */
struct xdplb_bucket xdplb_btf_bucket SEC(".xdplb_btf") __attribute__((used));

/* Backend id -> tunnel endpoint.  Slot 0 is never a backend: 0 means "none". */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XDPLB_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct xdplb_backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_backends SEC(".maps");

/*
 * VIP id -> its lookup table, one outer map per table kind: lb_tables for
 * Maglev (a bucket is one backend id) and lb_btables for Beamer (a bucket is
 * a struct xdplb_bucket of XDPLB_MAX_HOPS ids); vip ids are unique across
 * both.  A VIP's table_kind says which map holds its table.  A table is
 * replaced as a whole, never rewritten in place.  The inner templates have
 * BPF_F_INNER_MAP so each VIP's table may have its own size; the
 * kernel then compares type, flags, key and value size only, so user space
 * must create inner tables with BPF_F_INNER_MAP as well.  Sizes, not
 * __type(): clang 14 emits only a FWD for a struct named inside
 * __array(values, ...), and libbpf refuses that.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, XDPLB_MAX_VIPS);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_ARRAY);
		__uint(max_entries, XDPLB_DEFAULT_TABLE);
		__uint(map_flags, BPF_F_INNER_MAP);
		__uint(key_size, sizeof(__u32));
		__uint(value_size, sizeof(__u32));	/* backend id */
	});
} lb_tables SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, XDPLB_MAX_VIPS);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_ARRAY);
		__uint(max_entries, XDPLB_DEFAULT_TABLE);
		__uint(map_flags, BPF_F_INNER_MAP);
		__uint(key_size, sizeof(__u32));
		__uint(value_size, sizeof(struct xdplb_bucket));
	});
} lb_btables SEC(".maps");

/*
 * 5-tuple -> backend: a set-associative cache (struct xdplb_conn_set,
 * lib/lb_conns.h).  An ARRAY, not an LRU_HASH: an insert into a full LRU
 * touches several cold nodes (~490 ns here); here it touches the set's first
 * line and the victim way's key line.  BPF_F_MMAPABLE only for the layout:
 * it page-aligns the values, so a set's lines are the cache's lines.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XDPLB_CONN_SETS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct xdplb_conn_set);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_conns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xdplb_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_MAX_VIPS);
	__type(key, __u32);
	__type(value, struct xdplb_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vip_stats SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct xdplb_stats);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_be_stats SEC(".maps");

/* Drop reason -> packets dropped for it.  Enum keys put the names in the BTF. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_DROP__MAX);
	__type(key, enum xdplb_drop_reason);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_drops SEC(".maps");

/* Event -> packets that took that path. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDPLB_EV__MAX);
	__type(key, enum xdplb_event);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_events SEC(".maps");

#endif /* XDPLB_LIB_LB_MAPS_H */
