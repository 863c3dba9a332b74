"""The ``xdplb`` command (typer + rich) and its client of the daemon's API: ``app`` (the
commands), ``args`` (exit codes, option types, argument parsing), ``render`` (what the
commands print), ``client`` (the API client); ``python -m xdplb.cli`` runs it.

May import: core, tables, config, datapath, health, agent, control, cluster, daemon, sockets.
Everything but the lab: ``xdplb run`` starts :mod:`xdplb.daemon`.
"""
