"""Session sync between balancer nodes (docs/sync.md, MGW's): a flow the routers move to
another node keeps its backend there, because that node has its session too.

- :mod:`~xdplb.sync.wire`: the messages, versioned and authenticated (sans-I/O);
- :mod:`~xdplb.sync.convert`: sessions between this node's table (backend ids, jiffies)
  and the wire (addresses, ages), many at once;
- :mod:`~xdplb.sync.node`: the node's side: publisher of its sessions, subscriber of its
  peers', the full copy a starting node waits for before it announces.

May import: core, config, datapath, control.
"""
