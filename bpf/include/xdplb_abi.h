/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The one ABI header: every struct, enum and flag that crosses between the
 * BPF programs and Python is defined here, with explicit padding.  Keys with
 * implicit padding load but never match at run time (KERNEL_NOTES.md), so
 * every key is padded by hand and zeroed on both sides.
 *
 * Python mirror: src/xdplb/abi.py, checked against this object's BTF by
 * tests/bpf/test_abi.py.  Addresses and ports are stored in network order.
 */
#ifndef XDPLB_ABI_H
#define XDPLB_ABI_H

#include <linux/types.h>

/*
 * The layout version of lb_xdp's pinned maps: they live under <pin root>/abi-<N>
 * (docs/operations.md, "Upgrades").  Any change to a struct a pinned map holds
 * bumps it; the daemon then migrates the session table into the new layout.
 */
enum xdplb_abi {
#if defined(XDPLB_ABI_TEST_NEXT) || defined(XDPLB_ABI_TEST_BAD)
	XDPLB_ABI_VERSION = 4,	/* test builds only (Makefile: build/test/lb_xdp_abi_*.bpf.o) */
#else
	XDPLB_ABI_VERSION = 3,	/* 3: lb_config.sess_key (a session's set moved) */
#endif
};

/*
 * Test builds of another layout, for the upgrade tests (tests/bpf/test_upgrade.py,
 * tests/e2e/test_upgrade_lab.py); never shipped.  XDPLB_ABI_TEST_NEXT: the next layout
 * as a release would make it, a field added to the session entry.  XDPLB_ABI_TEST_BAD:
 * a layout the migration cannot read, a key field renamed (everywhere in the program,
 * so that it still builds).
 */
#ifdef XDPLB_ABI_TEST_BAD
#define dport dport_renamed
#endif

/* Default map sizes; the loader sets the configured ones (config limits:). */
#define XDPLB_MAX_VIPS		512
#define XDPLB_MAX_BACKENDS	4096
#define XDPLB_MAX_HOPS		4	/* first hop + three previous owners (Beamer) */
#define XDPLB_CONN_ENTRIES	262144
#define XDPLB_CONN_WAYS		4
#define XDPLB_CONN_SETS		(XDPLB_CONN_ENTRIES / XDPLB_CONN_WAYS)	/* a power of 2 */
#define XDPLB_DEFAULT_TABLE	65537
#define XDPLB_GUE_PORT		19523	/* glb-director's default */
#define XDPLB_SESS_KEYS		10	/* the flow key's words: one session-hash multiplier each */
#define XDPLB_MAX_HOST_ADDRS	64
#define XDPLB_MAX_VIP_ADDRS	XDPLB_MAX_VIPS

/* Address family tags used in keys (not AF_*: they fit a byte and read well). */
enum xdplb_family {
	XDPLB_FAMILY_V4 = 4,
	XDPLB_FAMILY_V6 = 6,
};

/* How a VIP's packets reach the chosen backend. */
enum xdplb_encap {
	XDPLB_ENCAP_GUE = 0,	/* outer IP + UDP + GUE with glb-director's hop list */
	XDPLB_ENCAP_IPIP = 1,	/* outer IP only (IPIP, IP6IP6, 4in6, 6in4) */
};

/* Which lookup table a VIP uses. */
enum xdplb_table_kind {
	XDPLB_TABLE_MAGLEV = 0,	/* one hop per bucket */
	XDPLB_TABLE_BEAMER = 1,	/* first hop + previous owners per bucket */
};

#define XDPLB_VIP_F_SRC_HASH	(1U << 0)	/* hash the source address only */

#define XDPLB_BACKEND_F_ACTIVE	(1U << 0)	/* slot holds a live backend */

/* lb_vips key: (address, port, protocol).  port == 0 is the wildcard entry. */
struct xdplb_vip_key {
	__u32 addr[4];		/* IPv4 in addr[0], addr[1..3] zero */
	__be16 port;
	__u8 proto;		/* IPPROTO_TCP or IPPROTO_UDP */
	__u8 family;		/* enum xdplb_family */
};

