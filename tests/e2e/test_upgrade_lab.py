"""An upgrade of the daemon to another map layout keeps every connection (docs/operations.md,
"Upgrades").

The daemon of a test build whose layout differs (ABI 3, a field added to the session
entry) carries 200 verified TCP connections and UDP flows; a backend is then drained, so
the sessions on it are the only thing that keeps them there. SIGTERM, then the current
daemon on the same instance: no connection breaks, no UDP flow changes backend, every
session is in the new table with its backend, and the old layout's pins are gone. A
layout the migration cannot read (a key field renamed) is refused with a message that
names the cause and the way out, while the old program keeps forwarding, still attached.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.datapath import Link, layout
from xdplb.datapath.upgrade import OldTable
from xdplb.lab import Lab, netns
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import PacedStreams
from xdplb.lab.traffic import ExchangeError, udp_exchange
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
STREAMS = 200
UDP_PORTS = range(41000, 41060)
NEXT = abi.ABI_VERSION + 1


def vips(lab: Lab, weights: dict[str, int]) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b)), "weight": w} for b, w in weights.items()]
    return [
        {"address": VIP, "port": 7, "backends": backends},
        {"address": VIP, "port": 0, "protocol": "udp", "backends": backends},
    ]


ALL = {"b1": 1, "b2": 1, "b3": 1}
DRAINED = {"b1": 0, "b2": 1, "b3": 1}  # b1 out of the table: its flows stay by session only


@pytest.fixture
def servers(lab: Lab) -> Iterator[None]:
    procs = lab.start_servers("--udp", "53")
    yield
    for p in procs:
        p.kill()
        p.wait()


class UdpFlows:
    """UDP flows with fixed source ports, exchanged round-robin in a thread: each must
    keep answering from the backend it first answered from."""

    def __init__(self, lab: Lab) -> None:
        self.ns = lab.ns("client")
        self.backend: dict[int, str] = {}
        self.failed: list[str] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in UDP_PORTS:
                try:
                    name = udp_exchange(self.ns, VIP, 53, os.urandom(32), src_port=p)
                except ExchangeError as e:
                    self.failed.append(str(e))
                    continue
                first = self.backend.setdefault(p, name)
                if name != first:
                    self.failed.append(f"UDP flow from port {p} moved from {first} to {name}")
            self.rounds += 1

    def __enter__(self) -> UdpFlows:
        self._thread.start()
        return self

    def wait_rounds(self, n: int = 2) -> None:
        target = self.rounds + n
        wait_for(
            lambda: self.rounds,
            f"{n} more rounds of UDP exchanges (to round {target})",
            until=lambda r: r >= target or not self._thread.is_alive(),
            timeout=60.0,
            detail=lambda: f"failed: {self.failed[:5]}",
        )

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_exchanges(streams: PacedStreams, n: int = 3) -> None:
    """Until every stream has had ``n`` more exchanges' worth (or one broke)."""
    target = streams.totals().exchanges + n * len(streams.streams)
    wait_for(
        lambda: streams.totals(),
        f"{n} more exchanges per stream",
        until=lambda t: t.exchanges >= target or t.broken > 0,
        timeout=60.0,
        detail=lambda: f"broken: {streams.broken[:5]}",
    )


def old_sessions(node: LbNode, version: int) -> dict[bytes, IPAddress]:
    """The session table of layout ``version``, read through its BTF: key -> backend."""
    with OldTable(node.instance, version, abi.ABI_VERSION) as t:
        backends = t.backends()
        out = {}
        for s in t.sessions():
            assert s is not None, "a set kept being written"
            out[s.key] = backends[s.hops[0]].addr
        return out


def new_sessions(node: LbNode) -> dict[bytes, IPAddress]:
    with node.maps() as maps:
        addr = {i: b.addr for i, b in maps.snapshot().backends.items()}
        return {k: addr[e.backend_id] for k, e in maps.conns.entries().items()}


def link_prog(node: LbNode) -> int:
    with Link.from_pinned(node.link_pin) as link:
        return link.prog_id


def start_next(lab: Lab, tmp_path: Path, build: str) -> LbNode:
    node = LbNode(lab, tmp_path, vips(lab, ALL))
    node.lb_object = paths.test_object(build)
    node.start()
    assert layout.pinned_layouts(node.instance) == {NEXT: paths.layout_dir(node.instance, NEXT)}
    return node


