"""The bottom layer: plain types and pure functions every other package shares.

The ABI mirror of ``bpf/include/xdplb_abi.h`` (:mod:`~xdplb.core.abi`), addresses, the
one exception hierarchy, paths of objects, pins and run-time files, the flow hash, the
vocabulary of what the maps hold (:mod:`~xdplb.core.state`) and of the operations that
change them (:mod:`~xdplb.core.mapops`), ACL keys, map sizes, agents' load reports, and
:class:`~xdplb.core.closing.Closing` (``with`` for whatever has a ``close``). No I/O
beyond reading paths from the environment.

May import: nothing.
"""
