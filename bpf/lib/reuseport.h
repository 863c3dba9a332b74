/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Generations of one SO_REUSEPORT group: which slot a new flow, a known UDP
 * flow or a migrating TCP request goes to.  The maps are pinned by name
 * under the service's pin directory, so every process of the service (old
 * and new generation, supervisor) shares them.
 */
#ifndef XDPLB_LIB_REUSEPORT_H
#define XDPLB_LIB_REUSEPORT_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "reuseport_abi.h"

#define RP_IPPROTO_TCP	6
#define RP_IPPROTO_UDP	17
/* Offsets of the source address in the IPv4 and IPv6 headers. */
#define RP_IP4_SADDR	12
#define RP_IP6_SADDR	8

struct {
	__uint(type, BPF_MAP_TYPE_REUSEPORT_SOCKARRAY);
	__uint(max_entries, RP_SOCKS);
	__type(key, __u32);
	__type(value, __u64);	/* a socket fd written, its cookie read back */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rp_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct rp_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rp_state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, RP_FLOWS);
	__type(key, struct rp_flow_key);
	__type(value, struct rp_flow);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rp_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, RP_MAX_CPUS * RP_SLOTS);
	__type(key, __u32);
	__type(value, __u32);	/* 1 + socket index; 0: none */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rp_cpu_pref SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, RP_EV__MAX);
	__type(key, enum rp_event);	/* also puts the enum in the BTF */
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rp_events SEC(".maps");

/* What one run needs of rp_state, copied out under its lock. */
struct rp_view {
	__u64 flow_idle_ns;
	__u32 ready_slot;
	__u32 gen[RP_SLOTS];
	__u32 socks[RP_SLOTS];
	__u32 state[RP_SLOTS];
};

static __always_inline void rp_count(enum rp_event ev)
{
	__u32 key = ev;
	__u64 *cnt = bpf_map_lookup_elem(&rp_events, &key);

	if (cnt)
		*cnt += 1;
}

/* A consistent copy of the state: user space writes it whole under the lock. */
static __always_inline int rp_read_state(struct rp_view *v)
{
	__u32 zero = 0;
	struct rp_state *st = bpf_map_lookup_elem(&rp_state, &zero);

	if (!st)
		return -1;
	bpf_spin_lock(&st->lock);
	v->flow_idle_ns = st->flow_idle_ns;
	v->ready_slot = st->ready_slot;
#pragma unroll
	for (int i = 0; i < RP_SLOTS; i++) {
		v->gen[i] = st->slots[i].generation;
		v->socks[i] = st->slots[i].socks;
		v->state[i] = st->slots[i].state;
	}
	bpf_spin_unlock(&st->lock);
	return 0;
}

static __always_inline int rp_live(const struct rp_view *v, __u32 slot)
{
	return slot < RP_SLOTS && v->state[slot] != RP_SLOT_FREE && v->socks[slot] > 0 &&
	       v->socks[slot] <= RP_SOCKS_PER_SLOT;
}

/*
 * Where new flows go: the ready generation; while none is ready, the oldest
 * live one (the first server, or an old one whose successor is not ready).
 * RP_NO_SLOT when no generation has a socket.
 */
static __always_inline __u32 rp_default_slot(const struct rp_view *v)
{
	__u32 best = RP_NO_SLOT, best_gen = 0;

	if (rp_live(v, v->ready_slot) && v->state[v->ready_slot & (RP_SLOTS - 1)] == RP_SLOT_READY)
		return v->ready_slot;
#pragma unroll
	for (__u32 i = 0; i < RP_SLOTS; i++) {
		if (rp_live(v, i) && (best == RP_NO_SLOT || v->gen[i] < best_gen)) {
			best = i;
			best_gen = v->gen[i];
		}
	}
	return best;
}

static __always_inline int rp_select(struct sk_reuseport_md *md, __u32 slot, __u32 index)
{
	__u32 key = slot * RP_SOCKS_PER_SLOT + index;

	return bpf_sk_select_reuseport(md, &rp_socks, &key, 0);
}

/*
 * The socket of a slot for a new flow: the one preferred on this CPU (its
 * worker runs here, so the flow's data stays in this CPU's cache), else the
 * flow hash's, stable while the slot's size is.
 */
