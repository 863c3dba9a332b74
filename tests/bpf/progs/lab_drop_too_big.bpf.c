// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lab_drop_too_big: a TC egress filter for the lab's reply router (tests/e2e/test_pmtu.py)
 * that drops the ICMP "fragmentation needed" (IPv4 type 3 code 4) and ICMPv6 "packet too
 * big" (type 2) messages the router sends, counting them in lab_dropped[0]: the control
 * run in which path MTU discovery through the balancer cannot work. (The kernel has no
 * flower/gact modules and no nftables userland here; a program needs neither.)
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} lab_dropped SEC(".maps");

static __always_inline int drop(void)
{
	__u32 zero = 0;
	__u64 *n = bpf_map_lookup_elem(&lab_dropped, &zero);

	if (n)
		__sync_fetch_and_add(n, 1);
	return TC_ACT_SHOT;
}

SEC("tc")
int lab_drop_too_big(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__u8 *icmp;

	if ((void *)(eth + 1) > data_end)
		return TC_ACT_OK;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);

		if ((void *)(ip + 1) > data_end || ip->protocol != IPPROTO_ICMP)
			return TC_ACT_OK;
		icmp = (__u8 *)ip + ip->ihl * 4;
		if ((void *)(icmp + 2) > data_end)
			return TC_ACT_OK;
		if (icmp[0] == 3 && icmp[1] == 4)
			return drop();
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);

		if ((void *)(ip6 + 1) > data_end || ip6->nexthdr != IPPROTO_ICMPV6)
			return TC_ACT_OK;
		icmp = (__u8 *)(ip6 + 1);
		if ((void *)(icmp + 1) > data_end)
			return TC_ACT_OK;
		if (icmp[0] == 2)
			return drop();
	}
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
