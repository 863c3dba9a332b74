"""The one status builder: the daemon's status and the one read from the pins have the
same schema, agree on what the maps say, and the pins' leave the daemon-only fields None."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from xdplb.cli import app as app_module
from xdplb.config import Config, parse_config
from xdplb.control import planner
from xdplb.control.status import (
    BackendView,
    DaemonView,
    MapsView,
    Status,
    VipView,
    build,
)
from xdplb.core import abi
from xdplb.core.state import Snapshot
from xdplb.datapath.lb import Counters, MapFill

pytestmark = pytest.mark.unit

CONFIG: dict[str, Any] = {
    "instance": "st",
    "tunnel": {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"},
    "table_size": 251,
    "vips": [
        {
            "address": "198.18.100.1",
            "port": 80,
            "backends": [{"address": "198.18.0.11", "weight": 2}, {"address": "198.18.0.12"}],
            "acl": {"deny": ["198.18.7.0/24"]},
        },
        {
            "address": "fd78:6470:6c62:100::1",
            "port": 53,
            "protocol": "udp",
            "encap": "ipip",
            "hash": "source",
            "table": "beamer",
            "table_size": 64,
            "backends": [{"address": "fd78:6470:6c62::11"}],
        },
    ],
}


def maps_of(cfg: Config) -> MapsView:
    snap = planner.apply_to_snapshot(Snapshot(), planner.plan(cfg, Snapshot()))
    return MapsView(
        instance=cfg.instance,
        snapshot=snap,
        counters=Counters(
            drops={r: 0 for r in abi.DropReason},
            events={e: 7 for e in abi.Event},
            vips={p.vip_id: abi.Stats(10 * p.vip_id, 100, 1) for p in snap.vips.values()},
            backends={i: abi.Stats(i, 2 * i, 3) for i in snap.backends},
            conns=5,
            acl_hits={abi.ACL_GLOBAL: {abi.AclList.DENY: 2}},
        ),
        conns_estimated=False,
        fill=[MapFill("lb_vips", len(snap.vips), 16), MapFill("lb_conns", 5, 4096)],
        attached={"eth0": "xdp"},
        conn_capacity=4096,
    )


def daemon_of(cfg: Config) -> DaemonView:
    return DaemonView(
        config_path="/etc/xdplb/st.yaml",
        runtime_changes=False,
        uptime=12.0,
        rebuilds=1,
        last_rebuild_ms=0.5,
        health_checks=0,
        vips=[
            VipView.configured(
                v,
                table_size=cfg.vip_table_size(v),
                all_down=False,
                backends=[BackendView(b.address, b.weight, b.weight) for b in v.backends],
            )
            for v in cfg.vips
        ],
    )


def keys(doc: Any, path: str = "") -> set[str]:
    """Every field path of a JSON document (list items merged: ``vips[].name``)."""
    if isinstance(doc, dict):
        out = set()
        for k, v in doc.items():
            # drops/events are keyed by name: their keys are data, not schema.
            out |= {f"{path}.{k}"} | (set() if k in ("drops", "events") else keys(v, f"{path}.{k}"))
        return out
    if isinstance(doc, list):
        return set().union(*(keys(v, f"{path}[]") for v in doc))
    return set()


def test_the_pins_and_the_daemon_give_one_schema() -> None:
    cfg = parse_config(CONFIG)
    maps = maps_of(cfg)
    daemon, pins = build(maps, daemon_of(cfg)), build(maps)
    d, p = daemon.model_dump(mode="json"), pins.model_dump(mode="json")
    assert keys(d) == keys(p)
    assert ".vips[].backends[].table_share" in keys(p) and ".maps[].estimated" in keys(p)
    assert Status.model_validate_json(pins.model_dump_json()) == pins
    assert (daemon.source, pins.source) == ("daemon", "pins")

    # What the maps say, both say alike (the VIPs here are in id order in the file too).
    def of_maps(st: dict[str, Any]) -> Any:
        return [
            (
                {k: v[k] for k in ("name", "id", "encap", "hash", "table", "table_size")},
                [(b["address"], b["id"], b["table_share"], b["packets"]) for b in v["backends"]],
            )
            for v in st["vips"]
        ]

    assert of_maps(d) == of_maps(p)
    for k in ("attached", "drops", "events", "conn_table", "maps", "acl"):
        assert d[k] == p[k], k
    assert [h["scope"] for h in p["acl"]] == ["global", "198.18.100.1:80/tcp"]
    shares = [b["table_share"] for b in p["vips"][0]["backends"]]
    assert sum(shares) == pytest.approx(1.0) and shares[0] > shares[1]
    assert p["vips"][1]["name"] == "[fd78:6470:6c62:100::1]:53/udp"
    assert (p["vips"][1]["encap"], p["vips"][1]["hash"]) == ("ipip", "source")

    # What only the daemon knows: None from the pins.
    for k in ("config_path", "runtime_changes", "uptime", "rebuilds", "health_checks"):
        assert p[k] is None and d[k] is not None, k
    for v in p["vips"]:
        assert v["all_down"] is None and v["health_checked"] is None
        for b in v["backends"]:
            assert (b["weight"], b["effective_weight"], b["established"]) == (None, None, None)
            assert (b["health"], b["admin"]) == ("unchecked", "enabled")


def test_a_configured_vip_not_in_the_maps_yet() -> None:
    cfg = parse_config(CONFIG)
    more = parse_config(
        {**CONFIG, "vips": [*CONFIG["vips"], {"address": "198.18.100.9", "port": 443}]}
    )
    st = build(maps_of(cfg), daemon_of(more))
    assert [v.id for v in st.vips] == [st.vips[0].id, st.vips[1].id, None]
    assert st.vips[2].packets == 0 and st.vips[2].backends == []


def test_the_connection_count_of_a_sample_is_marked_estimated() -> None:
    maps = maps_of(parse_config(CONFIG))
    sampled = MapsView(**{**maps.__dict__, "conns_estimated": True})
    est = {m.name: m.estimated for m in build(sampled).maps}
    assert est == {"lb_vips": False, "lb_conns": True}
    assert not any(m.estimated for m in build(maps).maps)


def test_the_cli_prints_a_status_from_the_pins_like_the_daemons(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``xdplb status --offline`` reads the pins and prints them with the daemon's
    renderer; ``--json`` is the same Status schema. Without --offline, no daemon is exit 3
    (the pins are never read behind the operator's back)."""
    cfg = parse_config(CONFIG)
    pins = build(maps_of(cfg))
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))  # no API socket there
    monkeypatch.setattr(app_module, "from_pins", lambda name: pins)
    out = CliRunner().invoke(app_module.app, ["status", "-i", "st"])
    assert out.exit_code == 3, out.output
    assert out.stderr == (
        f"instance st is not running: no daemon: {tmp_path}/st.api.sock does not exist "
        "('xdplb status --offline' reads the pinned maps)\n"
    )
    out = CliRunner().invoke(app_module.app, ["status", "-i", "st", "--offline"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == (
        "instance st, attached to eth0 (xdp); no daemon answers: read from the pins"
    )
    assert lines[1] == "connection table 5 of 4096 entries"
    # Weight and Eff unknown from the pins; health unchecked, admin enabled: no State.
    assert any(ln.split()[:4] == ["->", "198.18.0.11:80", "-", "-"] for ln in lines)
    assert all(len(ln) <= 100 for ln in lines)
    assert any(ln.split()[:4] == ["lb_vips", "2", "of", "16"] for ln in lines)
    out = CliRunner().invoke(app_module.app, ["status", "-i", "st", "--json", "--offline"])
    assert out.exit_code == 0, out.output
    assert Status.model_validate_json(out.output) == pins
