"""The overlay: down and drained backends leave their VIP's weights; a VIP whose every
backend is down keeps its last live weights."""

from __future__ import annotations

import ipaddress

import pytest

from xdplb.config import Config, parse_config
from xdplb.control.overlay import Overlay, effective

pytestmark = pytest.mark.unit

B1, B2, B3 = (ipaddress.ip_address(f"198.18.0.1{i}") for i in (1, 2, 3))
V80, V443 = "198.18.100.1:80/tcp", "198.18.100.1:443/tcp"


def config() -> Config:
    backends = [{"address": str(b), "weight": w} for b, w in ((B1, 2), (B2, 1), (B3, 1))]
    return parse_config(
        {
            "tunnel": {"source_v4": "198.18.0.2"},
            "vips": [
                {"address": "198.18.100.1", "port": 80, "backends": backends},
                {"address": "198.18.100.1", "port": 443, "backends": backends},
            ],
        }
    )


def weights(cfg: Config, i: int = 0) -> dict[str, int]:
    return {str(b.address): b.weight for b in cfg.vips[i].backends}


def test_down_and_drained_leave_only_their_vip() -> None:
    eff = effective(
        config(), Overlay(down=frozenset({(V80, B2)}), drained=frozenset({(V443, B1)})), {}
    )
    assert weights(eff.config, 0) == {str(B1): 2, str(B2): 0, str(B3): 1}
    assert weights(eff.config, 1) == {str(B1): 0, str(B2): 1, str(B3): 1}
    assert eff.all_down == set()
    # Every backend keeps its place: ids and later hops stay.
    assert [len(v.backends) for v in eff.config.vips] == [3, 3]


def test_all_down_keeps_the_last_live_weights() -> None:
    cfg = config()
    eff = effective(cfg, Overlay(down=frozenset({(V80, B1), (V80, B2)})), {})
    assert weights(eff.config) == {str(B1): 0, str(B2): 0, str(B3): 1}
    everyone = frozenset({(V80, B1), (V80, B2), (V80, B3)})
    eff2 = effective(cfg, Overlay(down=everyone), eff.last_live)
    assert eff2.all_down == {V80}
    assert weights(eff2.config) == {str(B1): 0, str(B2): 0, str(B3): 1}  # the last table
    # Without history (a restarted daemon), all down means: the configured weights.
    eff3 = effective(cfg, Overlay(down=everyone), {})
    assert weights(eff3.config) == {str(B1): 2, str(B2): 1, str(B3): 1}
    # A drained backend is not brought back by "all down".
    eff4 = effective(cfg, Overlay(down=everyone, drained=frozenset({(V80, B3)})), eff.last_live)
    assert weights(eff4.config) == {str(B1): 2, str(B2): 1, str(B3): 0}
    # Back to live: the memory follows.
    eff5 = effective(cfg, Overlay(down=frozenset({(V80, B3)})), eff2.last_live)
    assert weights(eff5.config) == {str(B1): 2, str(B2): 1, str(B3): 0}
    assert eff5.last_live[V80] == {B1: 2, B2: 1}


def test_all_drained_is_empty_not_all_down() -> None:
    drained = frozenset({(V80, B1), (V80, B2), (V80, B3)})
    eff = effective(config(), Overlay(drained=drained), {})
    assert weights(eff.config) == {str(B1): 0, str(B2): 0, str(B3): 0}
    assert eff.all_down == set()
