"""``xdplb acl`` against a live uvicorn serving the fake controller (as
test_cli_client.py does): listing, allowing, denying, removing, globally and per VIP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_controller import FakeController
from test_cli_client import Served, serve, xdplb

from xdplb.cli.args import EXIT_CONFIG, EXIT_OK
from xdplb.core.paths import api_socket

pytestmark = pytest.mark.unit

VIP6 = "[fd78:6470:6c62:100::1]:53/udp"


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("XDPLB_TOKEN", raising=False)
    monkeypatch.delenv("XDPLB_API", raising=False)
    fake = FakeController()
    for _ in serve(fake, api_socket("fake")):
        yield Served(fake, api_socket("fake"))


def strs(prefixes: list[object]) -> list[str]:
    return [str(p) for p in prefixes]


def test_acl_commands(served: Served) -> None:
    fake = served.fake
    code, out, _ = xdplb("acl", "deny", "198.18.0.0/16", "fd78:6470:6c62:9::/64")
    assert (code, out) == (
        EXIT_OK,
        "global ACL: denied 198.18.0.0/16 fd78:6470:6c62:9::/64: 1 map operations, "
        "runtime only (--persist writes the file)\n",
    )
    assert strs(fake.cfg.acl.deny) == ["198.18.0.0/16", "fd78:6470:6c62:9::/64"]
    assert xdplb("acl", "allow", "198.18.7.0/24", "--persist")[0] == EXIT_OK
    assert strs(fake.cfg.acl.allow) == ["198.18.7.0/24"] and fake.persisted == 1
    # A prefix moves from one list to the other.
    assert xdplb("acl", "allow", "198.18.0.0/16")[0] == EXIT_OK
    assert strs(fake.cfg.acl.deny) == ["fd78:6470:6c62:9::/64"]
    assert strs(fake.cfg.acl.allow) == ["198.18.7.0/24", "198.18.0.0/16"]
    assert xdplb("acl", "del", "198.18.7.0/24")[0] == EXIT_OK
    assert strs(fake.cfg.acl.allow) == ["198.18.0.0/16"]
    fake.acl_hits = {"global": (3, 4, 5)}
    code, out, _ = xdplb("acl", "list")
    assert (code, out) == (
        EXIT_OK,
        "global ACL (allow list: other sources denied)\n"
        "  allow 198.18.0.0/16\n"
        "  deny  fd78:6470:6c62:9::/64\n"
        "hits: allow 3  deny 4  default 5\n",
    )
    code, out, _ = xdplb("acl", "list", "--json")
    assert json.loads(out)["hits"] == {"scope": "global", "allow": 3, "deny": 4, "default": 5}


def test_vip_acl_commands(served: Served) -> None:
    fake = served.fake
    assert xdplb("acl", "deny", "fd78:6470:6c62:5::/64", "--vip", VIP6)[0] == EXIT_OK
    assert strs(fake.cfg.vips[1].acl.deny) == ["fd78:6470:6c62:5::/64"]
    assert fake.cfg.acl.empty and fake.cfg.vips[0].acl.empty
    _code, out, _ = xdplb("acl", "list", "--vip", VIP6)
    assert out.splitlines()[:2] == [f"{VIP6} ACL", "  deny  fd78:6470:6c62:5::/64"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("acl", "deny", "198.18.0.1/16"), "invalid prefix: 198.18.0.1/16 has host bits set"),
        (("acl", "allow", "nope"), "invalid prefix: 'nope' is not an IPv4 or IPv6 prefix"),
        (("acl", "del", "198.18.9.0/24"), "198.18.9.0/24 is in no list of the global ACL"),
        (("acl", "deny", "198.18.9.0/24", "--vip", "198.18.100.1"), "ADDRESS:PORT"),
        (
            ("acl", "deny", "198.18.9.0/24", "--vip", "198.18.100.9:80"),
            "no VIP 198.18.100.9:80/tcp",
        ),
    ],
)
def test_acl_errors_exit_2(served: Served, args: tuple[str, ...], message: str) -> None:
    code, _, errout = xdplb(*args)
    assert code == EXIT_CONFIG
    assert message in errout
    assert served.fake.replaced == 0


def test_status_shows_acl_hits(served: Served) -> None:
    code, out, _ = xdplb("status")
    assert code == EXIT_OK and "acl " not in out  # nothing to say
    served.fake.acl_hits = {"global": (0, 0, 0), "198.18.100.1:80/tcp": (2, 0, 7)}
    out = xdplb("status")[1]
    assert "acl global" not in out
    assert "acl 198.18.100.1:80/tcp: allow 2  deny 0  default 7\n" in out
