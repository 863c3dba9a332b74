"""The socket tier on a server host: traffic reaches the right socket.

- :mod:`~xdplb.sockets.reuseport`: generations of a server on one SO_REUSEPORT group,
  kept apart by an sk_reuseport program (zero-downtime restarts, UDP flows included).
- :mod:`~xdplb.sockets.serve`: ``xdplb serve``, a supervisor that owns the sockets and
  starts generations of an unmodified server (systemd-style socket passing).
- :mod:`~xdplb.sockets.takeover`: handing sockets to a successor over a unix socket
  where BPF is not allowed.
- :mod:`~xdplb.sockets.udp`: the plain SO_REUSEPORT UDP helper (one socket per worker).
- :mod:`~xdplb.sockets.binds`: ``xdplb host check-binds``, bind() mixes that make the
  kernel walk a long hash bucket.
- :mod:`~xdplb.sockets.sock_lb`: socket-level service balancing in a cgroup.

May import: core, tables, datapath.
"""
