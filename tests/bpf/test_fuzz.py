"""The structure-aware fuzz of lb_xdp against xdplb.model, and its kept corpus.

- test_corpus_replays: every case in tests/bpf/corpus/ (disagreements the fuzz found,
  one small JSON file each) goes through today's program and model, which must agree.
- test_fuzz: FUZZ_PACKETS frames (default 1,000,000) drawn by hypothesis
  (tests/bpf/fuzz_strategies.py) and expanded into truncations and corruptions, through
  BPF_PROG_TEST_RUN in two worker processes, each with its own lb_xdp, compared with the
  model packet by packet (verdict, backend, bytes) and chunk by chunk (counters, the
  connection table).  What lb_xdp sends to a backend also goes through host_tc, which
  must hand back the client's packet byte for byte, and a share of the raw fuzz frames
  goes through host_tc too (a verdict it may give; a changed frame only as a
  decapsulation).  Each disagreement is written to the corpus before the test fails.
  The run is reproducible: FUZZ_SEED (printed) fixes hypothesis' draws.

``make fuzz FUZZ_PACKETS=...`` runs only the fuzz, with any count.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fuzz_lb import (
    CORPUS,
    DEFAULT_SEED,
    STATES,
    Checker,
    Problem,
    load_cases,
    load_host,
    replay,
    run_fuzz,
    write_case,
)
from test_differential import ModelLb, mlb

from xdplb import model
from xdplb.core import abi
from xdplb.datapath import BpfObject
from xdplb.model import frames

pytestmark = pytest.mark.bpf

__all__ = ["mlb"]  # the fixture, re-exported so that pytest finds it here

FUZZ_PACKETS = int(os.environ.get("FUZZ_PACKETS", "1000000"))
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", str(DEFAULT_SEED)), 0)
FUZZ_WORKERS = int(os.environ.get("FUZZ_WORKERS", "2"))
#: Disagreements kept per run: one bug often shows up in hundreds of frames.
MAX_CASES = 64


@pytest.fixture(scope="module")
def host(mlb: ModelLb) -> Iterator[BpfObject]:
    """host_tc for the replays, configured for the states' backends."""
    root = Path(f"/sys/fs/bpf/xdplbt-{os.getpid()}-fuzz-host")
    try:
        obj = load_host(str(root), STATES["differential-v1"]())
        try:
            yield obj
        finally:
            obj.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_corpus_replays(mlb: ModelLb, host: BpfObject) -> None:
    cases = load_cases()
    failed = []
    for name, case in cases:
        problem = replay(mlb, case, host)
        if problem is not None:
            failed.append(f"{name}: the model said then: {case.expected}\n  now: {problem}")
    print(f"{len(cases)} corpus cases replayed")
    assert not failed, f"{len(failed)} of {len(cases)} corpus cases disagree:\n" + "\n".join(failed)


def test_replay_catches_a_disagreement(mlb: ModelLb, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: a model that says PASS where the program forwards,
    and one whose forwarded bytes differ by one, are both reported, as is a counter the
    program moved and the model did not."""
    state = Checker(mlb, "differential-v1").state
    vip = next(v for v in state.vips if v.port and v.addr.version == 4)
    flow = model.Flow(ipaddress.IPv4Address("198.18.128.9"), vip.addr, 4242, vip.port, vip.proto)
    frame = frames.frame(flow)
    case = Problem(frame.hex(), "", "", 0, "")
    assert replay(mlb, case) is None
    real = model.decide

    def passes(st: model.DataplaneState, fr: bytes) -> model.Decision:
        return model.Decision(model.Outcome.PASS, events=(abi.Event.PASS_NOT_VIP,))

    monkeypatch.setattr(model, "decide", passes)
    assert "program returned TX" in (replay(mlb, case) or "")

    def one_byte_off(st: model.DataplaneState, fr: bytes) -> model.Decision:
        d = real(st, fr)
        assert d.packet is not None
        return dataclasses.replace(d, packet=d.packet[:-1] + b"\xff")

    monkeypatch.setattr(model, "decide", one_byte_off)
    assert "first difference at byte" in (replay(mlb, case) or "")


#: lb_tc shares every line of the decision with lb_xdp (lib/lb_run.h): a quarter of the
#: packets covers what differs (its context, its verdicts, growing an skb).
@pytest.mark.parametrize(
    ("program", "packets"), [("lb_xdp", FUZZ_PACKETS), ("lb_tc", FUZZ_PACKETS // 4)]
)
def test_fuzz(program: str, packets: int) -> None:
    report = run_fuzz(packets, FUZZ_SEED, FUZZ_WORKERS, program=program)
    print(program, report.summary())
    written = sorted(
        {write_case(p, note=f"fuzz seed {FUZZ_SEED:#x}").name for p in report.problems[:MAX_CASES]}
    )
    assert report.packets >= packets
    if report.problems:
        first = "\n".join(
            f"{p.detail}\n  model {p.expected}\n  frame {p.frame}" for p in report.problems[:5]
        )
        pytest.fail(
            f"{len(report.problems)} disagreements (seed {FUZZ_SEED:#x}), "
            f"{len(written)} kept in {CORPUS}: {written}\nfirst ones:\n{first}"
        )
    assert report.host_runs >= packets // 8
    # The frames reached every kind of verdict, forwarding included.
    kinds = {k.split(":")[0] for k in report.outcomes}
    assert {"pass", "drop", "forward"} <= kinds, report.outcomes
