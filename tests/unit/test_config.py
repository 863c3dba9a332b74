"""Configuration: valid files load, and every refusal names the field at fault."""

from __future__ import annotations

import ipaddress
import textwrap
from pathlib import Path
from typing import Any

import pytest

from xdplb.config import Config, EncapKind, HashFields, load_config, parse_config
from xdplb.core.errors import ConfigError

pytestmark = pytest.mark.unit

GOOD = textwrap.dedent(
    """
    instance: lab
    interfaces: [eth0]
    tunnel: {source_v4: 198.18.0.2, source_v6: "fd78:6470:6c62::2"}
    vips:
      - address: 198.18.100.1
        port: 80
        protocol: tcp
        backends:
          - {address: 198.18.0.11, weight: 2}
          - {address: 198.18.0.12}
      - address: "fd78:6470:6c62:100::1"
        port: 0
        protocol: udp
        encap: ipip
        hash: source
        table_size: 1009
        backends: [{address: "fd78:6470:6c62::11"}]
    """
)


def good() -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(GOOD)
    assert isinstance(data, dict)
    return data


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "lb.yaml"
    path.write_text(GOOD)
    cfg = load_config(path)
    assert cfg.instance == "lab"
    assert cfg.vips[0].backends[0].weight == 2
    assert cfg.vips[0].backends[1].weight == 1
    assert cfg.vips[1].encap is EncapKind.IPIP
    assert cfg.vips[1].hash is HashFields.SOURCE
    assert cfg.vip_table_size(cfg.vips[0]) == 65537
    assert cfg.vip_table_size(cfg.vips[1]) == 1009
    assert cfg.backend_addresses() == {
        ipaddress.ip_address("198.18.0.11"),
        ipaddress.ip_address("198.18.0.12"),
        ipaddress.ip_address("fd78:6470:6c62::11"),
    }


def test_empty_document_is_an_empty_config() -> None:
    assert parse_config(None) == Config()


def _set(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    node: Any = data
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "field", "text"),
    [
        (("vips", 0, "backends", 1, "weight"), 70000, "vips[0].backends[1].weight", "65535"),
        (("vips", 0, "backends", 1, "weight"), -1, "vips[0].backends[1].weight", "0"),
        (("vips", 0, "backends", 0, "address"), "198.18.0.300", "vips[0].backends[0].address", ""),
        (("vips", 0, "address"), "not-an-ip", "vips[0].address", ""),
        (("vips", 0, "port"), 65536, "vips[0].port", "65535"),
        (("vips", 0, "protocol"), "sctp", "vips[0].protocol", "tcp"),
        (("vips", 1, "encap"), "gre", "vips[1].encap", "gue"),
        (("vips", 1, "hash"), "dst", "vips[1].hash", "source"),
        (("vips", 1, "table_size"), 1000, "vips[1].table_size", "prime"),
        (("table_size",), 65536, "table_size", "prime"),
        (("hash_seed",), 2**32, "hash_seed", ""),
        (("instance",), "a/b", "instance", ""),
        (("interfaces",), ["eth0", "eth0"], "interfaces", "twice"),
        (("tunnel", "gue_port"), 0, "tunnel.gue_port", ""),
        (("tunnel", "source_v4"), None, "vips[0].backends[0].address", "source_v4"),
        (
            ("vips", 0, "colour"),
            "red",
            "vips[0].colour",
            "unknown field 'colour' (known here: acl,",
        ),
        (("vips", 0, "backend"), [], "vips[0].backend", "did you mean 'backends'?"),
        (("vips", 0, "table"), "ring", "vips[0].table", "beamer"),
        (("vips", 0, "beamer"), {"max_step": 0}, "vips[0].beamer.max_step", "greater than 0"),
        (("vips", 0, "beamer"), {"min_interval": -1}, "vips[0].beamer.min_interval", ""),
    ],
)
def test_errors_name_the_field(path: tuple[Any, ...], value: Any, field: str, text: str) -> None:
    data = _set(good(), path, value)
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert exc.value.field == field
    assert text in str(exc.value)


def test_beamer_tables_need_no_prime() -> None:
    data = good()
    data["vips"][0].update(table="beamer", table_size=65536, beamer={"min_interval": 5})
    cfg = parse_config(data)
    assert cfg.vip_table_size(cfg.vips[0]) == 65536
    assert cfg.vips[0].beamer.min_interval == 5
    del data["vips"][0]["table_size"]
    cfg = parse_config(data)
    assert cfg.vip_table_size(cfg.vips[0]) == 65536, "Beamer's own default size"
    data["vips"][0]["table_size"] = 0
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert exc.value.field == "vips[0].table_size"


def test_duplicates_are_refused() -> None:
    data = good()
    data["vips"].append(dict(data["vips"][0]))
    with pytest.raises(ConfigError, match="listed twice") as exc:
        parse_config(data)
    assert exc.value.field == "vips"
    data = good()
    data["vips"][0]["backends"].append({"address": "198.18.0.11"})
    with pytest.raises(ConfigError, match=r"198\.18\.0\.11 is listed twice") as exc:
        parse_config(data)
    assert exc.value.field == "vips[0].backends"


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("vips: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


NICKEL_CHECK = """
{"checker": {"http": {"scheme": "http", "uri": "/", "check_port": 9080, "codes": [200]}},
 "fall_count": 2, "interval_ms": 2000, "rise_count": 2}
"""


def test_health_checks_in_nickels_format_per_vip_and_per_backend() -> None:
    import yaml

    data = good()
    data["vips"][0]["health"] = yaml.safe_load(NICKEL_CHECK)
    data["vips"][0]["backends"][1]["health"] = {"checker": {"tcp": {}}, "via": "direct"}
    cfg = parse_config(data)
    hc = cfg.vips[0].health
    assert hc is not None and hc.checker.kind == "http" and hc.checker.check_port == 9080
    assert (hc.fall_count, hc.rise_count, hc.interval_ms, hc.via) == (2, 2, 2000, "tunnel")
    assert cfg.vips[0].backends[1].health is not None
    # A wildcard VIP's check must say which port to check.
    data["vips"][1]["health"] = {"checker": {"udp": {}}}
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert exc.value.field == "vips[1].health.checker.udp.check_port"
    data["vips"][1]["health"] = {"checker": {"command": {"command": ["true"]}}}
    parse_config(data)  # a command needs no port
    data["vips"][0]["health"]["rise_count"] = 0
    with pytest.raises(ConfigError) as exc:
        parse_config(data)
    assert exc.value.field == "vips[0].health.rise_count"


@pytest.mark.parametrize(
    ("api", "field"),
    [
        ({"listen": "198.18.0.2:9180"}, "api.token"),
        ({"listen": "localhost:9180"}, "api.listen"),
        ({"listen": "unix:"}, "api.listen"),
        ({"listen": "127.0.0.1:9180", "token": "short"}, "api.token"),
        ({"token": "x" * 16, "token_file": "/etc/t"}, "api.token_file"),
    ],
)
def test_api_refusals_name_the_field(api: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config({**good(), "api": api})
    assert exc.value.field == field


def test_api_endpoints() -> None:
    assert parse_config({**good(), "api": {"listen": "127.0.0.1:9180"}}).api.token is None
    cfg = parse_config({**good(), "api": {"listen": "[::]:9180", "token": "t" * 32}})
    assert cfg.api.listen == "[::]:9180"
    assert parse_config({**good(), "api": {"listen": "unix:/run/x.sock"}}).api.listen
