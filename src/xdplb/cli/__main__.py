"""``python -m xdplb.cli``: the ``xdplb`` command."""

from xdplb.cli.app import main

if __name__ == "__main__":
    main()
