// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lab_flood: a spoofed-SYN flood generator for the lab (src/xdplb/lab/flood.py).
 *
 * Run with BPF_PROG_TEST_RUN in live-frame mode (BPF_F_TEST_XDP_LIVE_FRAMES, kernel
 * >= 5.18, as xdp-trafficgen does) on a template Ethernet/IPv4/TCP SYN: every
 * repetition draws a new source address (within flood_cfg's prefix), source port
 * and sequence number, patches both checksums incrementally and sends the frame
 * with XDP_TX out of the interface named in the context.
 *
 * Live-frame pages are recycled without being rewritten, and a page is not only
 * ours while it is out: a receiver that XDP_PASSes the frame builds its skb on the
 * page, and whatever writes into that skb downstream (a balancer encapsulating it,
 * rewriting its MACs) is in the page when it comes back. So every repetition first
 * copies the whole template from flood_cfg over the frame, then patches the
 * template's checksums (RFC 1624). (A generator that patched the frame as it found it
 * once sent SYNs carrying the balancer's MAC as their source, and the lab's bridge
 * learned the balancer on the attacker's port: every client lost it.)
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* The template's length: syn_template() in flood.py builds exactly this. */
#define FLOOD_FRAME_LEN 74

struct flood_cfg {
	__u8 frame[80];		/* the template, FLOOD_FRAME_LEN bytes used */
	__u32 src_base;		/* network byte order: the prefix's first address */
	__u32 src_hostmask;	/* host byte order: 2^(32 - prefix length) - 1 */
	__u16 sport_min;	/* host byte order */
	__u16 sport_span;	/* ports drawn: sport_min .. sport_min + span - 1; 0: 65536 */
	__u32 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flood_cfg);
} flood_cfg SEC(".maps");

/* Frames handed to XDP_TX, per CPU: what the generator sent (the veth may still drop). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} flood_sent SEC(".maps");

/* RFC 1624, eqn. 3: HC' = ~(~HC + ~m + m'), over 16-bit words in network order. */
static __always_inline __u16 csum_update16(__u16 check, __u16 old, __u16 new)
{
	__u32 sum = (__u16)~check + (__u32)(__u16)~old + new;

	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)~sum;
}

static __always_inline __u16 csum_update32(__u16 check, __u32 old, __u32 new)
{
	check = csum_update16(check, (__u16)old, (__u16)new);
	return csum_update16(check, (__u16)(old >> 16), (__u16)(new >> 16));
}

SEC("xdp")
int lab_flood(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = (void *)(eth + 1);
	struct tcphdr *tcp = (void *)(ip + 1);
	struct flood_cfg *cfg;
	__u32 zero = 0, saddr, seq;
	__u16 sport;
	__u64 *sent;

	if (data + FLOOD_FRAME_LEN > data_end)
		return XDP_DROP;
	cfg = bpf_map_lookup_elem(&flood_cfg, &zero);
	if (!cfg)
		return XDP_DROP;
	__builtin_memcpy(data, cfg->frame, FLOOD_FRAME_LEN);
	/* The template is option-less IPv4 (flood.py builds it): anything else is not ours. */
	if (eth->h_proto != bpf_htons(ETH_P_IP) || ip->ihl != 5 || ip->protocol != IPPROTO_TCP)
		return XDP_DROP;

	saddr = cfg->src_base | bpf_htonl(bpf_get_prandom_u32() & cfg->src_hostmask);
	sport = bpf_htons(cfg->sport_span ?
			  cfg->sport_min + bpf_get_prandom_u32() % cfg->sport_span :
			  (__u16)bpf_get_prandom_u32());
	seq = bpf_get_prandom_u32();

	/* The source address is in the IP header and in TCP's pseudo-header. */
	ip->check = csum_update32(ip->check, ip->saddr, saddr);
	tcp->check = csum_update32(tcp->check, ip->saddr, saddr);
	tcp->check = csum_update16(tcp->check, tcp->source, sport);
	tcp->check = csum_update32(tcp->check, tcp->seq, seq);
	ip->saddr = saddr;
	tcp->source = sport;
	tcp->seq = seq;

	sent = bpf_map_lookup_elem(&flood_sent, &zero);
	if (sent)
		*sent += 1;
	return XDP_TX;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