def test_an_upgrade_keeps_every_connection(lab: Lab, tmp_path: Path, servers: None) -> None:
    node = start_next(lab, tmp_path, "lb_xdp_abi_next")
    try:
        # A reader of this layout says which one runs, rather than "is it running?".
        env = {k: v for k, v in os.environ.items() if k != paths.LB_OBJECT_ENV}
        r = subprocess.run(
            [sys.executable, "-m", "xdplb.cli.app", "status", "--offline", "-i", node.instance],
            capture_output=True, text=True, env=env, check=False, timeout=60,
        )  # fmt: skip
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"instance {node.instance} runs layout abi-{NEXT}; this xdplb reads " in r.stderr
        with (
            PacedStreams(lab.ns("client"), VIP, 7, n=STREAMS, period=0.2) as streams,
            UdpFlows(lab) as udp,
        ):
            udp.wait_rounds(1)
            wait_exchanges(streams)
            on_b1 = [i for i, b in enumerate(streams.backends) if b == "b1"]
            assert on_b1 and set(streams.backends) == set(ALL)
            assert "b1" in udp.backend.values()
            # Drained: the table sends no new flow to b1, its flows stay by their sessions.
            node.reload(vips(lab, DRAINED))
            udp.wait_rounds(1)
            wait_exchanges(streams)
            with node.api() as api:
                st = api.get("/api/v1/status").json()
            assert st["conn_table"]["used"] is None  # a layout this Python does not read
            assert (streams.broken, udp.failed) == ([], [])  # the drain broke nothing
            before = old_sessions(node, NEXT)
            prog = link_prog(node)

            node.stop_daemon()  # SIGTERM: the old program stays attached and forwarding
            node.lb_object = None
            node.start()
            assert link_prog(node) != prog
            udp.wait_rounds(2)
            wait_exchanges(streams)
            after = new_sessions(node)
        assert streams.broken == []
        assert udp.failed == []
        assert len(before) >= STREAMS + len(UDP_PORTS)
        lost = {k.hex(): a for k, a in before.items() if after.get(k) != a}
        assert not lost, f"{len(lost)} sessions lost or moved: {list(lost.items())[:3]}"
        assert layout.pinned_layouts(node.instance) == {
            abi.ABI_VERSION: paths.layout_dir(node.instance, abi.ABI_VERSION)
        }
        assert not paths.layout_dir(node.instance, NEXT).exists()
        with node.api() as api:
            lines = api.get("/api/v1/status").json()["upgrade"]
        assert [ln.split(":")[0] for ln in lines] == [f"pass 1 from abi-{NEXT}",
                                                       f"pass 2 from abi-{NEXT}"]  # fmt: skip
        assert "busy 0" in lines[0]
        log = node.log_path.read_text()
        upgraded = f"from layout abi-{NEXT} to abi-{abi.ABI_VERSION}"
        assert f"upgraded instance {node.instance} {upgraded}" in log
    finally:
        node.destroy()


def test_a_layout_it_cannot_migrate_is_refused_and_keeps_forwarding(
    lab: Lab, tmp_path: Path, servers: None
) -> None:
    node = start_next(lab, tmp_path, "lb_xdp_abi_bad")
    try:
        with (
            PacedStreams(lab.ns("client"), VIP, 7, n=50, period=0.2) as streams,
            UdpFlows(lab) as udp,
        ):
            udp.wait_rounds(1)
            wait_exchanges(streams)
            prog = link_prog(node)
            node.stop_daemon()
            node.lb_object = None
            done = netns.run(
                lab.ns(node.node),
                [sys.executable, "-m", "xdplb.cli.app", "run", "-c", str(node.config_path)],
                check=False,
                timeout=120,
                env=node.env(),
            )
            assert done.returncode == 1, done.stdout + done.stderr
            err = " ".join(done.stderr.split())
            refused = f"from layout abi-{NEXT} to abi-{abi.ABI_VERSION}"
            assert f"cannot migrate the session table {refused}" in err
            assert "lb_conns: no field dport in a way" in err
            assert f"`xdplb stop -i {node.instance}`" in err and "drops every connection" in err
            # Nothing detached, nothing new pinned: the old program forwards on.
            assert link_prog(node) == prog
            assert layout.pinned_layouts(node.instance) == {
                NEXT: paths.layout_dir(node.instance, NEXT)
            }
            assert not paths.layout_dir(node.instance, abi.ABI_VERSION).exists()
            udp.wait_rounds(2)
            wait_exchanges(streams)
        assert streams.broken == []
        assert udp.failed == []
    finally:
        node.destroy()
