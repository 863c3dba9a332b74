"""Lookup tables: which backend owns each bucket.

Maglev (:mod:`~xdplb.tables.maglev`, population loop in C) and Beamer
(:mod:`~xdplb.tables.beamer`: hop lists, moved by policy); :mod:`~xdplb.tables.primes`
is pure Python so that validating a configuration needs no built extension.

May import: core.
"""
