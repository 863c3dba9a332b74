// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lab_xdp_tx: the smallest XDP_TX forwarder, to check that the lab delivers frames a
 * program on the LB's veth sends back out with XDP_TX (the peer needs XDP or GRO).
 * IPv4 to 198.18.100.0/24 gets the MAC of lab_tx_mac[0] and goes out again unchanged
 * otherwise (L2 direct return: the backend holds the VIP on its loopback).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

struct tx_mac {
	__u8 addr[ETH_ALEN];
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct tx_mac);
} lab_tx_mac SEC(".maps");

SEC("xdp")
int lab_xdp_tx(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct tx_mac *mac;
	__u32 zero = 0;

	if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	/* 198.18.100.0/24 */
	if ((ip->daddr & bpf_htonl(0xffffff00)) != bpf_htonl(0xc6126400))
		return XDP_PASS;
	mac = bpf_map_lookup_elem(&lab_tx_mac, &zero);
	if (!mac)
		return XDP_PASS;
	__builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, mac->addr, ETH_ALEN);
	return XDP_TX;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
