/* SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause) */
/*
 * The outer source address of a tunnel (struct xdplb_config's src4/src6), shared by
 * lb_xdp (lib/encap.h) and hc_tc (lib/hc_encap.h).
 */
#ifndef XDPLB_LIB_OUTER_H
#define XDPLB_LIB_OUTER_H

#include <linux/types.h>
#include <bpf/bpf_helpers.h>

#include "xdplb_abi.h"

/* The configuration has an outer source address of this family. */
static __always_inline int outer_has_src(const struct xdplb_config *cfg, const int v6)
{
	if (!v6)
		return cfg->src4 != 0;
	return (cfg->src6[0] | cfg->src6[1] | cfg->src6[2] | cfg->src6[3]) != 0;
}

/* addr (four words, IPv4 in word 0) is the outer source itself: the LB's own. */
static __always_inline int outer_is_src(const struct xdplb_config *cfg, const __u32 *addr,
					const int v6)
{
	if (!v6)
		return addr[0] == cfg->src4;
	return addr[0] == cfg->src6[0] && addr[1] == cfg->src6[1] &&
	       addr[2] == cfg->src6[2] && addr[3] == cfg->src6[3];
}

#endif /* XDPLB_LIB_OUTER_H */
