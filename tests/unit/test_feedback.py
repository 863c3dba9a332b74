"""The daemon's load-feedback wiring: reports over UDP (loopback) move the weights of the
VIPs that asked for it, and only theirs; reconfiguration keeps what was learned."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from xdplb.agent.receiver import ReportReceiver
from xdplb.agent.wire import WireReport, encode_report
from xdplb.config import Config, parse_config
from xdplb.control.vip_weights import WeightFeedback
from xdplb.core.errors import ConfigError

pytestmark = pytest.mark.unit

B1, B2 = "198.18.0.11", "198.18.0.12"


def config(**lf: Any) -> Config:
    backends = [{"address": B1}, {"address": B2}]
    return parse_config(
        {
            "tunnel": {"source_v4": "198.18.0.2"},
            "agents": {"listen": "127.0.0.1:0"},
            "load_feedback": {"min_interval": 1, "settle": 0.1, **lf},
            "vips": [
                {
                    "address": "198.18.100.1",
                    "port": 80,
                    "load_feedback": True,
                    "backends": backends,
                },
                {"address": "198.18.100.1", "port": 443, "backends": backends},
            ],
        }
    )


def weights(cfg: Config) -> list[dict[str, int]]:
    return [{str(b.address): b.weight for b in v.backends} for v in cfg.vips]


def test_reports_move_only_the_vip_that_asked() -> None:
    cfg = config()
    fb = WeightFeedback(cfg.load_feedback)  # type: ignore[arg-type]
    rx = ReportReceiver(("127.0.0.1", 0))
    try:
        fb.configure(cfg)
        assert weights(fb.effective(cfg)) == [{B1: 500, B2: 500}, {B1: 1, B2: 1}]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for seq in range(1, 6):
                s.sendto(encode_report(WireReport(B1, 0.9, 10.0, seq)), rx.address)
                s.sendto(encode_report(WireReport(B2, 0.3, 10.0, seq)), rx.address)
                s.sendto(b"not a report", rx.address)
        assert fb.step(100.0, rx.poll())
        got = weights(fb.effective(cfg))
        assert got[0][B1] < 500 < got[0][B2] and got[0][B1] + got[0][B2] == 1000
        assert got[1] == {B1: 1, B2: 1}
        assert rx.stats.malformed == 5
        # Same settings: the controller and what it learned stay.
        fb.configure(config())
        assert weights(fb.effective(cfg))[0] == got[0]
        # New settings: a fresh controller from the configured weights.
        fb.configure(config(gain=0.3))
        assert weights(fb.effective(cfg))[0] == {B1: 500, B2: 500}
    finally:
        rx.close()


def test_a_vip_asking_for_feedback_needs_the_section() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({"vips": [{"address": "198.18.100.1", "load_feedback": True}]})
    assert exc.value.field == "vips[0].load_feedback"
    with pytest.raises(ConfigError) as exc:
        config(settle=5)
    assert exc.value.field == "load_feedback.settle"
    with pytest.raises(ConfigError) as exc:
        parse_config({"load_feedback": {}})
    assert exc.value.field == "load_feedback"


def test_per_backend_bounds_hold() -> None:
    cfg = config(backend_bounds={B2: {"min_weight": 1, "max_weight": 550}}, gain=1.0)
    fb = WeightFeedback(cfg.load_feedback)  # type: ignore[arg-type]
    rx = ReportReceiver(("127.0.0.1", 0))
    try:
        fb.configure(cfg)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for seq in range(1, 6):
                s.sendto(encode_report(WireReport(B1, 0.95, 10.0, seq)), rx.address)
                s.sendto(encode_report(WireReport(B2, 0.05, 10.0, seq)), rx.address)
        assert fb.step(100.0, rx.poll())
        assert weights(fb.effective(cfg))[0][B2] <= 550
    finally:
        rx.close()
    with pytest.raises(ConfigError) as exc:
        config(backend_bounds={B2: {"min_weight": 9, "max_weight": 5}})
    assert exc.value.field == f"load_feedback.backend_bounds.{B2}.min_weight"
