"""Long-lived flows through a cluster of the lab (docs/cluster.md, "Connections when a
node leaves"): a Maglev VIP and a Beamer VIP, each with a TCP echo on 7 and a UDP echo on
53 at every backend; :class:`Flows` keeps long-lived TCP streams (every byte verified) and
UDP flows to both through the LB nodes behind the BIRD router, and counts per VIP kind
the flows that stayed on their node, moved to another, and broke. The cluster tests
(tests/e2e/test_cluster_changes.py, test_session_sync.py) drive the changes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from xdplb.lab.cluster import Tally, UdpFlows, carriers, flow_key
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import PacedStreams
from xdplb.lab.registry import cleanup_stale
from xdplb.lab.topology import Lab
from xdplb.lab.wait import wait_for

#: table kind -> VIP address (echo on TCP 7, UDP echo on 53 at each).
VIPS = {"maglev": "198.18.100.1", "beamer": "198.18.100.2"}
PREFIXES = list(VIPS.values())
ECHO, UDP = 7, 53
#: Long-lived TCP streams per VIP (300 in all), each exchanging SIZE bytes every PERIOD s.
STREAMS, SIZE, PERIOD = 150, 512, 0.2
UDP_FLOWS = 16
#: The backend removed and the one added while a node is out.
REMOVED, ADDED = "b2", "b4"

Kind = tuple[str, str]  # (table kind, "tcp" or "udp")


def vips(lab: Lab, backends: Sequence[str], **extra: Any) -> list[dict[str, Any]]:
    """Both VIPs, TCP and UDP, over ``backends`` (``extra``: more fields of each VIP)."""
    members = [{"address": str(lab.addr(b))} for b in backends]
    return [
        {
            "address": addr,
            "port": port,
            "protocol": proto,
            "table": table,
            "backends": members,
            **extra,
        }
        for table, addr in VIPS.items()
        for port, proto in ((ECHO, "tcp"), (UDP, "udp"))
    ]


@contextmanager
def cluster(lbs: int, backends: int) -> Iterator[Lab]:
    """A router lab with host_tc and the servers on every backend."""
    cleanup_stale()
    with Lab(lbs=lbs, backends=backends, router=True, vips=PREFIXES) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        lab.start_servers()  # killed at the lab's teardown
        yield lab


class Flows:
    """STREAMS TCP streams and UDP_FLOWS UDP flows to each VIP, their flow keys, and what
    they went through."""

    def __init__(self, lab: Lab, stack: ExitStack) -> None:
        self.t_start = time.monotonic()
        self.streams = {
            t: stack.enter_context(
                PacedStreams(lab.ns("client"), vip, ECHO, n=STREAMS, size=SIZE, period=PERIOD)
            )
            for t, vip in VIPS.items()
        }
        self.udp = {t: UdpFlows(lab, vip, UDP_FLOWS, UDP) for t, vip in VIPS.items()}
        for u in self.udp.values():
            stack.callback(u.close)
        self.keys: dict[Kind, list[bytes]] = {
            (t, "tcp"): [flow_key(lab, vip, p, ECHO) for p in self.streams[t].ports]
            for t, vip in VIPS.items()
        } | {
            (t, "udp"): [flow_key(lab, vip, p, UDP, socket.IPPROTO_UDP) for p in self.udp[t].ports]
            for t, vip in VIPS.items()
        }
        self.every_key = [k for ks in self.keys.values() for k in ks]
        #: The backend of each flow at the start.
        self.backends: dict[Kind, list[str]] = {
            (t, "tcp"): s.backends for t, s in self.streams.items()
        } | {(t, "udp"): u.backends() for t, u in self.udp.items()}
        for s in self.streams.values():
            wait_for(lambda s=s: min(s.verified()), "every stream's first exchange")  # type: ignore[misc]
        #: Why each flow broke (index -> reason), per kind, accumulated over the phases.
        self.broken: dict[Kind, dict[int, str]] = {k: {} for k in self.keys}

    def carriers(
        self, nodes: Sequence[LbNode], names: Sequence[str], since: float
    ) -> dict[bytes, str | None]:
        """The node of every flow: the newest of its sessions that saw a packet after
        ``since`` (time.monotonic()), once every flow that did not break has one on a node
        of ``names`` (the UDP flows exchange first, so their newest session is of now). A
        flow that broke is where its last packet went (the nodes joined by ``+`` if its
        last packets went to several in one tick: it moved)."""
        live = [
            k
            for kind, ks in self.keys.items()
            for i, k in enumerate(ks)
            if i not in self.broken[kind]
        ]

        def read() -> dict[bytes, str | None]:
            self.exchange_udp()
            return carriers(nodes, self.every_key, max_age=time.monotonic() - since + 1.0)

        return wait_for(
            read,
            f"a node of {sorted(names)} for every flow in the session tables",
            until=lambda c: all(c[k] in names for k in live),
        )

    def exchange_udp(self) -> None:
        """One exchange on every UDP flow; a flow answered by another backend than at
        the start, or not at all, is broken."""
        for t, u in self.udp.items():
            was = self.backends[t, "udp"]
            for i, b in enumerate(u.backends()):
                if b != was[i]:
                    self.broken[t, "udp"].setdefault(i, f"{was[i]}, then {b}")

    def mark(self) -> dict[str, list[int]]:
        return {t: s.verified() for t, s in self.streams.items()}

    def settle(self, mark: dict[str, list[int]]) -> dict[Kind, dict[int, str]]:
        """Wait until every stream that did not break moved on since ``mark``; the flows
        broken since the last call, per kind."""
        before = {k: dict(v) for k, v in self.broken.items()}
        for t, s in self.streams.items():
            self.broken[t, "tcp"].update(s.why_broken(s.wait_resumed(mark[t])))
        self.exchange_udp()
        return {
            k: {i: r for i, r in v.items() if i not in before[k]} for k, v in self.broken.items()
        }

    def tally(
        self,
        before: dict[bytes, str | None],
        after: dict[bytes, str | None],
        broke: dict[Kind, dict[int, str]],
        on: Sequence[str] | None = None,
    ) -> dict[Kind, Tally]:
        """Per kind, the flows (on a backend of ``on`` at the start, or all) live at
        ``before`` (not broken by then): moved (another node at ``after``) or not, and
        those that ``broke`` since."""
        out = {kind: Tally() for kind in self.keys}
        for kind, ks in self.keys.items():
            for i, k in enumerate(ks):
                if i in self.broken[kind] and i not in broke[kind]:
                    continue  # broke before
                if on is not None and self.backends[kind][i] not in on:
                    continue
                out[kind].add(after[k] != before[k], broke[kind].get(i))
        return out


def summary(tallies: dict[Kind, Tally]) -> str:
    return "; ".join(f"{t} {proto}: {tally}" for (t, proto), tally in tallies.items())