/* lb_vips value. */
struct xdplb_vip_info {
	__u32 vip_id;		/* index into lb_tables / lb_btables and lb_vip_stats */
	__u32 flags;		/* XDPLB_VIP_F_* */
	__u32 table_size;	/* number of buckets of this VIP's table */
	__u8 encap;		/* enum xdplb_encap */
	__u8 table_kind;	/* enum xdplb_table_kind */
	__u8 pad[2];
};

/*
 * lb_vip_index: the VIPs of lb_vips as open-addressed tables of
 * xdplb_config.vip_index_mask + 1 slots, two of them back to back (the live one
 * is lb_vip_sel[0] & 1), rebuilt by user space whenever lb_vips changes.  A key
 * lives in the first free slot from xdplb_vip_slot_hash(key) & mask on, at most
 * XDPLB_VIP_PROBES slots on; a slot with family 0 ends the search.  The program
 * reads this, not lb_vips: inlined array lookups and a compare instead of a hash
 * map's call and jhash (steps 4a, 4b, 6).
 */
struct xdplb_vip_slot {
	struct xdplb_vip_key key;	/* family 0: an empty slot */
	struct xdplb_vip_info info;
};

#define XDPLB_VIP_PROBES	16

/* lb_backends value, indexed by backend id.  Slot 0 is never a backend: 0 means "none". */
struct xdplb_backend {
	__u32 addr[4];		/* tunnel endpoint: IPv4 in addr[0] */
	__u8 family;		/* enum xdplb_family; also the outer header's family */
	__u8 flags;		/* XDPLB_BACKEND_F_* */
	__u8 gen;		/* bumped when the slot is given to another address */
	__u8 pad;
};

/*
 * A flow, as hashed and as keyed in the connection table.  The flow hash is
 * jhash2 over these ten 32-bit words (bpf/lib/hash.h, src/xdplb/hashing.py).
 */
