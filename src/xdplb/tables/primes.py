"""Primality of table sizes, in pure Python: validating a configuration needs no built
extension (Maglev's table size must be prime, paper §3.4)."""

from __future__ import annotations

import math


def is_prime(n: int) -> bool:
    """Trial division: table sizes are at most 2**32, so at most ~11,000 divisions."""
    if n < 2:
        return False
    if n < 4:
        return True
    if n % 2 == 0 or n % 3 == 0:
        return False
    # Every prime above 3 is 6k - 1 or 6k + 1.
    return all(n % d and n % (d + 2) for d in range(5, math.isqrt(n) + 1, 6))
