"""The lab's router: BIRD 2 in namespace ``rt``, peering with every LB node over eBGP
with BFD, installing what they announce as multipath routes in its kernel (hashed on
the ports: ``fib_multipath_hash_policy=1``), as the routers in front of a fleet of
balancers do (docs/cluster.md). The client reaches the VIPs through it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from xdplb.cluster.bird import Bird, Timers

if TYPE_CHECKING:
    from xdplb.lab.topology import Lab

#: The router's AS and the LB nodes' (one AS for every node: the router merges only
#: paths with equal AS-path length, origin, MED and local preference).
ROUTER_ASN = 65000
NODE_ASN = 65001


def router_config(lab: Lab, log_file: Path, timers: Timers) -> str:
    rt = lab.nodes["rt"]
    out = [
        f'log "{log_file}" all;',
        f"router id {rt.v4};",
        "protocol device { scan time 1; }",
        "protocol kernel kernel4 { ipv4 { import none; export all; }; merge paths on; }",
        "protocol kernel kernel6 { ipv6 { import none; export all; }; merge paths on; }",
        "protocol bfd {",
        '  interface "eth0" {',
        f"    min rx interval {timers.bfd_interval_ms} ms;",
        f"    min tx interval {timers.bfd_interval_ms} ms;",
        f"    multiplier {timers.bfd_multiplier};",
        "  };",
        "}",
    ]
    for name in lab.lbs:
        for fam in (4, 6):
            out += [
                f"protocol bgp {name}_v{fam} {{",
                f"  local as {ROUTER_ASN};",
                f"  neighbor {lab.addr(name, fam)} as {NODE_ASN};",
                f"  hold time {timers.hold_time};",
                f"  keepalive time {max(1, timers.hold_time // 3)};",
                "  connect delay time 1;",
                "  connect retry time 1;",
                "  error wait time 1, 4;",
                "  bfd on;",
                f"  ipv{fam} {{ import all; export none; }};",
                "}",
            ]
    return "\n".join(out) + "\n"


def start_router(lab: Lab, directory: Path, timers: Timers | None = None) -> Bird:
    """BIRD on ``rt``, configured for the lab's LB nodes; stopped at the lab's teardown."""
    bird = Bird(directory)
    bird.start(
        router_config(lab, directory / "bird.log", timers or Timers()),
        spawn=lambda argv: lab.popen(
            "rt", argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ),
    )
    lab.on_teardown(bird.stop)
    return bird


_NEXTHOP = re.compile(r"nexthop via (\S+)|^\S+ via (\S+)", re.M)


def route_nexthops(lab: Lab, prefix: str) -> list[str]:
    """The next hops of ``prefix`` in the router's kernel, as ``ip route`` lists them."""
    fam = "-6" if ":" in prefix else "-4"
    out = lab.run("rt", ["ip", fam, "route", "show", prefix]).stdout
    return sorted(a or b for a, b in _NEXTHOP.findall(out))
