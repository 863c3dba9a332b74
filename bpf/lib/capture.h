/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * Packet capture for `xdplb capture` (docs/datapath.md, "Capture").  Three
 * points: a drop (with its lb_drops reason), a forward (with the backend and
 * how it was chosen, recorded before encapsulation: the client's frame) and
 * a pass (PASS_NOT_IP, PASS_MALFORMED, PASS_NOT_VIP: the packets lb_xdp
 * leaves to the kernel; the passes of steps 11-12 are forwards).
 *
 * Off, a forwarded packet reads lb_cap_cfg[0].expires_ns (0) at step 10, a
 * dropped or passed one after the steps, and takes the branch not taken; the
 * capture functions are out of line (__noinline, they look the config up
 * again), so the hot path carries none of their code.  On, a chosen point's
 * packets go through the per-CPU sampler (1 in `sample`, at most `max_per_sec` a second per CPU); a
 * sampled one is checked against the expiry and copied, with its first
 * `snap_len` bytes, into the ring buffer lb_capture.  Past the expiry
 * nothing is recorded and expires_ns is set back to 0 (only if unchanged,
 * so a new capture's setting wins), which ends the cost of a capture whose
 * process was killed.
 */
#ifndef XDPLB_LIB_CAPTURE_H
#define XDPLB_LIB_CAPTURE_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"
#include "lib/hook.h"
#include "lib/lb_parse.h"
#include "lib/lb_select.h"

#define LB_CAP_SECOND	1000000000ULL

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xdplb_capture_config);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_cap_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct xdplb_capture_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_cap_state SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, XDPLB_CAP_RING_SIZE);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} lb_capture SEC(".maps");

/* BTF anchors (see lb_maps.h): the record and the decisions only travel through the ring. */
struct xdplb_capture_rec xdplb_btf_cap_rec SEC(".xdplb_btf") __attribute__((used));
enum xdplb_cap_decision xdplb_btf_cap_decision SEC(".xdplb_btf") __attribute__((used));

/* What a record says besides the frame. */
struct lb_cap_info {
	__u32 point;
	__u32 reason;
	__u32 vip_id;
	__u32 be_id;
	__u32 be_addr[4];
	__u8 be_family;
	__u8 nhops;
	__u8 pad[2];
};

/* The capture config when capture is on, else NULL: the only cost when it is off. */
static __always_inline struct xdplb_capture_config *lb_capture_on(void)
{
	__u32 zero = 0;
	struct xdplb_capture_config *cap = bpf_map_lookup_elem(&lb_cap_cfg, &zero);

	if (cap && cap->expires_ns)
		return cap;
	return NULL;
}

/* Is this packet one of the chosen ones (point and destination), and sampled? */
static __always_inline struct xdplb_capture_state *
lb_cap_sample(const struct xdplb_capture_config *cap, const struct lb_pkt *pkt, __u32 point)
{
	struct xdplb_capture_state *st;
	__u32 zero = 0, seen;

	if (!(cap->points & point))
		return NULL;
	if (cap->dst_family &&
	    (cap->dst_family != pkt->family || cap->dst[0] != pkt->flow.dst[0] ||
	     cap->dst[1] != pkt->flow.dst[1] || cap->dst[2] != pkt->flow.dst[2] ||
	     cap->dst[3] != pkt->flow.dst[3]))
		return NULL;
	st = bpf_map_lookup_elem(&lb_cap_state, &zero);
	if (!st)
		return NULL;
	/* 1 in `sample`: the first packet of each run of `sample` (no division). */
	seen = st->seen;
	st->seen = seen + 1 >= cap->sample ? 0 : seen + 1;
	return seen ? NULL : st;
}

/* A sampled packet: expiry, the per-second cap, then the record.  Out of line: it is rare. */
static __noinline int lb_cap_emit(struct lb_ctx *ctx, struct xdplb_capture_config *cap,
				  struct xdplb_capture_state *st, const struct lb_cap_info *info)
{
	struct xdplb_capture_rec *rec;
	__u64 now = bpf_ktime_get_ns();
	__u64 expires = cap->expires_ns;
	__u32 len, snap;

