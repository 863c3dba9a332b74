/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/* Internet checksum (RFC 1071) for the one header we build: outer IPv4. */
#ifndef XDPLB_LIB_CSUM_H
#define XDPLB_LIB_CSUM_H

#include <linux/types.h>
#include <linux/ip.h>

/* Fold a 64-bit one's complement sum to 16 bits and complement it. */
static __always_inline __u16 csum_fold64(__u64 sum)
{
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffffffff) + (sum >> 32);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

/*
 * Checksum of an option-less IPv4 header whose check field is 0: five
 * 32-bit words, unrolled (no loop, no bpf_csum_diff() call).  The one's
 * complement sum is byte-order independent, so native loads and a native
 * store give the right bytes on the wire (RFC 1071, section 2(B)).
 */
static __always_inline __u16 ipv4_hdr_csum(const struct iphdr *iph)
{
	const __u32 *w = (const __u32 *)iph;
	__u64 sum;

	sum = (__u64)w[0] + w[1] + w[2] + w[3] + w[4];
	return csum_fold64(sum);
}

#endif /* XDPLB_LIB_CSUM_H */
