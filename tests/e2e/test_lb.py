"""The whole path in the lab: client -> lb_xdp (the real daemon) -> GUE/IPIP -> host_tc ->
a real server on the backend -> straight back to the client.

Every exchange verifies its bytes and learns which backend answered. Source ports are
fixed, so each flow's backend is known in advance from the reference model fed with
what the daemon's maps hold, and each connection must land exactly there.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from xdplb import model
from xdplb.core import abi
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream, ExchangeError, http_post, udp_exchange
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP4 = "198.18.100.1"
VIP4_WEIGHTED = "198.18.100.2"
VIP6 = "fd78:6470:6c62:100::1"
TCP, UDP = abi.IPPROTO_TCP, abi.IPPROTO_UDP


def vips(lab: Lab, backends: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The lab's VIPs; ``backends`` limits every VIP to those backend names."""
    names = list(backends or lab.backends)
    v4 = [{"address": str(lab.addr(b, 4))} for b in names]
    v6 = [{"address": str(lab.addr(b, 6))} for b in names]
    weights = {"b1": 2, "b2": 1, "b3": 1}
    weighted = [{"address": str(lab.addr(b, 4)), "weight": weights[b]} for b in names]
    return [
        {"address": VIP4, "port": 80, "backends": v4},
        {"address": VIP4, "port": 7, "backends": v4},
        {"address": VIP4, "port": 0, "protocol": "udp", "backends": v4},
        {"address": VIP4_WEIGHTED, "port": 80, "encap": "ipip", "backends": weighted},
        {"address": VIP6, "port": 80, "backends": v6},
        {"address": VIP6, "port": 53, "protocol": "udp", "hash": "source", "backends": v6},
    ]


@pytest.fixture(scope="module")
def lb(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    lab.add_vip_to_backends(VIP4_WEIGHTED)
    lab.start_servers("--udp", "53", "4000")
    node = LbNode(lab, tmp_path_factory.mktemp("lb"), vips(lab))
    node.start()
    yield node
    node.destroy()


def state_of(node: LbNode) -> model.DataplaneState:
    """What the daemon's maps hold, as the model's input."""
    maps = node.maps()
    try:
        return model.state_from_snapshot(maps.snapshot())
    finally:
        maps.close()


def names_by_id(lab: Lab, state: model.DataplaneState) -> dict[int, str]:
    by_addr = {lab.addr(n, f): n for n in lab.backends for f in (4, 6)}
    return {bid: by_addr[b.addr] for bid, b in state.backends.items()}


def predict(lab: Lab, node: LbNode, vip: str, dport: int, proto: int, ports: range) -> list[str]:
    """The backend name the model predicts for each client source port."""
    client = lab.addr("client", ipaddress.ip_address(vip).version)
    dst = ipaddress.ip_address(vip)
    flows = [model.Flow(client, dst, p, dport, proto) for p in ports]
    state = state_of(node)
    ids = model.predict_many(state, flows).backend
    names = names_by_id(lab, state)
    return [names.get(int(i), f"none({int(i)})") for i in ids]


def run_http(lab: Lab, vip: str, ports: range, workers: int = 16) -> list[str]:
    client = lab.ns("client")

    def one(port: int) -> str:
        return http_post(client, vip, 80, os.urandom(64) + port.to_bytes(2, "big"), src_port=port)

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, ports))


def assert_shares(got: Counter[str], weights: dict[str, int], tolerance: float) -> None:
    total, wsum = sum(got.values()), sum(weights.values())
    for name, w in weights.items():
        expected = total * w / wsum
        assert abs(got[name] - expected) <= tolerance * expected, (
            f"{name}: {got[name]} connections, expected {expected:.0f} ± {tolerance:.0%} "
            f"(all: {dict(got)})"
        )


def test_tcp_connections_follow_the_model_and_the_weights(lab: Lab, lb: LbNode) -> None:
    for vip, ports, weights in [
        (VIP4, range(10000, 10900), {"b1": 1, "b2": 1, "b3": 1}),
        (VIP4_WEIGHTED, range(11000, 12200), {"b1": 2, "b2": 1, "b3": 1}),
    ]:
        expected = predict(lab, lb, vip, 80, TCP, ports)
        got = run_http(lab, vip, ports)
        wrong = [(p, e, g) for p, e, g in zip(ports, expected, got, strict=True) if e != g]
        assert not wrong, f"{len(wrong)} connections landed elsewhere than predicted: {wrong[:5]}"
        assert_shares(Counter(got), weights, 0.15)


