"""The ``xdplb`` command (typer + rich) and its client of the daemon's API.

May import: core, tables, config, datapath, health, agent, control, daemon.
Everything but the lab: ``xdplb run`` starts :mod:`xdplb.daemon`.
"""
