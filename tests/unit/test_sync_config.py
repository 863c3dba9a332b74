"""The ``sync`` section: what a wrong one is refused for (the field named), and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xdplb.config import parse_config
from xdplb.control.planner import desired_config
from xdplb.core import abi
from xdplb.core.errors import ConfigError

pytestmark = pytest.mark.unit

KEY = "0f" * 32


def doc(sync: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "instance": "lb1",
        "tunnel": {"source_v4": "198.18.0.2"},
        "vips": [{"address": "198.18.100.1", "port": 80, "backends": [{"address": "198.18.0.11"}]}],
        **top,
    }
    if sync is not None:
        d["sync"] = {"listen": "198.18.0.2:7946", "key": KEY, **sync}
    return d


@pytest.mark.parametrize(
    ("sync", "top", "field"),
    [
        ({"listen": "lb1:7946"}, {}, "sync.listen"),
        ({"key": "abcd"}, {}, "sync.key"),  # 2 bytes
        ({"key_file": "/etc/k"}, {}, "sync.key"),  # both
        ({"peers": [{"node": "lb2", "address": "198.18.0.4"}]}, {}, "sync.peers[0].address"),
        ({"peers": [{"node": "x" * 17, "address": "198.18.0.4:1"}]}, {}, "sync.peers[0].node"),
        ({"peers": [{"node": "lb2", "address": "198.18.0.4:1"}] * 2}, {}, "sync.peers"),
        ({"peers": [{"node": "lb1", "address": "198.18.0.4:1"}]}, {}, "sync.peers"),
        ({}, {"instance": "a-very-long-instance-name"}, "sync.node"),
    ],
)
def test_a_wrong_sync_section_names_the_field(
    sync: dict[str, Any], top: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc(sync, **top))
    assert e.value.field == field, e.value


def test_the_key_from_a_file_and_the_export_flag(tmp_path: Path) -> None:
    key = tmp_path / "sync.key"
    key.write_text(KEY + "\n")
    cfg = parse_config(doc({"key": None, "key_file": str(key)}))
    assert cfg.sync is not None and cfg.sync.secret() == bytes.fromhex(KEY)
    assert cfg.sync_node == "lb1"
    assert desired_config(cfg).flags & abi.CFG_F_EXPORT
    key.write_text("not hex\n")
    with pytest.raises(ConfigError) as e:
        cfg.sync.secret()
    assert e.value.field == "sync.key_file"
    # No VIP syncs, or no sync: lb_xdp exports nothing.
    off = doc({})
    off["vips"][0]["sync"] = False
    assert not desired_config(parse_config(off)).flags & abi.CFG_F_EXPORT
    assert not desired_config(parse_config(doc())).flags & abi.CFG_F_EXPORT