def test_udp_and_ipv6(lab: Lab, lb: LbNode) -> None:
    client = lab.ns("client")
    ports = range(12500, 12700)
    # UDP to the port-0 wildcard VIP, on several destination ports.
    for dport in (53, 4000):
        expected = predict(lab, lb, VIP4, dport, UDP, ports)
        got = [udp_exchange(client, VIP4, dport, os.urandom(32), src_port=p) for p in ports]
        assert got == expected
    assert set(got) == set(lab.backends)
    # TCP over IPv6 (GUE in IPv6).
    expected = predict(lab, lb, VIP6, 80, TCP, ports)
    assert run_http(lab, VIP6, ports) == expected
    assert set(expected) == set(lab.backends)
    # UDP over IPv6 with source-only hashing: one client, one backend, whatever the port.
    got6 = {udp_exchange(client, VIP6, 53, b"q", src_port=p) for p in ports[:20]}
    assert len(got6) == 1


def test_removing_a_backend_moves_only_what_maglev_predicts(lab: Lab, lb: LbNode) -> None:
    # Long-lived connections that must survive on the backends that stay.
    streams = [EchoStream.open(lab.ns("client"), VIP4, 7, src_port=p) for p in range(13000, 13030)]
    for s in streams:
        s.exchange()
    ports = range(13100, 13700)
    before = predict(lab, lb, VIP4, 80, TCP, ports)
    lb.reload(vips(lab, ["b1", "b2"]))
    try:
        after = predict(lab, lb, VIP4, 80, TCP, ports)
        got = run_http(lab, VIP4, ports)
        assert got == after, "new connections must land where the model says"
        assert "b3" not in got
        moved = sum(1 for b, a in zip(before, after, strict=True) if b != "b3" and b != a)
        # Maglev's promise: flows of the backends that stay barely move.
        assert moved <= 0.04 * len(ports), f"{moved} flows left a surviving backend"
        for s in streams:
            if s.backend != "b3":
                s.exchange()  # established connections on b1/b2 carry on
    finally:
        for s in streams:
            s.close()
        lb.reload(vips(lab))


def conn_table(
    lab: Lab, node: LbNode, streams: Sequence[EchoStream]
) -> dict[int, tuple[str, int] | None]:
    """The connection table's entry of each stream to VIP4:7, by client port: (backend
    name, hash), None if it has none."""
    client = lab.addr("client", 4)
    with node.maps() as maps:
        entries = maps.conns.entries()
        names = names_by_id(lab, model.state_from_snapshot(maps.snapshot()))
    out: dict[int, tuple[str, int] | None] = {}
    for s in streams:
        port = s.sock.getsockname()[1]
        flow = model.Flow(client, ipaddress.ip_address(VIP4), port, 7, TCP)
        entry = entries.get(flow.key())
        if entry is None:
            out[port] = None
        else:
            out[port] = (names.get(entry.backend_id, f"id {entry.backend_id}"), entry.hash)
    return out


def silent(streams: Sequence[EchoStream], since: Sequence[int]) -> list[int]:
    """Client ports of the streams that have echoed no byte since their counts ``since``."""
    return [s.sock.getsockname()[1] for s, n in zip(streams, since, strict=True) if s.sent <= n]


def test_restarting_the_daemon_breaks_no_connection(lab: Lab, lb: LbNode) -> None:
    streams = [EchoStream.open(lab.ns("client"), VIP4, 7, src_port=p) for p in range(14000, 14040)]
    assert {s.backend for s in streams} == set(lab.backends)
    stop = threading.Event()
    errors: list[str] = []

    def pump(s: EchoStream) -> None:
        try:
            while not stop.is_set():
                s.exchange(2048)
        except ExchangeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=pump, args=(s,)) for s in streams]

    def all_carry_bytes(when: str) -> None:
        since = [s.sent for s in streams]
        wait_for(
            lambda: silent(streams, since),
            f"every stream echoing bytes {when} (ports still silent)",
            until=lambda ports: not ports,
        )

    for t in threads:
        t.start()
    try:
        all_carry_bytes("before the restart")
        # Every established connection has its entry: the backend it greeted us from.
        before = conn_table(lab, lb, streams)
        backends = {p: None if e is None else e[0] for p, e in before.items()}
        assert backends == {s.sock.getsockname()[1]: s.backend for s in streams}, before
        hits_before = _event(lb, abi.Event.CONN_HIT)
        lb.stop_daemon()
        # No daemon: lb_xdp stays attached, established and new connections work.
        assert lb.link_pin.exists()
        assert run_http(lab, VIP4, range(14100, 14130)) == predict(
            lab, lb, VIP4, 80, TCP, range(14100, 14130)
        )
        all_carry_bytes("without the daemon")
        lb.start()
        # The restarted daemon kept the maps: the same entries, flow for flow (backend
        # and hash), and the connections go on carrying bytes through them.
        assert conn_table(lab, lb, streams) == before
        all_carry_bytes("after the restart")
        assert conn_table(lab, lb, streams) == before
        assert _event(lb, abi.Event.CONN_HIT) > hits_before  # and the counters were kept
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors, errors
    for s in streams:
        s.exchange()
        s.close()


