/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Socket-level service balancing: the maps of bpf/sock_lb.bpf.c and the
 * logic of its hooks.  A connect() or sendmsg() to a service address is
 * rewritten to a backend chosen from the service's Maglev table, once per
 * socket, so no packet of the flow is ever translated (docs: sock_lb).
 *
 * Invariants the control plane keeps (src/xdplb/datapath/sock_lb.py):
 * - a table only names backends that were up when it was built, and is
 *   replaced whole, never rewritten in place;
 * - backend id 0 is never used, so a zeroed slot names no backend;
 * - a backend of a service has the service's family.
 */
#ifndef XDPLB_LIB_SOCK_LB_H
#define XDPLB_LIB_SOCK_LB_H

#include <linux/bpf.h>
#include <linux/in.h>
#include <stdbool.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "sock_lb_abi.h"

/* <sys/socket.h> is not for BPF: the two families we handle. */
#define SOCKLB_AF_INET		2
#define SOCKLB_AF_INET6		10

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, SOCKLB_MAX_SERVICES);
	__type(key, struct socklb_svc_key);
	__type(value, struct socklb_svc);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socklb_services SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, SOCKLB_MAX_BACKENDS);
	__type(key, __u32);
	__type(value, struct socklb_backend);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socklb_backends SEC(".maps");

/*
 * Service id -> its Maglev table (bucket -> backend id).  BPF_F_INNER_MAP on
 * the template lets each service's table have its own size; user space
 * creates every inner table with that flag too.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, SOCKLB_MAX_SERVICES);
	__type(key, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
	__array(values, struct {
		__uint(type, BPF_MAP_TYPE_ARRAY);
		__uint(max_entries, SOCKLB_DEFAULT_TABLE);
		__uint(map_flags, BPF_F_INNER_MAP);
		__uint(key_size, sizeof(__u32));
		__uint(value_size, sizeof(__u32));	/* backend id */
	});
} socklb_tables SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, SOCKLB_AFFINITY_ENTRIES);
	__type(key, struct socklb_aff_key);
	__type(value, struct socklb_aff);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socklb_affinity SEC(".maps");

/*
 * (socket cookie, backend) -> service, written at connect and sendmsg: the
 * kernel only knows the backend, and applications check that a reply comes
 * from the address they sent to.  LRU: entries of closed sockets age out.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, SOCKLB_REV_ENTRIES);
	__type(key, struct socklb_rev_key);
	__type(value, struct socklb_rev);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socklb_rev SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SOCKLB_EV__MAX);
	__type(key, enum socklb_event);	/* also puts the enum in the BTF */
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} socklb_events SEC(".maps");

static __always_inline void socklb_count(enum socklb_event ev)
{
	__u32 key = ev;
	__u64 *cnt = bpf_map_lookup_elem(&socklb_events, &key);

	if (cnt)
		*cnt += 1;
}

/* splitmix64's finaliser: socket cookies are sequential, buckets must not be. */
static __always_inline __u32 socklb_mix(__u64 x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return (__u32)x;
}

/* __builtin_memcmp would become a call to memcmp, which BPF does not have. */
static __always_inline bool socklb_addr_eq(const __u32 a[4], const __u32 b[4])
{
	return ((a[0] ^ b[0]) | (a[1] ^ b[1]) | (a[2] ^ b[2]) | (a[3] ^ b[3])) == 0;
}

static __always_inline struct socklb_backend *socklb_backend_up(__u32 id, __u8 family)
{
	struct socklb_backend *be;

	if (!id)
		return NULL;
	be = bpf_map_lookup_elem(&socklb_backends, &id);
	if (!be || !be->up || be->family != family)
		return NULL;
	return be;
}

/*
 * The backend of a new flow of @svc, or NULL when none is up.  The bucket is
 * the socket cookie's: connect() has no source port yet, and an unconnected
 * UDP socket then keeps one backend for all its datagrams.  With affinity,
 * a client (its network namespace) keeps its backend while it keeps using
 * the service at least once per affinity period and the backend stays up.
 */
static __always_inline struct socklb_backend *
socklb_pick(const struct socklb_svc *svc, __u64 cookie, __u64 netns, __u32 *be_id,
	    __u8 family)
{
	struct socklb_aff_key ak = {};
	struct socklb_backend *be;
	struct socklb_aff *aff;
	__u32 svc_id = svc->id;
	__u32 size = svc->table_size;
	__u64 span = svc->affinity_ns;
	__u64 now = 0;
	__u32 bucket;
	__u32 *slot;
	void *table;

	if (span) {
		ak.netns_cookie = netns;
		ak.svc_id = svc_id;
		now = bpf_ktime_get_ns();
		aff = bpf_map_lookup_elem(&socklb_affinity, &ak);
		if (aff && now - aff->last_ns <= span) {
			__u32 id = aff->backend_id;

			be = socklb_backend_up(id, family);
			if (be) {
				aff->last_ns = now;
				*be_id = id;
				socklb_count(SOCKLB_EV_AFFINITY_HIT);
				return be;
			}
		}
	}

	table = bpf_map_lookup_elem(&socklb_tables, &svc_id);
	if (!table || !size)
		return NULL;
	bucket = socklb_mix(cookie) % size;
	slot = bpf_map_lookup_elem(table, &bucket);
	if (!slot)
		return NULL;
	be = socklb_backend_up(*slot, family);
	if (!be)
		return NULL;
	*be_id = *slot;

	if (span) {
		struct socklb_aff v = { .last_ns = now, .backend_id = *slot };

		bpf_map_update_elem(&socklb_affinity, &ak, &v, BPF_ANY);
	}
	return be;
}

