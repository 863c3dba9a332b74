/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The flow hash: Bob Jenkins' lookup3 hashword() ("jhash2"), specialised to
 * the ten 32-bit words of struct xdplb_flow_key.  Words are read in host
 * (little-endian) order straight from the key's memory.
 *
 * This header is plain C with no BPF helpers so that the host compiler can
 * build it too: src/xdplb/hashing.py must agree with it bit for bit, and
 * tests/unit/test_hashing.py checks that against this very file.
 */
#ifndef XDPLB_LIB_HASH_H
#define XDPLB_LIB_HASH_H

#include <linux/types.h>

#define XDPLB_JHASH_INITVAL	0xdeadbeefU
#define XDPLB_FLOW_WORDS	10

static inline __u32 xdplb_rol32(__u32 w, unsigned int s)
{
	return (w << s) | (w >> (32 - s));
}

#define xdplb_jhash_mix(a, b, c)			\
	do {						\
		a -= c; a ^= xdplb_rol32(c, 4);  c += b;	\
		b -= a; b ^= xdplb_rol32(a, 6);  a += c;	\
		c -= b; c ^= xdplb_rol32(b, 8);  b += a;	\
		a -= c; a ^= xdplb_rol32(c, 16); c += b;	\
		b -= a; b ^= xdplb_rol32(a, 19); a += c;	\
		c -= b; c ^= xdplb_rol32(b, 4);  b += a;	\
	} while (0)

#define xdplb_jhash_final(a, b, c)			\
	do {						\
		c ^= b; c -= xdplb_rol32(b, 14);	\
		a ^= c; a -= xdplb_rol32(c, 11);	\
		b ^= a; b -= xdplb_rol32(a, 25);	\
		c ^= b; c -= xdplb_rol32(b, 16);	\
		a ^= c; a -= xdplb_rol32(c, 4);		\
		b ^= a; b -= xdplb_rol32(a, 14);	\
		c ^= b; c -= xdplb_rol32(b, 24);	\
	} while (0)

/* jhash2(k, 10, seed), unrolled: three mixes, then the tenth word and final(). */
static inline __u32 xdplb_flow_hash(const __u32 *k, __u32 seed)
{
	__u32 a, b, c;

	a = b = c = XDPLB_JHASH_INITVAL + (XDPLB_FLOW_WORDS << 2) + seed;
	a += k[0]; b += k[1]; c += k[2];
	xdplb_jhash_mix(a, b, c);
	a += k[3]; b += k[4]; c += k[5];
	xdplb_jhash_mix(a, b, c);
	a += k[6]; b += k[7]; c += k[8];
	xdplb_jhash_mix(a, b, c);
	a += k[9];
	xdplb_jhash_final(a, b, c);
	return c;
}

#endif /* XDPLB_LIB_HASH_H */
