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

#include "xdplb_abi.h"

#define XDPLB_JHASH_INITVAL	0xdeadbeefU
#define XDPLB_FLOW_WORDS	10

_Static_assert(XDPLB_SESS_KEYS == XDPLB_FLOW_WORDS, "a multiplier per key word");

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

/*
 * The session hash's keys: ten odd 64-bit multipliers drawn from the seed by
 * SplitMix64 (Steele, Lea, Flood 2014).  User space fills lb_config.sess_key
 * with them (src/xdplb/core/state.py, through hashing.sess_keys); the BPF
 * program reads them there rather than deriving them per packet.
 */
static inline void xdplb_sess_keys(__u32 seed, __u64 *keys)
{
	__u64 x = seed, z;
	int i;

	for (i = 0; i < XDPLB_FLOW_WORDS; i++) {
		x += 0x9e3779b97f4a7c15ULL;
		z = x;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
		keys[i] = (z ^ (z >> 31)) | 1;
	}
}

/*
 * The session table's hash of a flow key (its set is this & conn_mask): a
 * multilinear hash, the sum of each word times its own secret multiplier
 * (xdplb_sess_keys; ten multiplies the CPU runs side by side, a third of
 * jhash's time), folded to 32 bits through MurmurHash3's finalizer.  Every
 * multiplier comes from the seed, so which flows share a set depends on it
 * as a whole: with public constants and the seed only added in, two keys'
 * difference - and so a crafted collision - would have been the same under
 * every seed.  A hit needs only this; the table's jhash (xdplb_flow_hash) is
 * computed on a miss.
 */
static inline __u32 xdplb_sess_hash(const __u32 *k, const __u64 *key)
{
	__u64 s = (__u64)k[0] * key[0];
	__u32 h;

	s += (__u64)k[1] * key[1];
	s += (__u64)k[2] * key[2];
	s += (__u64)k[3] * key[3];
	s += (__u64)k[4] * key[4];
	s += (__u64)k[5] * key[5];
	s += (__u64)k[6] * key[6];
	s += (__u64)k[7] * key[7];
	s += (__u64)k[8] * key[8];
	s += (__u64)k[9] * key[9];
	h = (__u32)(s >> 32) ^ (__u32)s;
	h ^= h >> 16;
	h *= 0x85ebca6bU;
	h ^= h >> 13;
	h *= 0xc2b2ae35U;
	h ^= h >> 16;
	return h;
}

/*
 * The bit of lb_vip_filter an address has (XDPLB_VIP_FILTER_BITS wide): the
 * address's words folded by XOR (IPv4: addr[1..3] are 0), then Fibonacci
 * hashing, the top bits of a multiply (Knuth 6.4).
 */
static inline __u32 xdplb_addr_filter_bit(const __u32 *addr)
{
	__u32 x = addr[0] ^ addr[1] ^ addr[2] ^ addr[3];

	return (x * 0x9e3779b1U) >> (32 - 16);
}

/*
 * The home slot of a VIP key in lb_vip_index, before the mask: its address
 * words folded by XOR with the word holding port, proto and family, through
 * MurmurHash3's 32-bit finalizer (every bit of the input moves every bit).
 */
static inline __u32 xdplb_vip_slot_hash(const __u32 *addr, __u32 port_proto_family)
{
	__u32 x = addr[0] ^ addr[1] ^ addr[2] ^ addr[3] ^ xdplb_rol32(port_proto_family, 7);

	x ^= x >> 16;
	x *= 0x85ebca6bU;
	x ^= x >> 13;
	x *= 0xc2b2ae35U;
	x ^= x >> 16;
	return x;
}

#endif /* XDPLB_LIB_HASH_H */
