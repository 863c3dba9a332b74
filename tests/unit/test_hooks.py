"""The hook per interface: the configuration's forms and the choice ``auto`` makes."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from xdplb.config import HookName, parse_config
from xdplb.core.errors import ConfigError
from xdplb.datapath import hooks
from xdplb.datapath.hooks import Hook
from xdplb.lab import netns

pytestmark = pytest.mark.unit


def config(interfaces: list[Any]) -> dict[str, Any]:
    return {"instance": "hooks", "interfaces": interfaces}


def test_a_name_alone_is_auto_and_is_written_back_alone() -> None:
    cfg = parse_config(config(["eth0", {"name": "veth1", "hook": "tc"}]))
    assert [(i.name, i.hook) for i in cfg.interfaces] == [
        ("eth0", HookName.AUTO),
        ("veth1", HookName.TC),
    ]
    assert cfg.ifnames == ["eth0", "veth1"]
    dumped = cfg.model_dump(mode="json")["interfaces"]
    assert dumped == ["eth0", {"name": "veth1", "hook": "tc"}]
    assert parse_config(config(dumped)) == cfg


@pytest.mark.parametrize(
    ("interfaces", "field", "words"),
    [
        ([{"name": "eth0", "hook": "ebpf"}], "interfaces[0].hook", "auto"),
        (["eth0", {"name": "eth0", "hook": "xdp"}], "interfaces", "listed twice"),
        ([{"name": "a/b"}], "interfaces[0].name", "not a valid interface name"),
        ([{"hook": "tc"}], "interfaces[0].name", "required"),
    ],
)
def test_a_bad_interface_is_refused_naming_the_field(
    interfaces: list[Any], field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(config(interfaces))
    assert e.value.field == field
    assert words in str(e.value)


def test_a_configured_hook_is_taken_as_it_is() -> None:
    assert hooks.choose("no-such-if", "xdp") == hooks.HookChoice(
        "no-such-if", Hook.XDP, "configured"
    )
    assert hooks.choose("no-such-if", "tc").hook is Hook.TC


@pytest.fixture
def veth_ns() -> Iterator[str]:
    name = f"xdplbu-hooks-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(
            ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            check=True,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_auto_picks_tc_on_veth_and_loopback(veth_ns: str) -> None:
    with netns.enter(veth_ns):
        assert hooks.driver_info("v0") == ("veth", "")
        choice = hooks.choose("v0", "auto")
        assert choice.hook is Hook.TC
        assert "veth is a virtual device" in choice.why
        assert hooks.choose("lo", "auto").hook is Hook.TC
        with pytest.raises(OSError):
            hooks.choose("nope0", "auto")


def test_auto_picks_xdp_on_a_device_with_a_bus_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a NIC's driver reports (ethtool -i: bus-info) is all auto looks at."""
    monkeypatch.setattr(hooks, "driver_info", lambda ifname: ("mlx5_core", "0000:3b:00.0"))
    choice = hooks.choose("eth0", "auto")
    assert choice.hook is Hook.XDP
    assert choice.why == "auto: a NIC (mlx5_core at 0000:3b:00.0)"
