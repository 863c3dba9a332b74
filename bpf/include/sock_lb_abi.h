/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * sock_lb: everything that crosses between bpf/sock_lb.bpf.c and
 * src/xdplb/datapath/sock_lb.py.  Every struct has explicit padding (a key
 * with an implicit hole loads, then never matches); the Python mirrors are
 * checked against this object's BTF by tests/bpf/test_sock_lb_abi.py.
 *
 * Addresses are four __u32 words in network order (an IPv4 address in the
 * first word, the rest zero) plus a family of 4 or 6; ports are in network
 * order.
 */
#ifndef SOCK_LB_ABI_H
#define SOCK_LB_ABI_H

#include <linux/types.h>

#define SOCKLB_MAX_SERVICES	256
#define SOCKLB_MAX_BACKENDS	4096	/* backend id 0 is never used */
#define SOCKLB_DEFAULT_TABLE	65537
#define SOCKLB_AFFINITY_ENTRIES	65536
#define SOCKLB_REV_ENTRIES	262144

/* The family field of every struct below (as in xdplb_abi.h). */
#define SOCKLB_FAMILY_V4	4
#define SOCKLB_FAMILY_V6	6

/* socklb_services key: what a client connects or sends to. */
struct socklb_svc_key {
	__u32 addr[4];
	__u16 port;
	__u8 proto;		/* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family;
};

struct socklb_svc {
	__u32 id;		/* index of its table in socklb_tables */
	__u32 table_size;	/* buckets of that table (a prime) */
	__u64 affinity_ns;	/* 0: no client affinity */
};

/* socklb_backends value, by backend id. */
struct socklb_backend {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 up;		/* 0: down or removed, never chosen */
};

/* Client affinity: the client is the socket's network namespace. */
struct socklb_aff_key {
	__u64 netns_cookie;
	__u32 svc_id;
	__u32 pad;
};

struct socklb_aff {
	__u64 last_ns;		/* bpf_ktime_get_ns of the last choice */
	__u32 backend_id;
	__u32 pad;
};

/* socklb_rev key: a socket (cookie) and the backend it was sent to. */
struct socklb_rev_key {
	__u64 cookie;
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad[5];
};

/* socklb_rev value: the service address the application asked for. */
struct socklb_rev {
	__u32 addr[4];
	__u16 port;
	__u8 family;
	__u8 pad;
	__u32 backend_id;
};

/* Index of socklb_events (per CPU). */
enum socklb_event {
	SOCKLB_EV_CONNECT = 0,		/* connect to a service rewritten */
	SOCKLB_EV_SENDMSG,		/* unconnected sendmsg rewritten */
	SOCKLB_EV_RECVMSG,		/* reply source put back to the service */
	SOCKLB_EV_PEERNAME,		/* getpeername put back to the service */
	SOCKLB_EV_AFFINITY_HIT,		/* backend taken from the affinity map */
	SOCKLB_EV_NO_BACKEND,		/* service without a usable backend: refused */
	SOCKLB_EV_BIND_REFUSED,		/* bind to a service address refused */
	SOCKLB_EV_REV_FAILED,		/* no room for a reverse entry */
	SOCKLB_EV_DESTROYED,		/* connected UDP socket to a down backend destroyed */
	SOCKLB_EV_DESTROY_FAILED,	/* bpf_sock_destroy returned an error */
	SOCKLB_EV__MAX,
};

#endif /* SOCK_LB_ABI_H */
