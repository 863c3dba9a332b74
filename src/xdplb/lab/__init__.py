"""The network-namespace lab: a client, an LB and backends on one bridged segment.

- netns: enter a namespace (setns) and start processes in one, without ``ip netns exec``
- topology: :class:`Lab`, the topology with its addresses
- registry: the instances' prefixes and owners, and :func:`cleanup_stale` of dead ones
- host: :func:`attach_host`, host_tc on a backend
- router: ``rt``'s BIRD in a cluster lab (``Lab(lbs=3, router=True)``)
- cluster: a cluster lab's events (a node stopped, killed, cut off, black-holed and brought
  back), the router's routes over netlink, which node's session table carries a flow,
  what the flows went through (UDP flows, streams resumed or broken, tallies)
- packets: GUE / IPIP packets as lb_xdp builds them
- pytest_plugin: the ``lab`` fixture, and ``netns`` (a bare namespace for the socket tier)
- cgroup_clients: a child cgroup, and clients that join it (socket-level balancing)
- browser: :class:`~xdplb.lab.browser.Browser`, headless Chromium in a namespace (status page tests)
- lbnode, agents, apps, traffic, paced, listeners, flood: the daemon, agents, servers and
  clients of a lab run; demo (``make demo``) and soak (``make soak``) are runs of their own

The top of the tree: what it needs of test-only libraries (scapy, selenium) it imports
inside the functions that use them, so the runtime package never needs them.

May import: core, tables, model, datapath, config, health, agent, control, cluster, daemon, cli.
"""

from xdplb.lab.registry import cleanup_stale
from xdplb.lab.topology import (
    DEFAULT_VIPS,
    SEGMENT4,
    SEGMENT6,
    VIP_NET4,
    VIP_NET6,
    Lab,
    Node,
)

__all__ = [
    "DEFAULT_VIPS",
    "SEGMENT4",
    "SEGMENT6",
    "VIP_NET4",
    "VIP_NET6",
    "Lab",
    "Node",
    "cleanup_stale",
]
