"""The configuration's models are strict (issue 10, failure 13): a number or boolean of
the wrong kind is refused naming its field, never coerced; what YAML and JSON can only
write as text (addresses, paths, enum names) is read from text only; enum names are
case-insensitive and written back in lower case (failure 9, ``protocol: TCP``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from xdplb.config import Protocol, load_config, parse_config
from xdplb.core.errors import ConfigError

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {"tunnel": {"source_v4": "198.18.0.2"}}


def vip(**fields: Any) -> dict[str, Any]:
    return {**BASE, "vips": [{"address": "198.18.100.1", "port": 80, **fields}]}


def refused(data: dict[str, Any]) -> tuple[str, str]:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    return e.value.field, e.value.message


@pytest.mark.parametrize("weight", ["3", True, 3.0])
def test_a_weight_is_an_integer(weight: Any) -> None:
    data = vip(backends=[{"address": "198.18.0.11", "weight": weight}])
    assert refused(data) == ("vips[0].backends[0].weight", "Input should be a valid integer")


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (vip(port="80"), "vips[0].port", "Input should be a valid integer"),
        (vip(icmp_echo=1), "vips[0].icmp_echo", "Input should be a valid boolean"),
        (vip(icmp_echo="yes"), "vips[0].icmp_echo", "Input should be a valid boolean"),
        ({**BASE, "hash_seed": 1.5}, "hash_seed", "Input should be a valid integer"),
        ({**BASE, "table_size": "65537"}, "table_size", "Input should be a valid integer"),
        (
            vip(address=3232261121),
            "vips[0].address",
            "must be an IPv4 or IPv6 address, as a string",
        ),
        (vip(address=True), "vips[0].address", "must be an IPv4 or IPv6 address, as a string"),
        (vip(address="nope"), "vips[0].address", "'nope' is not an IPv4 or IPv6 address"),
        ({"tunnel": {"source_v4": 1}}, "tunnel.source_v4", "must be an IPv4 address, as a string"),
        (
            {"tunnel": {"source_v6": "198.18.0.2"}},
            "tunnel.source_v6",
            "'198.18.0.2' is not an IPv6 address",
        ),
        (vip(protocol=6), "vips[0].protocol", "Input should be 'tcp' or 'udp'"),
        (vip(protocol="sctp"), "vips[0].protocol", "Input should be 'tcp' or 'udp'"),
        (
            {**BASE, "api": {"token_file": 7}},
            "api.token_file",
            "Input is not a valid path for <class 'pathlib.Path'>",
        ),
        (
            vip(health={"checker": {"http": {"codes": ["200"]}}}),
            "vips[0].health.checker.http.codes[0]",
            "Input should be a valid integer",
        ),
    ],
)
def test_no_coercion(data: dict[str, Any], field: str, message: str) -> None:
    assert refused(data) == (field, message)


def test_what_yaml_writes_is_accepted(tmp_path: Path) -> None:
    """YAML's own numbers, booleans, lists and strings: an int where a float is due, a
    list where a tuple is, text for addresses and paths."""
    path = tmp_path / "xdplb.yaml"
    path.write_text(
        "tunnel: {source_v4: 198.18.0.2, source_v6: 'fd78:6470:6c62::2'}\n"
        "api: {listen: '127.0.0.1:9180', token_file: /etc/xdplb/token}\n"
        "agents: {listen: '198.18.0.2:9190'}\n"
        "load_feedback: {min_interval: 60, backend_bounds: {198.18.0.11: {max_weight: 9}}}\n"
        "vips:\n"
        "  - address: 198.18.100.1\n"
        "    port: 80\n"
        "    icmp_echo: yes\n"
        "    load_feedback: true\n"
        "    beamer: {min_interval: 1}\n"
        "    health: {checker: {http: {codes: [200, 204]}}, jitter: 0}\n"
        "    backends: [{address: 198.18.0.11, weight: 3}, {address: 'fd78:6470:6c62::11'}]\n"
    )
    cfg = load_config(path)
    v = cfg.vips[0]
    assert (v.icmp_echo, v.beamer.min_interval, v.backends[0].weight) == (True, 1.0, 3)
    assert v.health is not None and v.health.checker.http is not None
    assert v.health.checker.http.codes == (200, 204)
    assert cfg.api.token_file == Path("/etc/xdplb/token")
    assert cfg.load_feedback is not None
    assert [str(a) for a in cfg.load_feedback.backend_bounds] == ["198.18.0.11"]


@pytest.mark.parametrize("spelling", ["TCP", "Tcp", "tcp"])
def test_protocol_in_any_case(spelling: str) -> None:
    cfg = parse_config(vip(protocol=spelling, encap="IPIP"))
    assert cfg.vips[0].protocol is Protocol.TCP
    assert cfg.vips[0].name == "198.18.100.1:80/tcp"
    dumped = cfg.model_dump(mode="json")["vips"][0]
    assert (dumped["protocol"], dumped["encap"]) == ("tcp", "ipip")
    assert parse_config(cfg.model_dump(mode="json")) == cfg
