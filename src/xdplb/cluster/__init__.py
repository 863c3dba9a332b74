"""A node of a cluster of balancers (docs/cluster.md): announcing the VIPs over BGP
while the node's self-check passes.

- :mod:`~xdplb.cluster.bird`: BIRD 2, the speaker: its configuration, process, ``birdc``;
- :mod:`~xdplb.cluster.announce`: what the node announces, withdraws, and when;
- :mod:`~xdplb.cluster.selfcheck`: can this node's data plane serve?

Fleet state (etcd) and the gate on session sync come next.

May import: core, config, datapath, control (the running instance the self-check reads).
"""
