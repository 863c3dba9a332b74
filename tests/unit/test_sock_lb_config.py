"""The sock_lb YAML file: what it accepts, and the field it names when it refuses."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest

from xdplb.core.errors import ConfigError
from xdplb.datapath.sock_lb import Endpoint
from xdplb.sockets.sock_lb import load, parse
from xdplb.sockets.socklb_plan import DEFAULT_TABLE_SIZE, Backend

pytestmark = pytest.mark.unit

GOOD = """
cgroup: /sys/fs/cgroup/unified/clients
services:
  - address: 10.96.0.10
    port: 80
    protocol: tcp
    affinity_seconds: 30
    backends:
      - {address: 127.0.0.2, port: 8001}
      - {address: 127.0.0.3, port: 8002, weight: 2, up: false}
"""


def test_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(GOOD)
    cfg = load(path)
    assert cfg.cgroup == Path("/sys/fs/cgroup/unified/clients")
    (s,) = cfg.to_services()
    assert (s.address, s.port) == (ipaddress.ip_address("10.96.0.10"), 80)
    assert s.affinity_s == 30 and s.table_size == DEFAULT_TABLE_SIZE
    assert s.backends == (
        Backend(Endpoint(ipaddress.ip_address("127.0.0.2"), 8001), 1, True),
        Backend(Endpoint(ipaddress.ip_address("127.0.0.3"), 8002), 2, False),
    )
    assert s.proto == socket.IPPROTO_TCP


def _svc(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "address": "10.96.0.10",
        "port": 80,
        "protocol": "udp",
        "backends": [{"address": "127.0.0.2", "port": 53}],
    }
    return base | over


@pytest.mark.parametrize(
    ("doc", "field", "message"),
    [
        ({"services": [_svc(port=0)]}, "services.0.port", "greater than or equal to 1"),
        ({"services": [_svc(protocol="sctp")]}, "services.0.protocol", "'tcp' or 'udp'"),
        ({"services": [_svc(table_size=1000)]}, "services.0", "table_size must be a prime"),
        (
            {"services": [_svc(backends=[{"address": "::1", "port": 53}])]},
            "services.0",
            "not of the service's family",
        ),
        ({"services": [_svc(colour="red")]}, "services.0.colour", "Extra inputs"),
        ({"services": [_svc(), _svc()]}, "services", "twice"),
    ],
)
def test_refusals_name_the_field(doc: object, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse(doc)
    assert exc.value.field == field
    assert message in exc.value.message


def test_an_empty_file_is_no_services(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load(path).to_services() == []


def test_unreadable_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("services: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)
