"""The reference model of ``lb_xdp``: what the XDP program must do with one frame.

docs/datapath.md is the contract; this package is that page as executable Python,
step by step (the step numbers in comments are the page's).  The tests run the
same packets through the real program (BPF_PROG_TEST_RUN) and through
:func:`decide` and compare verdicts, counters and output bytes, so a bug on
either side shows up as a disagreement rather than as a lost connection.

The model is pure: a frozen :class:`DataplaneState` (what the maps hold) and a
frame go in, a frozen :class:`Decision` comes out, no I/O.  It stops where
the program starts depending on the kernel's neighbour and route tables
(``bpf_fib_lookup``): a forwarded packet is :attr:`Outcome.FORWARD` with the
exact encapsulated packet from the outer IP header on; whether it then leaves
by ``XDP_TX``, ``XDP_REDIRECT`` or ``XDP_PASS`` is the FIB's business.

Packets are parsed with ``struct`` and slicing, not scapy: the tests push
hundreds of thousands of frames through here, and a parser that "fixes" a
malformed packet on the way in would hide exactly the cases that matter.

For bulk questions ("which backend gets each of these 10^6 flows?") use
:func:`predict_many`, which hashes with numpy.

The modules, in the order of the steps: :mod:`~xdplb.model.state` (the input),
:mod:`~xdplb.model.decision` (the answer), :mod:`~xdplb.model.parse` (1-5),
:mod:`~xdplb.model.icmp` (4a-4c), :mod:`~xdplb.model.policy` (5a, 6a, 8a),
:mod:`~xdplb.model.select` (8-9), :mod:`~xdplb.model.encap` (10-11, with
:mod:`~xdplb.model.checksum`), :mod:`~xdplb.model.decide` (all of them for one
frame), :mod:`~xdplb.model.predict` (flows without packets).  Frames for tests and
benchmarks are built by :mod:`~xdplb.model.frames`.

May import: core. (Of other libraries, numpy.)
"""

from xdplb.model.decide import apply, decide
from xdplb.model.decision import Decision, Outcome, XdpAction
from xdplb.model.predict import FlowBatch, Predictions, predict_backend, predict_many
from xdplb.model.state import DataplaneState, Flow, flow_key, state_from_snapshot

__all__ = [
    "DataplaneState",
    "Decision",
    "Flow",
    "FlowBatch",
    "Outcome",
    "Predictions",
    "XdpAction",
    "apply",
    "decide",
    "flow_key",
    "predict_backend",
    "predict_many",
    "state_from_snapshot",
]
