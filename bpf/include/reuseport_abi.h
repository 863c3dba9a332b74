/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * host_reuseport: everything that crosses between bpf/host_reuseport.bpf.c and
 * src/xdplb/sockets/reuseport.py.  Every struct has explicit padding (a key
 * with an implicit hole loads, then never matches); the Python mirrors are
 * checked against this object's BTF by tests/unit/test_reuseport_abi.py.
 *
 * A service's generations live in RP_SLOTS slots; slot s owns the sockarray
 * keys s * RP_SOCKS_PER_SLOT .. + RP_SOCKS_PER_SLOT - 1, filled from the
 * first one up.  rp_cpu_pref[cpu * RP_SLOTS + slot] is 1 + the index of the
 * slot's socket that new flows arriving on that CPU go to, 0 for none (the
 * flow hash chooses).
 */
#ifndef REUSEPORT_ABI_H
#define REUSEPORT_ABI_H

#include <linux/types.h>

#define RP_SLOTS		4
#define RP_SOCKS_PER_SLOT	64
#define RP_SOCKS		(RP_SLOTS * RP_SOCKS_PER_SLOT)
#define RP_FLOWS		65536
/* CPUs a socket can be preferred on: rp_cpu_pref has RP_MAX_CPUS * RP_SLOTS entries. */
#define RP_MAX_CPUS		128
/* rp_state.ready_slot when no generation is ready. */
#define RP_NO_SLOT		0xffffffff

enum rp_slot_state {
	RP_SLOT_FREE = 0,	/* no generation (never used, or retired) */
	RP_SLOT_STARTING,	/* begun, not ready: selected only while none is ready */
	RP_SLOT_READY,		/* the ready one: new TCP connections and UDP flows */
	RP_SLOT_OLD,		/* superseded by a newer ready one: keeps its known UDP flows */
};

struct rp_slot {
	__u32 generation;	/* generation number; 0 in a slot never used */
	__u32 socks;		/* sockets in the slot, at keys 0 .. socks - 1 of it */
	enum rp_slot_state state;	/* 4 bytes, as a __u32 */
	__u32 pad;
};

/* The one entry of rp_state.  Read and written whole under its lock (BPF_F_LOCK
 * from user space), so the program never sees half of a transition. */
struct rp_state {
	struct bpf_spin_lock lock;
	__u32 ready_slot;	/* RP_NO_SLOT: none ready */
	__u32 next_generation;	/* the number the next begin() takes */
	__u32 pad;
	__u64 flow_idle_ns;	/* a UDP flow unseen this long is a new flow */
	struct rp_slot slots[RP_SLOTS];
};

/* rp_flows key: a UDP flow as this host sees it (remote end, local port). */
struct rp_flow_key {
	__u32 addr[4];		/* remote address, network order; IPv4 in addr[0] */
	__u16 remote_port;	/* network order */
	__u16 local_port;	/* network order */
	__u8 family;		/* 4 or 6 */
	__u8 pad[3];
};

struct rp_flow {
	__u64 last_ns;		/* bpf_ktime_get_ns of its last datagram */
	__u32 slot;
	__u32 generation;	/* a slot reused by a later generation is not ours */
	__u32 index;		/* socket index within the slot */
	__u32 pad;
};

/* Every outcome of one run, counted per CPU; exported under the same names. */
enum rp_event {
	RP_EV_FLOW_HIT = 0,	/* UDP: a known flow, sent to its generation's socket */
	RP_EV_NEW_FLOW,		/* UDP: an unknown flow, remembered */
	RP_EV_FLOW_MOVED,	/* UDP: a known flow whose entry was idle or whose
				 * generation retired, remembered anew */
	RP_EV_TCP_SELECT,	/* TCP: a new connection (SYN) */
	RP_EV_MIGRATED,		/* TCP: a request of a closing listener moved */
	RP_EV_NO_GENERATION,	/* no live generation: the kernel's own choice */
	RP_EV_SELECT_FAILED,	/* the chosen socket is gone: the kernel's own choice */
	RP_EV_MIGRATE_FAILED,	/* migration found no socket: the kernel's own choice */
	RP_EV_NO_HEADER,	/* addresses unreadable: selected by hash, not remembered */
	RP_EV__MAX,
};

#endif /* REUSEPORT_ABI_H */
