// SPDX-License-Identifier: (GPL-2.0-only OR BSD-2-Clause)
/*
 * lb_xdp_novalidate: lb_xdp_check whose readers ignore their second load of
 * seq (XDPLB_TEST_NO_VALIDATE in bpf/lib/lb_conns.h): a writer that claims
 * the set while a lookup reads it goes unnoticed.  Writers claim as in
 * production.  A build broken on purpose, which tests/bpf/test_concurrency.py
 * must catch.  Never loaded by xdplb.
 */
#define XDPLB_TEST_NO_VALIDATE
/* The second load of seq is made, and then not looked at. */
#pragma clang diagnostic ignored "-Wunused-but-set-variable"
#include "lb_xdp_check.bpf.c"