	if (now > expires) {
		if (expires)
			__sync_val_compare_and_swap(&cap->expires_ns, expires, 0);
		return 0;
	}
	if (cap->max_per_sec) {
		if (now - st->window_ns >= LB_CAP_SECOND) {
			st->window_ns = now;
			st->in_window = 0;
		}
		if (st->in_window >= cap->max_per_sec) {
			st->capped += 1;
			return 0;
		}
		st->in_window += 1;
	}
	rec = bpf_ringbuf_reserve(&lb_capture, sizeof(*rec), 0);
	if (!rec) {
		st->ring_full += 1;
		return 0;
	}
	len = lb_frame_len(ctx);
	snap = cap->snap_len;
	if (snap > XDPLB_CAP_SNAP_MAX)
		snap = XDPLB_CAP_SNAP_MAX;
	if (snap > len)
		snap = len;
	rec->ts_ns = now;
	rec->point = info->point;
	rec->reason = info->reason;
	rec->ifindex = ctx->ingress_ifindex;
	rec->rx_queue = lb_rx_queue(ctx);
	rec->pkt_len = len;
	rec->vip_id = info->vip_id;
	rec->be_id = info->be_id;
	__builtin_memcpy(rec->be_addr, info->be_addr, sizeof(rec->be_addr));
	rec->be_family = info->be_family;
	rec->nhops = info->nhops;
	rec->pad = 0;
	rec->cpu = bpf_get_smp_processor_id();
	rec->cap_len = 0;
	if (snap > 0) {
		/* The same value in [1, XDPLB_CAP_SNAP_MAX] (a power of 2), as the verifier sees it. */
		snap = ((snap - 1) & (XDPLB_CAP_SNAP_MAX - 1)) + 1;
		if (lb_load_bytes(ctx, 0, rec->data, snap) == 0)
			rec->cap_len = snap;
	}
	bpf_ringbuf_submit(rec, 0);
	st->records += 1;
	return 0;
}

/* Point FORWARD, at step 10: the backend chosen and how, the frame not yet encapsulated. */
static __noinline void lb_capture_forward(struct lb_ctx *ctx, const struct lb_pkt *pkt,
					  __u32 vip_id, const struct lb_target *tgt,
					  __u32 new_flow)
{
	struct xdplb_capture_config *cap = lb_capture_on();
	struct xdplb_capture_state *st;
	struct lb_cap_info info = {};

	if (!cap)
		return;
	st = lb_cap_sample(cap, pkt, XDPLB_CAP_FORWARD);
	if (!st)
		return;
	info.point = XDPLB_CAP_FORWARD;
	if (new_flow)
		info.reason = XDPLB_CAP_TABLE;
	else if (pkt->frag)
		info.reason = XDPLB_CAP_FRAGMENT;
	else if (pkt->flow.proto == IPPROTO_ICMP || pkt->flow.proto == IPPROTO_ICMPV6)
		info.reason = XDPLB_CAP_ICMP_ERROR;
	else
		info.reason = XDPLB_CAP_CONN_HIT;
	info.vip_id = vip_id;
	info.be_id = tgt->be_id;
	__builtin_memcpy(info.be_addr, tgt->be->addr, sizeof(info.be_addr));
	info.be_family = tgt->be->family;
	info.nhops = tgt->nhops ? tgt->nhops : 1;
	lb_cap_emit(ctx, cap, st, &info);
}

/*
 * Points DROP and PASS, from lb_xdp's verdict (counters.h puts the drop
 * reason or the pass event above its low byte).  Passes after encapsulation
 * (LOCAL, FIB_PASS) were recorded as forwards; TX and REDIRECT verdicts are
 * not recorded here.
 */
static __noinline void lb_capture_verdict(struct lb_ctx *ctx, const struct lb_pkt *pkt, int rc)
{
	struct xdplb_capture_config *cap = lb_capture_on();
	struct xdplb_capture_state *st;
	struct lb_cap_info info = {};
	__u32 reason = LB_REASON(rc);

	if (!cap)
		return;
	if (LB_VERDICT(rc) == XDP_DROP)
		info.point = XDPLB_CAP_DROP;
	else if (LB_VERDICT(rc) == XDP_PASS && reason <= XDPLB_EV_PASS_NOT_VIP)
		info.point = XDPLB_CAP_PASS;
	else
		return;
	st = lb_cap_sample(cap, pkt, info.point);
	if (!st)
		return;
	info.reason = reason;
	lb_cap_emit(ctx, cap, st, &info);
}

#endif /* XDPLB_LIB_CAPTURE_H */