def test_a_bad_reload_changes_nothing(lab: Lab, lb: LbNode) -> None:
    before = state_of(lb)
    good = lb.config_path.read_text()
    bad = good.replace("weight: 2", "weight: 70000")
    assert bad != good
    lb.config_path.write_text(bad)
    assert lb.proc is not None
    lb.proc.send_signal(1)  # SIGHUP
    wait_for(
        lb.log_tail,
        "the daemon refusing vips[3].backends[0].weight in its log",
        until=lambda log: "vips[3].backends[0].weight" in log,
        timeout=5,
    )
    assert state_of(lb).backends == before.backends
    assert run_http(lab, VIP4, range(15000, 15030)) == predict(
        lab, lb, VIP4, 80, TCP, range(15000, 15030)
    )
    lb.config_path.write_text(good)


def test_editing_the_file_reloads_without_a_signal(lab: Lab, lb: LbNode) -> None:
    changed = vips(lab)
    changed[3]["backends"][0]["weight"] = 3  # b1 of the weighted VIP: 2 -> 3
    lb.write(changed)  # no SIGHUP: the daemon notices the new mtime
    lb.wait_applied(timeout=10)
    state = state_of(lb)
    vip = next(p for v, p in state.vips.items() if str(v.addr) == VIP4_WEIGHTED)
    counts = Counter(int(i) for i in state.tables[vip.vip_id].first)
    assert sorted(round(c / sum(counts.values()), 2) for c in counts.values()) == [0.2, 0.2, 0.6]
    lb.write(vips(lab))
    lb.wait_applied(timeout=10)


def test_status_and_stop(lab: Lab, lb: LbNode) -> None:
    cli = [sys.executable, "-m", "xdplb.cli.app"]
    # From the daemon, through its API.
    out = subprocess.run(
        [*cli, "status", "-i", lb.instance, "--json"], check=True, capture_output=True, text=True
    ).stdout
    status = json.loads(out)
    assert status["source"] == "daemon" and status["attached"] == ["eth0"]
    assert {v["address"] for v in status["vips"]} == {VIP4, VIP4_WEIGHTED, VIP6}
    assert all(v["packets"] > 0 for v in status["vips"] if v["port"] == 80)
    assert status["events"]["tx"] > 0 and status["conn_table"]["capacity"] == 65536 * 4
    weighted = next(v for v in status["vips"] if v["address"] == VIP4_WEIGHTED)
    shares = [b["table_share"] for b in weighted["backends"]]
    assert sorted(round(s, 2) for s in shares) == [0.25, 0.25, 0.5]
    table = subprocess.run(
        [*cli, "status", "-i", lb.instance], check=True, capture_output=True, text=True
    ).stdout
    assert "198.18.100.2:80" in table and "-> 198.18.0.11" in table
    # Without the daemon (stopped for an upgrade), from the pinned maps when asked for.
    lb.stop_daemon()
    gone = subprocess.run([*cli, "status", "-i", lb.instance], capture_output=True, text=True)
    assert gone.returncode == 3 and "--offline" in gone.stderr
    out = subprocess.run(
        [*cli, "status", "-i", lb.instance, "--json", "--offline"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    pinned = json.loads(out)
    assert pinned["source"] == "pins" and pinned["uptime"] is None
    assert pinned["attached"] == ["eth0"] and pinned["conn_table"]["used"] > 0
    assert {v["name"] for v in pinned["vips"]} == {v["name"] for v in status["vips"]}
    weighted = next(v for v in pinned["vips"] if v["address"] == VIP4_WEIGHTED)
    shares = [b["table_share"] for b in weighted["backends"]]
    assert sorted(round(s, 2) for s in shares) == [0.25, 0.25, 0.5]

    stopped = subprocess.run([*cli, "stop", "-i", lb.instance], capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr
    lb.proc = None
    assert not (Path("/sys/fs/bpf/xdplb") / lb.instance).exists()
    link = subprocess.run(
        ["ip", "-n", lab.ns("lb"), "-j", "link", "show", "dev", "eth0"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "xdp" not in json.loads(link)[0]
    again = subprocess.run([*cli, "status", "-i", lb.instance], capture_output=True, text=True)
    assert again.returncode == 3


def _event(node: LbNode, event: abi.Event) -> int:
    maps = node.maps()
    try:
        return maps.counters().events[event]
    finally:
        maps.close()
