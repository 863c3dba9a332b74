/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * GUE as glb-director writes it (draft-ietf-intarea-gue, variant 0), with
 * glb-director's private data carrying the hop list:
 *
 *   0                   1                   2                   3
 *   |0 0|C|  hlen   |  proto/ctype  |             flags             |
 *   |        private type (0)       | next hop idx  |   hop count   |
 *   |                 hop[0] ... hop[hop count - 1]                 |
 *
 * hlen counts the 32-bit words after the first one: 1 + hop_count * w,
 * where w = 1 for IPv4 hops and 4 for IPv6 hops (hops are of the outer
 * family).  docs/datapath.md, lb_xdp step 11, is the contract.
 *
 * Layout only, no helpers: lb_xdp (encap) and host_tc (decap) share it.
 */
#ifndef XDPLB_LIB_GUE_H
#define XDPLB_LIB_GUE_H

#include <linux/types.h>

struct xdplb_gue_hdr {
	__u8 hlen_ver;		/* version:2 (must be 0), C:1, hlen:5 */
	__u8 proto;		/* inner protocol: IPPROTO_IPIP or IPPROTO_IPV6 */
	__be16 flags;		/* no GUE flags are used: 0 */
};

/* glb-director's private data: the first word after the base header. */
struct xdplb_gue_priv {
	__be16 type;		/* 0: glb-director hop list */
	__u8 next_hop;		/* index of the hop this packet is going to */
	__u8 hop_count;		/* number of hops that follow */
};

#define XDPLB_GUE_VER(b)	((b) >> 6)
#define XDPLB_GUE_C(b)		(((b) >> 5) & 1)
#define XDPLB_GUE_HLEN(b)	((b) & 0x1f)

/* Bytes of GUE header (base + private data) for a given hlen. */
#define XDPLB_GUE_LEN(hlen)	(sizeof(struct xdplb_gue_hdr) + 4 * (__u32)(hlen))

/* 32-bit words one hop takes in the hop list, by outer family. */
#define XDPLB_GUE_HOP_WORDS_V4	1
#define XDPLB_GUE_HOP_WORDS_V6	4

#endif /* XDPLB_LIB_GUE_H */
