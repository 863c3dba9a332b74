// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * conc_wrap: the driver of tests/bpf/test_concurrency.py.  Like bench_wrap
 * (bpf/bench_wrap.bpf.c), every iteration of a BPF_PROG_TEST_RUN puts the
 * head and bytes of the original packet back, then makes it one of a few
 * flows and tail-calls the program under test (conc_progs[0]):
 *
 *   - the flow is conc_pkt.sport[i] / saddr[i] (the source port and the last
 *     two bytes of the source address, network order) with i drawn from a
 *     per-CPU xorshift generator: a random order of the same flows, so a
 *     4-way set sees hits and misses alike (a cyclic order would make LRU miss
 *     every time);
 *   - conc_cpu counts the iterations of each CPU: the lookups made.
 *
 * The test runs one thread per CPU, each pinned, so per-CPU is per-thread.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "lib/wrap.h"

#define CONC_MAX_PKT	128
#define CONC_MAX_FLOWS	64

/* Keep in sync with tests/bpf/test_concurrency.py (ConcPkt). */
struct conc_pkt {
	__u32 len;		/* original frame length */
	__u32 sport_off;	/* offset of the L4 source port */
	__u32 saddr_off;	/* offset of the last two bytes of the source address */
	__u32 nflows;		/* flows in sport / saddr: a power of 2, at most CONC_MAX_FLOWS */
	__u16 sport[CONC_MAX_FLOWS];
	__u16 saddr[CONC_MAX_FLOWS];
	__u8 data[CONC_MAX_PKT];
};

struct conc_cpu {
	__u64 iters;		/* iterations run on this CPU */
	__u64 rng;		/* xorshift64 state (0: not seeded yet) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct conc_pkt);
} conc_pkt SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct conc_cpu);
} conc_cpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} conc_progs SEC(".maps");

static __always_inline int put16(struct xdp_md *ctx, __u32 off, __u16 v)
{
	__u16 *p = wrap_u16(ctx, off, CONC_MAX_PKT);

	if (!p)
		return -1;
	*p = v;
	return 0;
}

SEC("xdp")
int conc_wrap(struct xdp_md *ctx)
{
	struct conc_pkt *pkt;
	struct conc_cpu *st;
	__u32 zero = 0, len, i;
	__u64 x;

	pkt = bpf_map_lookup_elem(&conc_pkt, &zero);
	st = bpf_map_lookup_elem(&conc_cpu, &zero);
	if (!pkt || !st)
		return XDP_ABORTED;
	len = pkt->len;
	if (len < 14 || len > CONC_MAX_PKT)
		return XDP_ABORTED;
	if (wrap_restore(ctx, pkt->data, len))
		return XDP_ABORTED;
	x = st->rng ? st->rng : 0x9e3779b97f4a7c15ULL * (bpf_get_smp_processor_id() + 1);
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	st->rng = x;
	st->iters += 1;
	i = (x >> 32) & (pkt->nflows - 1) & (CONC_MAX_FLOWS - 1);
	if (put16(ctx, pkt->sport_off, pkt->sport[i]) || put16(ctx, pkt->saddr_off, pkt->saddr[i]))
		return XDP_ABORTED;
	bpf_tail_call(ctx, &conc_progs, 0);
	return XDP_ABORTED;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
