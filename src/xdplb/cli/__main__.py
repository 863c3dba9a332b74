"""``python -m xdplb.cli``: the ``xdplb`` command."""

from xdplb.cli.app import main

main()
