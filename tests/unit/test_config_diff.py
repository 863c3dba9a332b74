"""control.diff: one exact line per change of a configuration, and which runtime changes a
reload would drop (a table of cases, then properties over random edits)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xdplb.config import parse_config
from xdplb.control.diff import diff, dropped, lines

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {
    "instance": "diff",
    "tunnel": {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"},
    "vips": [
        {
            "address": "198.18.100.1",
            "port": 80,
            "backends": [{"address": "198.18.0.11"}, {"address": "198.18.0.12"}],
        },
        {
            "address": "fd78:6470:6c62:100::1",
            "port": 53,
            "protocol": "udp",
            "backends": [{"address": "fd78:6470:6c62::11"}],
        },
    ],
}
V4 = "VIP 198.18.100.1:80/tcp"
V6 = "VIP [fd78:6470:6c62:100::1]:53/udp"

Edit = Callable[[dict[str, Any]], None]


def edited(*edits: Edit) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for e in edits:
        e(doc)
    return doc


def weight(vip: int, backend: int, w: int) -> Edit:
    return lambda d: d["vips"][vip]["backends"][backend].__setitem__("weight", w)


def deny(prefix: str, vip: int | None = None) -> Edit:
    def edit(d: dict[str, Any]) -> None:
        where = d if vip is None else d["vips"][vip]
        where.setdefault("acl", {}).setdefault("deny", []).append(prefix)

    return edit


def add_backend(vip: int, address: str) -> Edit:
    return lambda d: d["vips"][vip]["backends"].append({"address": address})


def drop_backend(vip: int, backend: int) -> Edit:
    return lambda d: d["vips"][vip]["backends"].pop(backend)


def add_vip(d: dict[str, Any]) -> None:
    d["vips"].append({"address": "198.18.100.9", "port": 443, "backends": []})


def set_(key: str, value: Any, vip: int | None = None) -> Edit:
    return lambda d: (d if vip is None else d["vips"][vip]).__setitem__(key, value)


CASES: list[tuple[list[Edit], list[str]]] = [
    ([], []),
    ([weight(0, 1, 3)], [f"{V4}: backend 198.18.0.12 weight 1 -> 3"]),
    ([deny("203.0.113.0/24")], ["acl: + deny 203.0.113.0/24"]),
    ([deny("2001:db8::/32", vip=1)], [f"{V6}: acl: + deny 2001:db8::/32"]),
    ([add_backend(0, "198.18.0.13")], [f"{V4}: backend 198.18.0.13 added (weight 1)"]),
    ([drop_backend(0, 0)], [f"{V4}: backend 198.18.0.11 removed"]),
    ([add_vip], ["VIP 198.18.100.9:443/tcp added (no backends)"]),
    ([lambda d: d["vips"].pop(0)], [f"{V4} removed"]),
    ([set_("encap", "ipip", vip=1)], [f"{V6}: encap gue -> ipip"]),
    ([set_("xdp_mode", "generic")], ["xdp_mode: native -> generic"]),
    ([set_("interfaces", ["eth0", "eth1"])], ["interfaces: [] -> [eth0, eth1]"]),
    ([lambda d: d["tunnel"].__setitem__("gue_port", 6081)], ["tunnel.gue_port: 19523 -> 6081"]),
    (
        [set_("health", {"checker": {"tcp": {}}, "interval_ms": 500}, vip=0)],
        [
            f'{V4}: health none -> {{"checker":{{"tcp":{{}}}},"interval_ms":500,"timeout_ms":1000,'
            '"rise_count":2,"fall_count":2,"jitter":0.1,"via":"tunnel"}'
        ],
    ),
    # Several at once: in the configuration's order, one line each.
    (
        [weight(1, 0, 5), deny("203.0.113.0/24"), weight(0, 0, 2)],
        [
            "acl: + deny 203.0.113.0/24",
            f"{V4}: backend 198.18.0.11 weight 1 -> 2",
            f"{V6}: backend fd78:6470:6c62::11 weight 1 -> 5",
        ],
    ),
    # Reordering backends or VIPs changes nothing in the maps.
    ([lambda d: d["vips"][0]["backends"].reverse(), lambda d: d["vips"].reverse()], []),
    # A token is never printed: its fingerprint tells that it changed.
    (
        [set_("api", {"token": "a-new-token-of-16+"})],
        ["api.token: none -> (secret, sha256 6e70c16f65cf)"],
    ),
]


@pytest.mark.parametrize(("edits", "want"), CASES)
def test_one_line_per_change(edits: list[Edit], want: list[str]) -> None:
    assert lines(parse_config(BASE), parse_config(edited(*edits))) == want


def test_changes_name_their_vip_and_backend() -> None:
    (c,) = diff(parse_config(BASE), parse_config(edited(weight(0, 1, 3))))
    assert (c.vip, c.backend) == ("198.18.100.1:80/tcp", "198.18.0.12")
    (c,) = diff(parse_config(BASE), parse_config(edited(deny("203.0.113.0/24"))))
    assert (c.vip, c.backend) == (None, None)


DROPPED: list[tuple[list[Edit], list[Edit], list[str]]] = [
    # (what the API changed, what the new file says, what a reload to it would drop)
    (
        [deny("203.0.113.0/24")],
        [],
        ["acl: deny 203.0.113.0/24 (added through the API) would be dropped"],
    ),
    ([deny("203.0.113.0/24")], [deny("203.0.113.0/24")], []),  # the file has it too
    (
        [deny("203.0.113.0/24")],
        [weight(0, 0, 4)],
        ["acl: deny 203.0.113.0/24 (added through the API) would be dropped"],
    ),
    (
        [weight(0, 1, 3)],
        [weight(0, 1, 2)],
        [f"{V4}: backend 198.18.0.12 weight 3 (set through the API) would become 2"],
    ),
    ([weight(0, 1, 3)], [weight(0, 1, 3), weight(0, 0, 7)], []),
    (
        [drop_backend(0, 0)],
        [],
        [f"{V4}: backend 198.18.0.11 (removed through the API) would be back"],
    ),
    ([add_vip], [], ["VIP 198.18.100.9:443/tcp (added through the API) would be dropped"]),
    (
        [add_vip],
        [add_vip, add_backend(2, "198.18.0.11")],
        ["VIP 198.18.100.9:443/tcp (added through the API) would be replaced by the file's"],
    ),
    (
        [lambda d: d["vips"][1].__setitem__("encap", "ipip")],
        [],
        [f"{V6}: encap ipip (set through the API) would become gue"],
    ),
    ([], [weight(0, 0, 9)], []),  # nothing changed through the API: nothing to drop
]


@pytest.mark.parametrize(("api", "file", "want"), DROPPED)
def test_what_a_reload_would_drop(api: list[Edit], file: list[Edit], want: list[str]) -> None:
    base = parse_config(BASE)
    assert dropped(base, parse_config(edited(*api)), parse_config(edited(*file))) == want


EDITS: list[Edit] = [
    weight(0, 0, 2),
    weight(0, 1, 0),
    weight(1, 0, 7),
    deny("203.0.113.0/24"),
    deny("198.51.100.0/24", vip=0),
    add_backend(0, "198.18.0.13"),
    add_backend(1, "fd78:6470:6c62::12"),
    drop_backend(0, 1),
    add_vip,
    set_("encap", "ipip", vip=0),
    set_("hash_seed", 7),
]
edit_sets = st.lists(st.sampled_from(range(len(EDITS))), unique=True).map(
    lambda ix: edited(*(EDITS[i] for i in sorted(ix)))
)


@settings(max_examples=200, deadline=None)
@given(a=edit_sets, b=edit_sets, c=edit_sets)
def test_properties(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    ca, cb, cc = parse_config(a), parse_config(b), parse_config(c)
    assert (diff(ca, cb) == []) == (ca == cb)
    assert len(diff(ca, cb)) == len(diff(cb, ca))
    assert len(set(lines(ca, cb))) == len(lines(ca, cb))  # one line per change, none twice
    # A file that carries every API change drops none; the old file drops every one.
    assert dropped(ca, cb, cb) == []
    assert len(dropped(ca, cb, ca)) == len(diff(ca, cb))
    assert dropped(ca, ca, cc) == []
