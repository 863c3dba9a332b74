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

/*
 * (address, port, proto) -> VIP; a port-0 entry is the VIP's wildcard.  The
 * control plane's record: the program reads lb_vip_index, built from it.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 2 * XDPLB_MAX_VIPS);
	__type(key, struct xdplb_vip_key);
	__type(value, struct xdplb_vip_info);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vips SEC(".maps");

/*
 * The VIPs again, as the program reads them (struct xdplb_vip_slot in
 * xdplb_abi.h): two tables of lb_config.vip_index_mask + 1 slots, back to
 * back; lb_vip_sel[0] & 1 says which one is live.  User space writes the other
 * one whole, then flips lb_vip_sel (docs/datapath.md, step 6).  Plain ARRAYs:
 * their lookups are inlined, where a map-in-map's inner lookup is a call.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2 * 8 * XDPLB_MAX_VIPS);
	__type(key, __u32);
	__type(value, struct xdplb_vip_slot);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vip_index SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vip_sel SEC(".maps");

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
/* Likewise for what only user space reads: the ABI version, the export record, the states. */
enum xdplb_abi xdplb_btf_abi SEC(".xdplb_btf") __attribute__((used));
struct xdplb_export_rec xdplb_btf_export SEC(".xdplb_btf") __attribute__((used));
enum xdplb_sess_state xdplb_btf_sess_state SEC(".xdplb_btf") __attribute__((used));
enum xdplb_member_state xdplb_btf_member SEC(".xdplb_btf") __attribute__((used));

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
 * 5-tuple -> session: a set-associative table of sets of 4 sessions (struct
 * xdplb_conn_set, lib/lb_conns.h): a metadata line, then a line per way.  An
 * ARRAY, not an LRU_HASH: an insert into a full LRU touches several cold
 * nodes (~490 ns here); here a miss reads one line and an insert writes one
 * more.  BPF_F_MMAPABLE page-aligns the values, so that every line is a
 * cache line, and lets user space read and import sessions with the same
 * claim protocol (datapath/conns.py).
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XDPLB_CONN_SETS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct xdplb_conn_set);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_conns SEC(".maps");

/*
 * New sessions and state changes, for session sync (struct xdplb_export_rec),
 * while lb_config has XDPLB_CFG_F_EXPORT.  A record the ring has no room for
 * is counted (EXPORT_DROP), never waited for.
 */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, XDPLB_EXPORT_RING_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_sess_export SEC(".maps");

/*
 * VIP id -> its members' states (enum xdplb_member_state, two bits per backend
 * id in __u64 words), replaced as a whole like a table.  Read for UDP hits.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, XDPLB_MAX_VIPS);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_ARRAY);
		__uint(max_entries, XDPLB_MAX_BACKENDS / XDPLB_MEMBERS_PER_WORD);
		__uint(map_flags, BPF_F_INNER_MAP);
		__uint(key_size, sizeof(__u32));
		__uint(value_size, sizeof(__u64));
	});
} lb_members SEC(".maps");

/* One bit per hash of a VIP address (xdplb_addr_filter_bit): clear is "no VIP here". */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, XDPLB_VIP_FILTER_WORDS);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_vip_filter SEC(".maps");

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