struct xdplb_flow_key {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

/*
 * The session table lb_conns (bpf/lib/lb_conns.h, docs/datapath.md step 8):
 * an ARRAY of sets (XDPLB_CONN_SETS by default; the loader sets the configured
 * number, a power of 2), the set of a flow being xdplb_sess_hash(key,
 * sess_key) & xdplb_config.conn_mask, each holding XDPLB_CONN_WAYS sessions.
 * A set is five cache lines: a line of metadata (what a lookup that misses and
 * an insert's choice of way read: tags, ages, states), then one line per way
 * with its flow and where it goes.
 *
 * A set is written only while its writer holds it: the writer turns seq odd
 * with a compare-and-swap, writes, and makes seq even again with an atomic
 * add.  Both are BPF atomics with fetch, which are fully ordered.  A reader
 * reads seq, then the set through an address computed from it, then seq again
 * through an address computed from everything it read (address dependencies
 * order loads on every CPU that runs BPF), and accepts only what an unchanged,
 * even seq brackets.  last_seen is the one field written without the claim (a
 * hit refreshes it; any value is a recent time).
 *
 * Time is in ticks: jiffies (bpf_jiffies64(), which the JIT inlines into one
 * load; the kernel's HZ of them a second, xdplb_config.hz).
 */
enum xdplb_sess_state {
	XDPLB_SESS_UDP = 0,	/* not TCP */
	XDPLB_SESS_TCP_SYN,	/* TCP: recorded from a SYN, nothing else seen yet */
	XDPLB_SESS_TCP_EST,	/* TCP: a segment without SYN seen (or recorded mid-flow) */
	XDPLB_SESS_TCP_FIN,	/* TCP: the client sent FIN or RST */
	XDPLB_SESS__MAX,
};

#define XDPLB_SESS_F_USED	(1U << 0)	/* the way holds a session */
#define XDPLB_SESS_F_IMPORTED	(1U << 1)	/* written by user space (import), not used since */

/* A set's first cache line. */
struct xdplb_conn_meta {
	__u64 seq;			/* odd while a writer holds the set (64 bits: BPF's CAS) */
	__u32 tag[XDPLB_CONN_WAYS];	/* xdplb_sess_hash() of the way's flow: a hint */
	__u32 last_seen[XDPLB_CONN_WAYS];	/* tick of the way's last packet */
	__u16 gen[XDPLB_CONN_WAYS];	/* xdplb_config.conn_gen when written: another is a miss */
	__u8 state[XDPLB_CONN_WAYS];	/* enum xdplb_sess_state */
	__u8 flags[XDPLB_CONN_WAYS];	/* XDPLB_SESS_F_* */
	__u8 pad2[8];
};

/*
 * One way's flow and where it goes: a cache line of its own.  The key is the
 * flow key's fields (xdplb_flow_key without its padding); hop[] are backend
 * ids (ids fit 16 bits: limits.backends <= 65536).  nat[] is room for
 * NAT/FULLNAT (the translated address's index and ports, or for a reply-side
 * entry the place of its forward one) without another layout change.
 */
struct xdplb_conn_entry {
	__u32 src[4];
	__u32 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 be_gen;		/* xdplb_backend.gen of hop[0] when recorded: another is stale */
	__u16 pad;
	__u16 hop[XDPLB_MAX_HOPS];	/* hop[0] the backend, then later hops (Beamer); 0: none */
	__u32 hash;		/* the table hash, for the GUE source port */
	__u32 nat[3];		/* reserved: NAT/FULLNAT */
#ifdef XDPLB_ABI_TEST_NEXT
	__u32 test_extra;	/* the test layout's new field */
#endif
};

struct xdplb_conn_set {
	struct xdplb_conn_meta meta;
	struct xdplb_conn_entry way[XDPLB_CONN_WAYS];
};

/* A session as one record: what the export ring carries and an import takes. */
struct xdplb_session {
	__u32 last_seen;	/* tick of its last packet (the exporting host's clock) */
	__u16 gen;
	__u8 state;		/* enum xdplb_sess_state */
	__u8 flags;		/* XDPLB_SESS_F_* */
	struct xdplb_conn_entry entry;
};

/* lb_sess_export: what a record says of its session. */
enum xdplb_export_type {
	XDPLB_EXPORT_NEW = 1,	/* lb_xdp recorded a new session */
	XDPLB_EXPORT_UPDATE,	/* its state changed (state, last_seen as now) */
};

/* One record of the export ring buffer lb_sess_export (XDPLB_CFG_F_EXPORT). */
struct xdplb_export_rec {
	__u32 type;		/* enum xdplb_export_type */
	__u32 set;		/* where: set index and way */
	__u32 way;
	__u32 pad;
	struct xdplb_session sess;
};

#define XDPLB_EXPORT_RING_SIZE	(4U << 20)	/* lb_sess_export: bytes of ring buffer */

/*
 * Per-VIP member states (lb_members: vip id -> an inner ARRAY of __u64, two
 * bits per backend id, XDPLB_MEMBERS_PER_WORD ids a word).  A UDP session is
 * live while its backend is ACTIVE or DRAINING in its VIP.
 */
enum xdplb_member_state {
	XDPLB_MEMBER_NONE = 0,		/* not a backend of this VIP (removed, or never was) */
	XDPLB_MEMBER_ACTIVE,		/* in the table */
	XDPLB_MEMBER_DRAINING,		/* weight 0 by drain or configuration: keeps its sessions */
	XDPLB_MEMBER_DOWN,		/* a failed health check: its UDP sessions re-hash at once */
};

#define XDPLB_MEMBERS_PER_WORD	32

/*
 * Addresses that may be a VIP: bit xdplb_addr_filter_bit(addr) of the
 * ARRAY lb_vip_filter (XDPLB_VIP_FILTER_WORDS __u64 words).  A packet whose
 * destination's bit is clear is not for a VIP and passes at once.
 */
#define XDPLB_VIP_FILTER_BITS	16
#define XDPLB_VIP_FILTER_WORDS	((1U << XDPLB_VIP_FILTER_BITS) / 64)

/*
 * One bucket of a Beamer lookup table (inner map of lb_btables).  hop[0] is
 * the first hop (where new flows go); hop[1..] the bucket's most recent
 * distinct previous first hops, most recent first, 0 = none.  A Maglev
 * bucket (inner map of lb_tables) is a bare __u32 backend id.
 */
struct xdplb_bucket {
	__u32 hop[XDPLB_MAX_HOPS];	/* backend ids */
};

#define XDPLB_FLOOD_WINDOW_NS	(100 * 1000 * 1000ULL)	/* the insert budget's window */
#define XDPLB_DEFAULT_FLOOD_MAX	12500	/* inserts per CPU per window: 125k/s */

/* lb_config flags */
#define XDPLB_CFG_F_PTB		(1U << 0)	/* answer TOO_BIG with frag-needed / packet-too-big */
#define XDPLB_CFG_F_ACL_DENY	(1U << 1)	/* global ACL: a source no rule matches is denied */
#define XDPLB_CFG_F_EXPORT	(1U << 3)	/* new sessions and state changes go to lb_sess_export */

/* lb_config[0]: run-time settings of the LB program. */
struct xdplb_config {
	__u32 src4;		/* outer source address for IPv4 tunnels */
	__u32 src6[4];		/* outer source address for IPv6 tunnels */
	__be16 gue_port;	/* GUE destination UDP port */
	__u16 conn_gen;		/* session generation: a session of another one is a miss (flush) */
	__u32 hash_seed;
	__u32 conn_mask;	/* lb_conns' sets - 1 (the set count is a power of 2) */
	__u32 flood_max;	/* inserts per CPU per XDPLB_FLOOD_WINDOW_NS; 0: no limit */
	__u32 flags;		/* XDPLB_CFG_F_* */
	__u32 rl_rate;		/* new flows per second per source prefix; 0: no rate limit */
	__u32 rl_burst;		/* token bucket depth, new flows */
	__u8 rl_prefix4;	/* source prefix length the rate limit keys on: IPv4 */
	__u8 rl_prefix6;	/* and IPv6 */
	__u16 pad2;
	__u32 conn_timeout[XDPLB_SESS__MAX];	/* idle timeout by session state, in ticks */
	__u32 vip_index_mask;	/* lb_vip_index's slots - 1 (a power of 2) */
	__u32 hz;		/* ticks per second (the kernel's HZ), for user space */
	__u32 probe_key;	/* the self-check's probe carries it (lb_is_probe); 0: none is */
	/* xdplb_sess_keys(hash_seed): the session hash's multipliers (bpf/lib/hash.h) */
	__u64 sess_key[XDPLB_SESS_KEYS];
};

/* Per-CPU traffic counters (lb_vip_stats, lb_backend_stats). */
struct xdplb_stats {
	__u64 packets;
	__u64 bytes;
	__u64 new_flows;
};

/* Why lb_xdp dropped a packet; index of lb_drops. */
enum xdplb_drop_reason {
	XDPLB_DROP_FRAGMENT = 0,	/* fragment to a VIP address with no fragment VIP for its protocol */
	XDPLB_DROP_MALFORMED_L4,	/* VIP packet with a truncated TCP/UDP header */
	XDPLB_DROP_NO_TABLE,		/* VIP has no lookup table */
	XDPLB_DROP_NO_BACKEND,		/* bucket empty or backend not active */
	XDPLB_DROP_NO_CONFIG,		/* lb_config not filled in */
	XDPLB_DROP_ENCAP,		/* bpf_xdp_adjust_head refused */
	XDPLB_DROP_FIB,			/* no route to the backend */
	XDPLB_DROP_TOO_BIG,		/* encapsulated packet exceeds the egress MTU */
	XDPLB_DROP_ACL,			/* source denied by the global or the VIP's ACL */
	XDPLB_DROP_RATE_LIMIT,		/* new flow over its source prefix's rate */
	XDPLB_DROP_ICMP,		/* ICMP to a VIP address we cannot route (bad quote) */
	XDPLB_DROP__MAX,
};

/* What lb_xdp did, besides drops; index of lb_events. */
enum xdplb_event {
	XDPLB_EV_PASS_NOT_IP = 0,	/* not IPv4/IPv6 (ARP, LLDP, ...) */
	XDPLB_EV_PASS_MALFORMED,	/* IP header unparseable: left to the kernel */
	XDPLB_EV_PASS_NOT_VIP,		/* IP, but no VIP matches */
	XDPLB_EV_CONN_HIT,		/* the session table gave the backend */
	XDPLB_EV_CONN_MISS,		/* hashed into the VIP's table */
	XDPLB_EV_CONN_STALE,		/* the flow's session is no longer live (its VIP or backend changed) */
	XDPLB_EV_TX,			/* encapsulated, XDP_TX */
	XDPLB_EV_REDIRECT,		/* encapsulated, XDP_REDIRECT to another port */
	XDPLB_EV_FIB_PASS,		/* encapsulated, no neighbour yet: kernel forwards */
	XDPLB_EV_CONN_FLOOD,		/* new flow balanced but not recorded: over the insert budget */
	XDPLB_EV_LOCAL,			/* encapsulated for this very host (co-located): passed up */
	XDPLB_EV_ICMP_ERROR,		/* ICMP error quoting a VIP flow: sent where the flow goes */
	XDPLB_EV_ICMP_ECHO,		/* echo request to a VIP answered here (XDP_TX) */
	XDPLB_EV_ICMP_PTB,		/* too big to encapsulate: frag-needed / PTB sent back */
	XDPLB_EV_FRAGMENT,		/* fragment balanced by addresses and protocol only */
	XDPLB_EV_CONN_INSERT,		/* a session recorded */
	XDPLB_EV_CONN_BUSY,		/* a session not recorded or read: another writer held its way */
	XDPLB_EV_CONN_EVICT,		/* an insert replaced another flow's live session */
	XDPLB_EV_CONN_EXPIRED,		/* a session past its idle timeout: a miss, or taken by an insert */
	XDPLB_EV_CONN_GEN_MISS,		/* the flow's session is of an older generation (flushed) */
	XDPLB_EV_EXPORT_DROP,		/* the export ring had no room for a record */
	XDPLB_EV__MAX,
};

/* host_tc: what the backend host program did; index of host_events. */
enum xdplb_host_event {
	XDPLB_HOST_PASS = 0,		/* not a tunnel packet for this host */
	XDPLB_HOST_DECAP_GUE,		/* GUE decapsulated, delivered locally */
	XDPLB_HOST_DECAP_IPIP,		/* IPIP/IP6IP6 decapsulated, delivered locally */
	XDPLB_HOST_DROP_MALFORMED,	/* tunnel packet for us, but unparseable */
	XDPLB_HOST_DROP_DECAP,		/* bpf_skb_adjust_room refused */
	/*
	 * Daisy chaining: exactly one of the following per parsed GUE packet,
	 * decided before decapsulation (IPIP has no hop list: none of them).
	 * Every ACCEPT_* and FORWARD_FAILED is then decapsulated (DECAP_GUE).
	 */
	XDPLB_HOST_ACCEPT_NOT_TCP,	/* inner not TCP (or fragment, short TCP): first hop takes it */
	XDPLB_HOST_ACCEPT_SYN,		/* inner TCP SYN: a new connection starts here */
	XDPLB_HOST_ACCEPT_OWNED,	/* a local non-listening socket owns the inner 4-tuple */
	XDPLB_HOST_ACCEPT_SYNCOOKIE,	/* ACK carrying a valid SYN cookie of a local listener */
	XDPLB_HOST_ACCEPT_LAST_RESORT,	/* nobody owns it and no hop is left: local stack resets it */
	XDPLB_HOST_ACCEPT_LOOP,		/* next hop is one of our own addresses: taken locally */
	XDPLB_HOST_FORWARD,		/* outer header rewritten, redirected to the next hop */
	XDPLB_HOST_FORWARD_FAILED,	/* next hop unroutable (bpf_fib_lookup failed): taken locally */
	XDPLB_HOST_EV__MAX,
};

/* host_config[0] */
struct xdplb_host_config {
	__be16 gue_port;
	__u16 pad;
};

/*
 * A bare address: key of lb_vip_addrs (every address that has a VIP, used
 * where the port is unknown: fragments, truncated L4) and of host_addrs
 * (the addresses of a backend host that tunnels may target).
 */
struct xdplb_addr {
	__u32 addr[4];
	__u8 family;
	__u8 pad[3];
};

/*
 * hc_tc: health checks through the tunnel (bpf/hc_tc.bpf.c).  The daemon's
 * checker connects to the VIP itself with SO_MARK set; hc_tc, at TC egress of
 * the (ifb) device the marked traffic is routed to, encapsulates each packet
 * to the backend its mark names, exactly as lb_xdp would.  Its config map
 * hc_config holds a struct xdplb_config with lb_config's meaning (outer
 * sources, GUE port, hash seed).
 */
#define XDPLB_MAX_HC_TARGETS	8192

#define XDPLB_HC_F_SRC_HASH	(1U << 0)	/* GUE source port from the source-only hash */

/* hc_targets value; the key is the socket mark (__u32). */
struct xdplb_hc_target {
	__u32 addr[4];		/* backend (tunnel endpoint): IPv4 in addr[0] */
	__u8 family;		/* enum xdplb_family; also the outer header's family */
	__u8 encap;		/* enum xdplb_encap */
	__u8 flags;		/* XDPLB_HC_F_* */
	__u8 pad;
};

/* What hc_tc did with a packet; index of hc_events. */
enum xdplb_hc_event {
	XDPLB_HC_REDIRECT = 0,		/* encapsulated, sent to the next hop (bpf_redirect) */
	XDPLB_HC_REDIRECT_NEIGH,	/* encapsulated, next hop unresolved: bpf_redirect_neigh */
	XDPLB_HC_DROP_UNKNOWN_MARK,	/* no hc_targets entry for skb->mark */
	XDPLB_HC_DROP_UNSUPPORTED,	/* not IPv4/IPv6 TCP/UDP with ports (fragment, ICMP, ARP) */
	XDPLB_HC_DROP_NO_CONFIG,	/* hc_config has no outer source for the backend's family */
	XDPLB_HC_DROP_SELF,		/* the backend is this host (co-located): not tunnelled */
	XDPLB_HC_DROP_ENCAP,		/* bpf_skb_adjust_room refused (e.g. UDP GSO) */
	XDPLB_HC_DROP_FIB,		/* no route to the backend */
	XDPLB_HC_DROP_TOO_BIG,		/* encapsulated packet exceeds the egress MTU */
	XDPLB_HC_EV__MAX,
};

/* --- Source ACLs and the new-flow rate limit (bpf/lib/lb_acl.h) --- */

/*
 * Source ACLs: one LPM trie per family (lb_acl4, lb_acl6) holds every scope's
 * rules.  A scope is the global list (XDPLB_ACL_GLOBAL) or one VIP (its
 * vip_id); the key's prefixlen counts the scope's 32 bits too, so a rule for
 * a /p source prefix has prefixlen 32 + p and a lookup never crosses scopes.
 * Within a scope the longest matching prefix decides.  No rule matching: the
 * source is allowed, unless the scope has an allow list (XDPLB_CFG_F_ACL_DENY
 * globally, XDPLB_VIP_F_ACL_DENY for a VIP).  A scope whose flags say it has
 * no rules (XDPLB_CFG_F_ACL, XDPLB_VIP_F_ACL clear) is not looked up at all.
 */
#define XDPLB_ACL_GLOBAL	0xffffffffU	/* scope of the global rules */
#define XDPLB_ACL_ENTRIES	16384		/* rules per family, all scopes */

#define XDPLB_CFG_F_ACL		(1U << 2)	/* the global scope has rules */
#define XDPLB_VIP_F_ACL		(1U << 1)	/* the VIP's scope has rules */
#define XDPLB_VIP_F_ACL_DENY	(1U << 2)	/* the VIP has an allow list: no match is denied */

/* What a rule says, and the list a hit is counted under (lb_acl_hits). */
enum xdplb_acl_list {
	XDPLB_ACL_ALLOW = 0,	/* matched an allow rule: passed */
	XDPLB_ACL_DENY,		/* matched a deny rule: dropped */
	XDPLB_ACL_DEFAULT,	/* no rule matched, the scope has an allow list: dropped */
	XDPLB_ACL__MAX,
};

/*
 * lb_acl_hits index: slot * XDPLB_ACL__MAX + list, slot 0 for the global scope and
 * vip_id + 1 for a VIP's (the map is sized (limits.vips + 1) * XDPLB_ACL__MAX).
 */
#define XDPLB_ACL_HITS	((XDPLB_MAX_VIPS + 1) * XDPLB_ACL__MAX)

struct xdplb_acl_key4 {
	__u32 prefixlen;	/* 32 (the scope) + source prefix length */
	__u32 scope;		/* vip_id or XDPLB_ACL_GLOBAL, host order */
	__u32 addr;		/* network order */
};

struct xdplb_acl_key6 {
	__u32 prefixlen;	/* 32 + source prefix length */
	__u32 scope;
	__u32 addr[4];
};

/* lb_acl4 / lb_acl6 value. */
struct xdplb_acl_rule {
	__u8 action;		/* XDPLB_ACL_ALLOW or XDPLB_ACL_DENY */
	__u8 pad[3];
};

/*
 * New-flow rate limit: a token bucket per source prefix (the source masked to
 * rl_prefix4 / rl_prefix6; key struct xdplb_addr) in the LRU hash lb_rate.
 * Tokens are counted in nano-flows (one new flow costs 10^9): refilling
 * elapsed_ns * rl_rate needs no division.
 */
#define XDPLB_RATE_ENTRIES	65536
#define XDPLB_RATE_ONE		1000000000ULL	/* one new flow, in bucket units */

struct xdplb_rate {
	__u64 tokens;		/* nano-flows left, at most rl_burst * XDPLB_RATE_ONE */
	__u64 stamp;		/* bpf_ktime_get_coarse_ns() of the last refill */
};

/* --- ICMP and fragments (bpf/lib/lb_icmp.h) --- */

/*
 * lb_vip_addrs value: what lb_xdp needs to know about a VIP address for the
 * packets whose port it cannot use (fragments, ICMP).  Fragments of an
 * address are balanced to one VIP per protocol: frag_port[0] names the TCP
 * VIP, frag_port[1] the UDP VIP (port 0: the wildcard), when the matching
 * XDPLB_VIP_ADDR_F_FRAG_* flag says there is one.
 */
#define XDPLB_VIP_ADDR_F_FRAG_TCP	(1U << 0)	/* frag_port[0] names a TCP VIP */
#define XDPLB_VIP_ADDR_F_FRAG_UDP	(1U << 1)	/* frag_port[1] names a UDP VIP */
#define XDPLB_VIP_ADDR_F_ECHO		(1U << 2)	/* answer echo requests to it */

struct xdplb_vip_addr_info {
	__u32 nvips;		/* VIPs on this address (informational) */
	__be16 frag_port[2];	/* VIP port of its fragments: [0] TCP, [1] UDP */
	__u8 flags;		/* XDPLB_VIP_ADDR_F_* */
	__u8 pad[3];
};

/* IPv6 extension headers lb_xdp walks before the upper-layer header. */
#define XDPLB_MAX_EXTHDRS	4

/* --- packet capture (bpf/lib/capture.h, `xdplb capture`) --- */

/* Capture points: bits of xdplb_capture_config.points, and xdplb_capture_rec.point. */
#define XDPLB_CAP_DROP		(1U << 0)	/* dropped: reason = enum xdplb_drop_reason */
#define XDPLB_CAP_FORWARD	(1U << 1)	/* sent to a backend: reason = enum xdplb_cap_decision */
#define XDPLB_CAP_PASS		(1U << 2)	/* left to the kernel: reason = enum xdplb_event */
#define XDPLB_CAP_SNAP_MAX	256		/* bytes of a frame a record holds at most */
#define XDPLB_CAP_RING_SIZE	(1U << 20)	/* lb_capture: bytes of ring buffer */

/* How a forwarded packet's backend was chosen (xdplb_capture_rec.reason at FORWARD). */
enum xdplb_cap_decision {
	XDPLB_CAP_CONN_HIT = 0,		/* the connection table (step 8) */
	XDPLB_CAP_TABLE,		/* the VIP's table: a new flow or a SYN (step 9) */
	XDPLB_CAP_FRAGMENT,		/* a fragment, by addresses and protocol (4a) */
	XDPLB_CAP_ICMP_ERROR,		/* an ICMP error, where its flow goes (4b) */
};

/*
 * lb_cap_cfg[0], written by user space only.  expires_ns is the one word
 * every packet reads: 0 is off.  Past it (bpf_ktime_get_ns), lb_xdp records
 * nothing and sets it back to 0 itself, so a capture that was killed stops.
 */
struct xdplb_capture_config {
	__u64 expires_ns;	/* CLOCK_MONOTONIC ns; 0: capture off */
	__u32 points;		/* XDPLB_CAP_* to record */
	__u32 sample;		/* record 1 in `sample` packets of those points, per CPU (0, 1: all) */
	__u32 max_per_sec;	/* records per second per CPU at most; 0: no cap */
	__u32 snap_len;		/* bytes of each frame to record, <= XDPLB_CAP_SNAP_MAX */
	__u32 dst[4];		/* with dst_family: only packets to this address */
	__u8 dst_family;	/* enum xdplb_family, 0: any destination */
	__u8 pad[7];
};

/* lb_cap_state: per CPU, the sampler and what it could not record. */
struct xdplb_capture_state {
	__u64 window_ns;	/* start of the current one-second window */
	__u32 in_window;	/* records in that window */
	__u32 seen;		/* packets of chosen points since the last sampled one */
	__u64 records;		/* records submitted */
	__u64 capped;		/* sampled, but over max_per_sec */
	__u64 ring_full;	/* sampled, but the ring buffer had no room */
};

/* One lb_capture record: the verdict, the backend, then the frame's first bytes. */
struct xdplb_capture_rec {
	__u64 ts_ns;		/* bpf_ktime_get_ns() */
	__u32 point;		/* one XDPLB_CAP_* bit */
	__u32 reason;		/* by point: drop reason, cap decision, or pass event */
	__u32 ifindex;		/* ingress device */
	__u32 rx_queue;
	__u32 pkt_len;		/* the frame's length */
	__u32 cap_len;		/* bytes of data[] that hold the frame */
	__u32 vip_id;		/* FORWARD: the VIP */
	__u32 be_id;		/* FORWARD: the backend (first hop); 0 otherwise */
	__u32 be_addr[4];	/* FORWARD: its address */
	__u8 be_family;		/* enum xdplb_family; 0 when no backend */
	__u8 nhops;		/* FORWARD: hops in the GUE list */
	__u16 pad;
	__u32 cpu;
	__u8 data[XDPLB_CAP_SNAP_MAX];
};

#endif /* XDPLB_ABI_H */
