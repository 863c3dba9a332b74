"""The node's BGP side without a network: the configuration BIRD gets (parsed by the
real ``bird -p``), when the announcer announces, and the bgp section's validation."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import pytest

from xdplb.cluster.announce import Announcer
from xdplb.cluster.bird import Bird, Peer, Timers, node_config, static_routes
from xdplb.config import parse_config
from xdplb.core.errors import ConfigError

V4, V6 = ipaddress.ip_address("198.18.100.1"), ipaddress.ip_address("fd78:6470:6c62:100::1")


def doc(**bgp: Any) -> dict[str, Any]:
    return {
        "tunnel": {"source_v4": "198.18.0.2"},
        "vips": [{"address": str(V4), "port": 80, "backends": [{"address": "198.18.0.11"}]}],
        "bgp": {"asn": 65001, "peers": [{"address": "198.18.0.3", "asn": 65000}], **bgp},
    }


def test_node_config_is_valid_bird(tmp_path: Path) -> None:
    peers = [
        Peer(ipaddress.ip_address("198.18.0.3"), 65000),
        Peer(ipaddress.ip_address("fd00::3"), 65000, bfd=False),
    ]
    for fam in (4, 6):
        (tmp_path / f"vips{fam}.conf").write_text(static_routes([V4, V6], fam))
    text = node_config(
        router_id=ipaddress.IPv4Address("198.18.0.2"),
        asn=65001,
        peers=peers,
        timers=Timers(),
        vips_dir=tmp_path,
        log_file=tmp_path / "bird.log",
    )
    Bird(tmp_path).check_config(text)  # BirdError with BIRD's message if not
    assert 'export where proto = "xdplb_vips4"' in text and "bfd off" in text
    assert static_routes([V4, V6], 6) == f"route {V6}/128 blackhole;\n"


class FakeBird(Bird):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.reloads = 0

    def configure(self, text: str | None = None) -> None:
        self.reloads += 1


def test_announce_at_once_withdraw_at_once_back_after_hold_down(tmp_path: Path) -> None:
    cfg = parse_config(doc(hold_down=2.0))
    assert cfg.bgp is not None
    ann = Announcer(cfg.bgp, ipaddress.ip_address("198.18.0.2"), tmp_path)
    ann.bird = FakeBird(tmp_path)

    def announced() -> str:
        return (tmp_path / "vips4.conf").read_text()

    ann.update(None, [V4], now=0.0)
    assert announced() == f"route {V4}/32 blackhole;\n"
    ann.update("eth0 is down", [V4], now=1.0)
    assert announced() == "" and ann.state().withdrawn_because == "eth0 is down"
    ann.update(None, [V4], now=1.5)
    ann.update(None, [V4], now=3.4)
    assert announced() == ""  # passing for 1.9 s of the 2 s hold-down
    ann.update(None, [V4], now=3.6)
    assert announced() == f"route {V4}/32 blackhole;\n"
    assert ann.bird.reloads == 3  # announce, withdraw, announce: no reload without a change
    ann.withdraw("stopping")
    assert announced() == ""
    # The check task runs on during the drain: its passing checks announce nothing.
    ann.update(None, [V4], now=10.0)
    assert announced() == "" and ann.state().withdrawn_because == "stopping"


def test_waiting_for_session_sync_announces_nothing_until_it_is_done(tmp_path: Path) -> None:
    cfg = parse_config(doc(hold_down=2.0))
    assert cfg.bgp is not None
    ann = Announcer(cfg.bgp, ipaddress.ip_address("198.18.0.2"), tmp_path)
    ann.bird = FakeBird(tmp_path)
    ann.update(None, [V4], now=0.0, waiting="session sync: waiting for lb2")
    assert ann.announced == [] and not (tmp_path / "vips4.conf").exists()
    assert ann.state().withdrawn_because == "session sync: waiting for lb2"
    ann.update(None, [V4], now=0.1)  # the first announcement: at once, no hold-down
    assert (tmp_path / "vips4.conf").read_text() == f"route {V4}/32 blackhole;\n"


@pytest.mark.parametrize(
    ("bgp", "tunnel", "field"),
    [
        ({}, {}, "bgp.router_id"),
        ({"peers": []}, {"source_v4": "198.18.0.2"}, "bgp.peers"),
        ({"asn": 0}, {"source_v4": "198.18.0.2"}, "bgp.asn"),
    ],
)
def test_bad_bgp_section_names_the_field(
    bgp: dict[str, Any], tunnel: dict[str, Any], field: str
) -> None:
    d = doc(**bgp)
    d["tunnel"] = tunnel
    d["vips"][0]["backends"] = []
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.field == field


def test_a_vip_of_a_family_no_peer_carries_is_refused() -> None:
    d = doc()
    d["vips"].append({"address": str(V6), "port": 80})
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert e.value.field == "vips[1].address"


#: ``birdc show protocols`` as BIRD 2 prints it: columns padded with blanks, to the end.
SHOW_PROTOCOLS = "\n".join(
    [
        "BIRD 2.0.12 ready.",
        "Name       Proto      Table      State  Since         Info",
        "device1    Device     ---        up     16:11:30.005  ",
        "xdplb_peer1 BGP        ---        up     16:11:34.664  Established   ",
        "xdplb_peer2 BGP        ---        start  16:11:30.010  Active        "
        "Socket: Connection refused",
        "",
    ]
)


def test_protocols_and_sessions_read_birds_padded_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Bird, "command", lambda self, *words, **kw: SHOW_PROTOCOLS)
    bird = Bird(tmp_path)
    assert bird.protocols()["xdplb_peer1"] == "up 16:11:34.664 Established"
    assert bird.protocols()["xdplb_peer2"] == (
        "start 16:11:30.010 Active Socket: Connection refused"
    )
    cfg = parse_config(
        {
            "tunnel": {"source_v4": "198.18.0.2"},
            "bgp": {
                "asn": 65001,
                "peers": [
                    {"address": "198.18.0.3", "asn": 65000},
                    {"address": "198.18.0.7", "asn": 65000},
                ],
            },
        }
    )
    assert cfg.bgp is not None
    announcer = Announcer(cfg.bgp, ipaddress.ip_address("198.18.0.2"), tmp_path)
    sessions = announcer.sessions()
    assert [(s.peer, s.established) for s in sessions] == [
        ("198.18.0.3", True),
        ("198.18.0.7", False),
    ]
