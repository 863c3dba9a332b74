// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * host_sk_lookup: an sk_lookup program attached to a network namespace.  It
 * steers new TCP connections and UDP datagrams for a prefix of addresses and
 * a set of ports, or every port, to one socket, whatever that socket is bound
 * to (Cloudflare's answer to bind() limits: one listener serves a whole /24
 * on every port).
 *
 * Rules live in an LPM trie keyed by (protocol, family, port, address): the
 * exact port is looked up first, then port 0, which stands for every port.
 * A rule names a slot of the sockmap; user space (datapath/sk_lookup.py) puts
 * the target socket there.  Nothing matched, or the socket is gone: the
 * kernel's own lookup runs as if this program were not there.
 *
 * Contract: docs/sockets.md, "sk_lookup steering".
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define SKL_MAX_RULES	4096
#define SKL_MAX_SOCKS	64
#define SKL_AF_INET	2
#define SKL_AF_INET6	10
/* The fields before the address: protocol, family and port are always matched. */
#define SKL_HEAD_BITS	32

/* Key of skl_rules; prefixlen counts SKL_HEAD_BITS plus the address prefix. */
struct skl_key {
	__u32 prefixlen;
	__u8 protocol;		/* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family;		/* AF_INET or AF_INET6 */
	__be16 port;		/* 0: every port */
	__u8 addr[16];		/* an IPv4 address in the first 4 bytes, the rest zero */
};

/* Value of skl_rules: the sockmap slot, and where its socket listens (for list). */
struct skl_target {
	__u32 slot;
	__u8 protocol;
	__u8 family;
	__be16 port;
	__u8 addr[16];
};

/* Every outcome of one lookup, counted per CPU; exported under the same names. */
enum skl_event {
	SKL_STEERED = 0,	/* assigned to the rule's socket */
	SKL_NO_RULE,		/* no rule for this destination: the kernel decides */
	SKL_NO_SOCKET,		/* a rule, but its socket is gone (closed) */
	SKL_ASSIGN_FAILED,	/* bpf_sk_assign refused (protocol or family mismatch) */
	SKL_EV__MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, SKL_MAX_RULES);
	__type(key, struct skl_key);
	__type(value, struct skl_target);
	__uint(map_flags, BPF_F_NO_PREALLOC);	/* an LPM trie must not preallocate */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_rules SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, SKL_MAX_SOCKS);
	__type(key, __u32);
	__type(value, __u64);	/* user space writes an fd, reads back the socket cookie */
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, SKL_EV__MAX);
	__type(key, enum skl_event);	/* also puts the enum in the BTF */
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} skl_events SEC(".maps");

static __always_inline void skl_count(enum skl_event ev)
{
	__u32 key = ev;
	__u64 *cnt = bpf_map_lookup_elem(&skl_events, &key);

	if (cnt)
		*cnt += 1;
}

SEC("sk_lookup")
int host_sk_lookup(struct bpf_sk_lookup *ctx)
{
	struct skl_key key = {};
	struct skl_target *t;
	struct bpf_sock *sk;
	__u32 slot;
	long err;

	key.protocol = ctx->protocol;
	key.family = ctx->family;
	key.port = bpf_htons(ctx->local_port);
	if (ctx->family == SKL_AF_INET) {
		__builtin_memcpy(key.addr, &ctx->local_ip4, 4);
		key.prefixlen = SKL_HEAD_BITS + 32;
	} else if (ctx->family == SKL_AF_INET6) {
		__u32 a0 = ctx->local_ip6[0], a1 = ctx->local_ip6[1];
		__u32 a2 = ctx->local_ip6[2], a3 = ctx->local_ip6[3];

		/* Word by word: the verifier rewrites each context load on its own. */
		__builtin_memcpy(key.addr, &a0, 4);
		__builtin_memcpy(key.addr + 4, &a1, 4);
		__builtin_memcpy(key.addr + 8, &a2, 4);
		__builtin_memcpy(key.addr + 12, &a3, 4);
		key.prefixlen = SKL_HEAD_BITS + 128;
	} else {
		skl_count(SKL_NO_RULE);
		return SK_PASS;
	}

	t = bpf_map_lookup_elem(&skl_rules, &key);
	if (!t) {
		key.port = 0;	/* a rule for every port of the prefix */
		t = bpf_map_lookup_elem(&skl_rules, &key);
	}
	if (!t) {
		skl_count(SKL_NO_RULE);
		return SK_PASS;
	}

	slot = t->slot;
	sk = bpf_map_lookup_elem(&skl_socks, &slot);
	if (!sk) {
		/* Closed sockets leave the sockmap by themselves. */
		skl_count(SKL_NO_SOCKET);
		return SK_PASS;
	}
	err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	if (err) {
		skl_count(SKL_ASSIGN_FAILED);
		return SK_PASS;
	}
	skl_count(SKL_STEERED);
	return SK_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
