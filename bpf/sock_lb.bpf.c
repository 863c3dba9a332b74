// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * sock_lb: socket-level service balancing, attached to a cgroup.  A client in
 * the cgroup that connects or sends to a service address is sent to a backend
 * chosen by the service's Maglev table (built as the XDP tier builds it), at
 * the socket call, so no packet is ever translated; replies and getpeername
 * show the service address; binding one is refused.  An iter/udp program
 * destroys the connected UDP sockets of backends that went down.
 *
 * Logic and maps: lib/sock_lb.h.  User guide: docs/sock_lb.md.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "sock_lb_abi.h"
#include "lib/sock_lb.h"

SEC("cgroup/connect4")
int sock_lb_connect4(struct bpf_sock_addr *ctx)
{
	return socklb_redirect(ctx, SOCKLB_FAMILY_V4, SOCKLB_EV_CONNECT);
}

SEC("cgroup/connect6")
int sock_lb_connect6(struct bpf_sock_addr *ctx)
{
	return socklb_redirect(ctx, SOCKLB_FAMILY_V6, SOCKLB_EV_CONNECT);
}

/* Only unconnected UDP sends reach these hooks (they name a destination). */
SEC("cgroup/sendmsg4")
int sock_lb_sendmsg4(struct bpf_sock_addr *ctx)
{
	return socklb_redirect(ctx, SOCKLB_FAMILY_V4, SOCKLB_EV_SENDMSG);
}

SEC("cgroup/sendmsg6")
int sock_lb_sendmsg6(struct bpf_sock_addr *ctx)
{
	return socklb_redirect(ctx, SOCKLB_FAMILY_V6, SOCKLB_EV_SENDMSG);
}

SEC("cgroup/recvmsg4")
int sock_lb_recvmsg4(struct bpf_sock_addr *ctx)
{
	return socklb_unredirect(ctx, SOCKLB_FAMILY_V4, SOCKLB_EV_RECVMSG);
}

SEC("cgroup/recvmsg6")
int sock_lb_recvmsg6(struct bpf_sock_addr *ctx)
{
	return socklb_unredirect(ctx, SOCKLB_FAMILY_V6, SOCKLB_EV_RECVMSG);
}

SEC("cgroup/getpeername4")
int sock_lb_getpeername4(struct bpf_sock_addr *ctx)
{
	return socklb_unredirect(ctx, SOCKLB_FAMILY_V4, SOCKLB_EV_PEERNAME);
}

SEC("cgroup/getpeername6")
int sock_lb_getpeername6(struct bpf_sock_addr *ctx)
{
	return socklb_unredirect(ctx, SOCKLB_FAMILY_V6, SOCKLB_EV_PEERNAME);
}

SEC("cgroup/post_bind4")
int sock_lb_post_bind4(struct bpf_sock *sk)
{
	return socklb_check_bind(sk, SOCKLB_FAMILY_V4);
}

SEC("cgroup/post_bind6")
int sock_lb_post_bind6(struct bpf_sock *sk)
{
	return socklb_check_bind(sk, SOCKLB_FAMILY_V6);
}

/*
 * Run by user space after a backend went down: each destroyed socket's
 * cookie is written out (8 bytes), and its owner's next call fails with
 * ECONNABORTED, so the client reconnects and is balanced again.
 */
SEC("iter/udp")
int sock_lb_destroy(struct bpf_iter__udp *ctx)
{
	struct udp_sock *udp = ctx->udp_sk;
	__u64 cookie = 0;

	if (!udp || !socklb_doomed(&udp->inet.sk.__sk_common, &cookie))
		return 0;
	if (bpf_sock_destroy((struct sock_common *)udp)) {
		socklb_count(SOCKLB_EV_DESTROY_FAILED);
		return 0;
	}
	socklb_count(SOCKLB_EV_DESTROYED);
	bpf_seq_write(ctx->meta->seq, &cookie, sizeof(cookie));
	return 0;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
