"""``xdplb run``: the daemon that serves one instance.

:mod:`~xdplb.daemon.main` (the asyncio loop, signals, reloads, the agents' socket),
:mod:`~xdplb.daemon.api` (HTTP API, FastAPI), :mod:`~xdplb.daemon.logs` (log formats,
who calls the API), :mod:`~xdplb.daemon.metrics` (Prometheus),
``web/`` (the status page), :mod:`~xdplb.daemon.privileges` (the capabilities it keeps),
:mod:`~xdplb.daemon.socket_lb` (socket-level balancing from the XDP tier's tables).

May import: core, tables, config, datapath, health, agent, control, cluster, sync, sockets.
"""