/*
 * An IPv4-mapped IPv6 address (::ffff:a.b.c.d), which a dual-stack IPv6
 * socket (IPV6_V6ONLY off, Java's default) uses for an IPv4 peer, is made
 * the IPv4 address it maps.  Returns the address's family from now on.
 */
static __always_inline __u8 socklb_unmap(__u32 addr[4], __u8 family)
{
	if (family != SOCKLB_FAMILY_V6 || addr[0] || addr[1] || addr[2] != bpf_htonl(0xffff))
		return family;
	addr[0] = addr[3];
	addr[1] = 0;
	addr[2] = 0;
	addr[3] = 0;
	return SOCKLB_FAMILY_V4;
}

/*
 * The address a sock_addr hook of @hook_family was given, in the ABI's form;
 * returns its family (IPv4 for a mapped address in an IPv6 hook).
 */
static __always_inline __u8 socklb_ctx_addr(const struct bpf_sock_addr *ctx, __u8 hook_family,
					    __u32 addr[4], __u16 *port)
{
	*port = (__u16)ctx->user_port;	/* network order in the low half */
	if (hook_family == SOCKLB_FAMILY_V4) {
		addr[0] = ctx->user_ip4;
		return SOCKLB_FAMILY_V4;
	}
	addr[0] = ctx->user_ip6[0];
	addr[1] = ctx->user_ip6[1];
	addr[2] = ctx->user_ip6[2];
	addr[3] = ctx->user_ip6[3];
	return socklb_unmap(addr, SOCKLB_FAMILY_V6);
}

/* An address of @family into a hook of @hook_family (mapped if they differ). */
static __always_inline void socklb_set_ctx_addr(struct bpf_sock_addr *ctx, __u8 hook_family,
						__u8 family, const __u32 addr[4], __u16 port)
{
	/* The context only takes 4-byte stores to these fields. */
	if (hook_family == SOCKLB_FAMILY_V4) {
		ctx->user_ip4 = addr[0];
	} else if (family == SOCKLB_FAMILY_V4) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0xffff);
		ctx->user_ip6[3] = addr[0];
	} else {
		ctx->user_ip6[0] = addr[0];
		ctx->user_ip6[1] = addr[1];
		ctx->user_ip6[2] = addr[2];
		ctx->user_ip6[3] = addr[3];
	}
	ctx->user_port = port;
}

/*
 * connect4/6 and sendmsg4/6: rewrite a service address to a backend's.
 * Returns the hook's verdict: 1 to go on, 0 to fail the call with EPERM
 * (a service with no backend up: better an error now than a connection to
 * an address nobody serves).
 */
static __always_inline int socklb_redirect(struct bpf_sock_addr *ctx, __u8 hook_family,
					   enum socklb_event ev)
{
	struct socklb_svc_key key = {};
	struct socklb_rev_key rk = {};
	struct socklb_rev rv = {};
	struct socklb_backend *be;
	struct socklb_svc *svc;
	struct socklb_rev *old;
	__u32 be_id = 0;
	__u64 cookie;
	__u8 family;

	family = socklb_ctx_addr(ctx, hook_family, key.addr, &key.port);
	key.proto = ctx->protocol;
	key.family = family;
	svc = bpf_map_lookup_elem(&socklb_services, &key);
	if (!svc)
		return 1;

	cookie = bpf_get_socket_cookie(ctx);
	be = socklb_pick(svc, cookie, bpf_get_netns_cookie(ctx), &be_id, family);
	if (!be) {
		socklb_count(SOCKLB_EV_NO_BACKEND);
		return 0;
	}

	rk.cookie = cookie;
	__builtin_memcpy(rk.addr, be->addr, sizeof(rk.addr));
	rk.port = be->port;
	rk.family = family;
	old = bpf_map_lookup_elem(&socklb_rev, &rk);
	/* An unconnected UDP socket sends many datagrams the same way: write once. */
	if (!old || old->backend_id != be_id || old->port != key.port ||
	    !socklb_addr_eq(old->addr, key.addr)) {
		__builtin_memcpy(rv.addr, key.addr, sizeof(rv.addr));
		rv.port = key.port;
		rv.family = family;
		rv.backend_id = be_id;
		if (bpf_map_update_elem(&socklb_rev, &rk, &rv, BPF_ANY))
			socklb_count(SOCKLB_EV_REV_FAILED);
	}

	socklb_set_ctx_addr(ctx, hook_family, family, be->addr, be->port);
	socklb_count(ev);
	return 1;
}

