"""The ``xdplb`` command (typer + rich) and its client of the daemon's API.

May import: every package but lab (``xdplb run`` starts :mod:`xdplb.daemon`).
"""
