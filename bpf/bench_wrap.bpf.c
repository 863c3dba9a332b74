// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * bench_wrap: the measuring wrapper of bench/bench.py (docs/benchmarks.md).
 *
 * BPF_PROG_TEST_RUN with repeat > 1 runs the program again and again on one
 * buffer: from the second iteration on, a program that rewrites or grows the
 * packet would see its own output, and the data pointer moved by
 * bpf_xdp_adjust_head is never reset.  So every iteration goes through here
 * first:
 *
 *   1. bpf_xdp_adjust_head(current length - original length) puts the head
 *      back where it was (the programs under test only ever grow the head);
 *      it is called even when the difference is 0, so every case pays the
 *      same restore cost;
 *   2. bpf_xdp_store_bytes copies the original packet from bench_pkt back in;
 *   3. a counter (bench_pkt.ctr, incremented every iteration) masked with
 *      bench_pkt.mask is XORed into the TCP/UDP source port (low 16 bits) and
 *      the last two bytes of the source address (high 16 bits).  mask 0 leaves
 *      the packet as it was, mask ~0 makes every iteration a new flow; the
 *      instructions executed are the same either way;
 *   4. bpf_tail_call into bench_progs[0], the program under test.
 *
 * Not part of the load balancer: only the benchmark and its test load it.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "lib/wrap.h"

#define BENCH_MAX_PKT 256

/* Keep in sync with bench/harness.py (BenchPkt). */
struct bench_pkt {
	__u32 len;		/* original frame length */
	__u32 sport_off;	/* offset of the L4 source port */
	__u32 saddr_off;	/* offset of the last two bytes of the source address */
	__u32 mask;		/* ANDed with ctr before the XOR: 0 = no variation */
	__u32 ctr;		/* iteration counter (one test_run at a time: no atomics) */
	__u32 pad;
	__u8 data[BENCH_MAX_PKT];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_pkt);
} bench_pkt SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} bench_progs SEC(".maps");

static __always_inline int xor16(struct xdp_md *ctx, __u32 off, __u16 x)
{
	__u16 *p = wrap_u16(ctx, off, BENCH_MAX_PKT);

	if (!p)
		return -1;
	*p ^= x;
	return 0;
}

SEC("xdp")
int bench_wrap(struct xdp_md *ctx)
{
	struct bench_pkt *pkt;
	__u32 zero = 0;
	__u32 len, v;

	pkt = bpf_map_lookup_elem(&bench_pkt, &zero);
	if (!pkt)
		return XDP_ABORTED;
	len = pkt->len;
	if (len < 14 || len > BENCH_MAX_PKT)
		return XDP_ABORTED;

	/* 1, 2. The original length and bytes. */
	if (wrap_restore(ctx, pkt->data, len))
		return XDP_ABORTED;
	/* 3. Flow variation (a no-op XOR with mask 0). */
	v = pkt->ctr & pkt->mask;
	pkt->ctr += 1;
	if (xor16(ctx, pkt->sport_off, bpf_htons(v & 0xffff)))
		return XDP_ABORTED;
	if (xor16(ctx, pkt->saddr_off, bpf_htons(v >> 16)))
		return XDP_ABORTED;
	/* 4. The program under test. */
	bpf_tail_call(ctx, &bench_progs, 0);
	return XDP_ABORTED;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