static __always_inline __u32 rp_index(const struct rp_view *v, __u32 slot, __u32 hash)
{
	__u32 n = v->socks[slot & (RP_SLOTS - 1)];
	__u32 key = bpf_get_smp_processor_id() * RP_SLOTS + slot;
	__u32 *pref = bpf_map_lookup_elem(&rp_cpu_pref, &key);

	if (pref && *pref && *pref <= n)
		return *pref - 1;
	return n ? hash % n : 0;
}

/* The remote end of a UDP datagram; md->data is at the UDP header. */
static __always_inline int rp_flow_key(struct sk_reuseport_md *md, struct rp_flow_key *k)
{
	__be16 ports[2];

	if (bpf_skb_load_bytes(md, 0, ports, sizeof(ports)) < 0)
		return -1;
	k->remote_port = ports[0];
	k->local_port = ports[1];
	if (md->eth_protocol == bpf_htons(ETH_P_IP)) {
		k->family = 4;
		return bpf_skb_load_bytes_relative(md, RP_IP4_SADDR, k->addr, 4,
						   BPF_HDR_START_NET);
	}
	if (md->eth_protocol == bpf_htons(ETH_P_IPV6)) {
		k->family = 6;
		return bpf_skb_load_bytes_relative(md, RP_IP6_SADDR, k->addr, 16,
						   BPF_HDR_START_NET);
	}
	return -1;
}

/* A new TCP connection, or a request of a closing listener being migrated. */
static __always_inline int rp_tcp(struct sk_reuseport_md *md, const struct rp_view *v)
{
	int migrating = md->migrating_sk != 0;
	__u32 slot = rp_default_slot(v);

	if (slot == RP_NO_SLOT) {
		rp_count(migrating ? RP_EV_MIGRATE_FAILED : RP_EV_NO_GENERATION);
		return SK_PASS;
	}
	if (rp_select(md, slot, rp_index(v, slot, md->hash)) < 0) {
		rp_count(migrating ? RP_EV_MIGRATE_FAILED : RP_EV_SELECT_FAILED);
		return SK_PASS;
	}
	rp_count(migrating ? RP_EV_MIGRATED : RP_EV_TCP_SELECT);
	return SK_PASS;
}

/*
 * A UDP datagram: a known flow stays with the generation that first had it,
 * as long as that generation lives and the flow is not idle; anything else
 * goes to the default slot and is remembered there.
 */
static __always_inline int rp_udp(struct sk_reuseport_md *md, const struct rp_view *v)
{
	struct rp_flow_key key = {};
	struct rp_flow *known, fresh = {};
	__u64 now = bpf_ktime_get_ns();
	enum rp_event ev = RP_EV_NEW_FLOW;
	__u32 slot;

	if (rp_flow_key(md, &key) < 0) {
		slot = rp_default_slot(v);
		if (slot == RP_NO_SLOT || rp_select(md, slot, rp_index(v, slot, md->hash)) < 0)
			rp_count(RP_EV_SELECT_FAILED);
		else
			rp_count(RP_EV_NO_HEADER);
		return SK_PASS;
	}

	known = bpf_map_lookup_elem(&rp_flows, &key);
	if (known) {
		__u32 s = known->slot & (RP_SLOTS - 1);

		if (known->slot < RP_SLOTS && rp_live(v, s) && v->gen[s] == known->generation &&
		    now - known->last_ns < v->flow_idle_ns &&
		    rp_select(md, s, known->index) == 0) {
			known->last_ns = now;
			rp_count(RP_EV_FLOW_HIT);
			return SK_PASS;
		}
		ev = RP_EV_FLOW_MOVED;
	}

	slot = rp_default_slot(v);
	if (slot == RP_NO_SLOT) {
		rp_count(RP_EV_NO_GENERATION);
		return SK_PASS;
	}
	fresh.slot = slot;
	fresh.generation = v->gen[slot & (RP_SLOTS - 1)];
	fresh.index = rp_index(v, slot, md->hash);
	fresh.last_ns = now;
	if (rp_select(md, slot, fresh.index) < 0) {
		rp_count(RP_EV_SELECT_FAILED);
		return SK_PASS;
	}
	bpf_map_update_elem(&rp_flows, &key, &fresh, BPF_ANY);
	rp_count(ev);
	return SK_PASS;
}

#endif /* XDPLB_LIB_REUSEPORT_H */