/*
 * recvmsg4/6 and getpeername4/6: a backend's address that this socket
 * reached through a service reads as the service's.  Always returns 1 (the
 * only verdict these hooks allow).
 */
static __always_inline int socklb_unredirect(struct bpf_sock_addr *ctx, __u8 hook_family,
					     enum socklb_event ev)
{
	struct socklb_rev_key rk = {};
	struct socklb_rev *rv;

	rk.family = socklb_ctx_addr(ctx, hook_family, rk.addr, &rk.port);
	rk.cookie = bpf_get_socket_cookie(ctx);
	rv = bpf_map_lookup_elem(&socklb_rev, &rk);
	if (!rv)
		return 1;
	socklb_set_ctx_addr(ctx, hook_family, rv->family, rv->addr, rv->port);
	socklb_count(ev);
	return 1;
}

/*
 * post_bind4/6: a local socket bound to a service address would take
 * traffic that clients in this cgroup never send there (it goes to the
 * backends), and would hijack the service for clients outside it: refuse
 * the bind (0: the kernel undoes it and returns EPERM).
 */
static __always_inline int socklb_check_bind(const struct bpf_sock *sk, __u8 family)
{
	struct socklb_svc_key key = {};

	if (family == SOCKLB_FAMILY_V4) {
		key.addr[0] = sk->src_ip4;
	} else {
		key.addr[0] = sk->src_ip6[0];
		key.addr[1] = sk->src_ip6[1];
		key.addr[2] = sk->src_ip6[2];
		key.addr[3] = sk->src_ip6[3];
	}
	key.port = bpf_htons((__u16)sk->src_port);	/* src_port is in host order */
	key.proto = sk->protocol;
	key.family = socklb_unmap(key.addr, family);
	if (!bpf_map_lookup_elem(&socklb_services, &key))
		return 1;
	socklb_count(SOCKLB_EV_BIND_REFUSED);
	return 0;
}

/*
 * Destroying connected UDP sockets of backends that went down (iter/udp).
 * There is no vmlinux.h here: the few kernel structs we read are declared
 * with preserve_access_index, and libbpf relocates their offsets (CO-RE).
 */
typedef struct {
	__s64 counter;
} socklb_atomic64_t;

struct sock_common {
	__be32 skc_daddr;
	__be16 skc_dport;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	struct {
		union {
			__u32 u6_addr32[4];
		} in6_u;
	} skc_v6_daddr;
	socklb_atomic64_t skc_cookie;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));

struct inet_sock {
	struct sock sk;
} __attribute__((preserve_access_index));

struct udp_sock {
	struct inet_sock inet;
} __attribute__((preserve_access_index));

struct bpf_iter_meta {
	void *seq;
} __attribute__((preserve_access_index));

struct bpf_iter__udp {
	struct bpf_iter_meta *meta;
	struct udp_sock *udp_sk;
} __attribute__((preserve_access_index));

/* Kernel 6.5+; only callable where the iterator holds the socket's lock. */
extern int bpf_sock_destroy(struct sock_common *sk) __ksym;

#define SOCKLB_TCP_ESTABLISHED	1	/* a connected UDP socket's state */

/*
 * Whether @skc is a UDP socket connected through a service to a backend that
 * is no longer up (or whose id now names another backend).  Unconnected
 * sockets never qualify: they choose per datagram and have no peer to lose.
 */
static __always_inline bool socklb_doomed(const struct sock_common *skc, __u64 *cookie)
{
	struct socklb_rev_key rk = {};
	struct socklb_backend *be;
	struct socklb_rev *rv;
	__u32 id;

	if (skc->skc_state != SOCKLB_TCP_ESTABLISHED)
		return false;
	if (skc->skc_family == SOCKLB_AF_INET) {
		rk.addr[0] = skc->skc_daddr;
		rk.family = SOCKLB_FAMILY_V4;
	} else if (skc->skc_family == SOCKLB_AF_INET6) {
		rk.addr[0] = skc->skc_v6_daddr.in6_u.u6_addr32[0];
		rk.addr[1] = skc->skc_v6_daddr.in6_u.u6_addr32[1];
		rk.addr[2] = skc->skc_v6_daddr.in6_u.u6_addr32[2];
		rk.addr[3] = skc->skc_v6_daddr.in6_u.u6_addr32[3];
		rk.family = socklb_unmap(rk.addr, SOCKLB_FAMILY_V6);
	} else {
		return false;
	}
	rk.port = skc->skc_dport;
	rk.cookie = skc->skc_cookie.counter;
	*cookie = rk.cookie;

	rv = bpf_map_lookup_elem(&socklb_rev, &rk);
	if (!rv)
		return false;	/* not connected through a service */
	id = rv->backend_id;
	be = bpf_map_lookup_elem(&socklb_backends, &id);
	if (be && be->up && be->port == rk.port &&
	    socklb_addr_eq(be->addr, rk.addr))
		return false;
	return true;
}

#endif /* XDPLB_LIB_SOCK_LB_H */
