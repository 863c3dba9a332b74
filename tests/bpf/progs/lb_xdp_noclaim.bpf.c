// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lb_xdp_noclaim: lb_xdp_check with the session table's claim removed
 * (XDPLB_TEST_NO_CLAIM in bpf/lib/lb_conns.h): writers store into a set
 * without taking it, so seq never moves and readers' checks of it see
 * nothing.  A build broken on purpose, which tests/bpf/test_concurrency.py
 * must catch.  Never loaded by xdplb.
 */
#define XDPLB_TEST_NO_CLAIM
#include "lb_xdp_check.bpf.c"
