"""The control plane: from the desired configuration and what the maps hold to the map
operations that make them agree, and the running instance that applies them.

- :mod:`~xdplb.control.planner`: desired config + snapshot -> operations (pure);
- :mod:`~xdplb.control.overlay`: configured weights less down and drained backends (pure);
- :mod:`~xdplb.control.weight_law`: load reports -> weights, the damped control law (pure);
- :mod:`~xdplb.control.vip_weights`: one such controller per VIP, and the weights it settled on;
- :mod:`~xdplb.control.drain`: connection counts per backend, when a drain is done;
- :mod:`~xdplb.control.status`: the status models and their one builder (the daemon's,
  and the CLI's from the pins);
- :mod:`~xdplb.control.diff`: two configurations -> one readable line per change (pure);
- :mod:`~xdplb.control.caller`: who asked for the change being applied (for the log);
- :mod:`~xdplb.control.interface`: what the daemon offers operators (changes, drains,
  the :class:`~xdplb.control.interface.Controller` protocol);
- :mod:`~xdplb.control.runtime`: the running instance, which implements it.

May import: core, tables, config, datapath, health.
"""
