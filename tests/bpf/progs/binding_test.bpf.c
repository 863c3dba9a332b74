// SPDX-License-Identifier: GPL-2.0
/* Tiny programs and maps that exist only to test xdplb.datapath (tests/bpf/test_datapath.py). */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

/* Per-CPU packet counter, index 0: moved by every program that sees a packet. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} bt_counters SEC(".maps");

/* Survives reloads: pinned under the loader's pin_root. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} bt_pinned SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u64);
} bt_hash SEC(".maps");

/* The size of a consistent-hash table: the batch-update timing target. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65537);
	__type(key, __u32);
	__type(value, __u64);
} bt_table SEC(".maps");

/* BPF_F_INNER_MAP on the template: installed inner maps may have other max_entries. */
struct bt_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(map_flags, BPF_F_INNER_MAP);
	__type(key, __u32);
	__type(value, __u32);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 2);
	__type(key, __u32);
	__array(values, struct bt_inner);
} bt_outer SEC(".maps");

static __always_inline void count_packet(void)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&bt_counters, &zero);

	if (n)
		*n += 1;
}

SEC("xdp")
int xdp_pass(struct xdp_md *ctx)
{
	count_packet();
	return XDP_PASS;
}

SEC("xdp")
int xdp_drop(struct xdp_md *ctx)
{
	return XDP_DROP;
}

/* Swap source and destination MAC, send back out. */
SEC("xdp")
int xdp_swap_tx(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	unsigned char tmp[ETH_ALEN];

	count_packet();
	if ((void *)(eth + 1) > data_end)
		return XDP_DROP;
	__builtin_memcpy(tmp, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, tmp, ETH_ALEN);
	return XDP_TX;
}

/* Grow the head by 4 bytes and write a marker there: the encapsulation pattern. */
SEC("xdp")
int xdp_grow(struct xdp_md *ctx)
{
	void *data, *data_end;
	__u8 *head;

	if (bpf_xdp_adjust_head(ctx, -4))
		return XDP_ABORTED;
	/* Packet pointers are stale after adjust_head: reload and re-check. */
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	head = data;
	if ((void *)(head + 4) > data_end)
		return XDP_ABORTED;
	head[0] = 0xde;
	head[1] = 0xad;
	head[2] = 0xbe;
	head[3] = 0xef;
	return XDP_TX;
}

/* Write bt_outer[0][10] (an inner map bigger than its template) over the first 4 bytes. */
SEC("xdp")
int xdp_inner(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0, ten = 10;
	__u32 *value;
	void *inner;

	if (data + 4 > data_end)
		return XDP_DROP;
	inner = bpf_map_lookup_elem(&bt_outer, &zero);
	if (!inner)
		return XDP_DROP;
	value = bpf_map_lookup_elem(inner, &ten);
	if (!value)
		return XDP_ABORTED;
	__builtin_memcpy(data, value, 4);
	return XDP_TX;
}

/* Return bt_pinned[1] as the verdict (bounded): shows a reloaded object sees old state. */
SEC("xdp")
int xdp_pinned(struct xdp_md *ctx)
{
	__u32 one = 1;
	__u64 *v = bpf_map_lookup_elem(&bt_pinned, &one);

	return v ? (int)(*v & 0xff) : XDP_ABORTED;
}

SEC("tc")
int tc_pass(struct __sk_buff *skb)
{
	count_packet();
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "GPL";
