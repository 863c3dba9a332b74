"""A node of a cluster of balancers (docs/cluster.md): announcing the VIPs over BGP
while the node's self-check passes.

- :mod:`~xdplb.cluster.bird`: BIRD 2, the speaker: its configuration, process, ``birdc``;
- :mod:`~xdplb.cluster.announce`: what the node announces, withdraws, and when;
- :mod:`~xdplb.cluster.selfcheck`: can this node's data plane serve?
- :mod:`~xdplb.cluster.probe`: a packet to each VIP through the attached program,
  against what the model says the maps should do with it;
- :mod:`~xdplb.cluster.store`: the fleet's configuration and every node's report in etcd.

Agreed health, Beamer history in the store and the gate on session sync come next.

The self-check reads the running instance (control) and predicts the probe's verdict
with the model.

May import: core, config, datapath, control, model.
"""
