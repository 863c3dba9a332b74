"""The backend-side agent: it measures its host and reports to the controller over UDP.

Every ``interval`` the agent measures, over the interval just ended, the machine's cpu
utilisation and the TCP connections it accepted per second (:mod:`~xdplb.agent.sampling`),
and right before sending, the server-side connections open per (local address, port)
(:mod:`~xdplb.agent.serverconns`) and host_tc's event counters when host_tc is pinned on
this host (:mod:`~xdplb.agent.run`). It sends them as one JSON datagram
(:mod:`~xdplb.agent.wire`) to the controller, whose :mod:`~xdplb.agent.receiver` reads
them as load reports.

- :mod:`~xdplb.agent.sampling`: /proc/stat cpu times and passive opens, rates between samples;
- :mod:`~xdplb.agent.serverconns`: server-side TCP connections counted with sock_diag;
- :mod:`~xdplb.agent.wire`: the report datagram, encoded and decoded as untrusted input;
- :mod:`~xdplb.agent.receiver`: the controller's end, a non-blocking UDP socket;
- :mod:`~xdplb.agent.run`: the agent's loop and its end-of-interval measurements;
- ``python -m xdplb.agent``: the command line (:mod:`xdplb.agent.__main__`).

With ``--steer-instance`` it also keeps ``xdplb host steer``'s sk_lookup rules on live
sockets: a restarted server's new socket takes the rules of its old one.

May import: core, datapath.
The datapath only lazily, where host_tc's pins are read or steering is followed: libbpf
is needed only on hosts that run them.
"""
