"""The checks of the configuration that are plain functions of plain values: a Maglev
table size, the bounds of ``limits``, what the configuration needs fitting the maps those
limits size, and limits that cannot change while the maps exist. The models' validators
(:mod:`xdplb.config.schema`) call them; they know nothing of the models, so nothing here
imports the schema. A failed check raises :class:`FieldError`, naming the field relative
to the model that called it.
"""

from __future__ import annotations

from xdplb.core import abi
from xdplb.core.errors import ConfigError
from xdplb.core.limits import Limits
from xdplb.tables.primes import is_prime

#: Largest table a VIP may ask for: 2**24 buckets of 8 bytes is 128 MiB of kernel memory.
MAX_TABLE_SIZE = 16_777_259

#: Bounds of each ``limits`` field: below, nothing useful fits; above, one map would
#: take gigabytes of kernel memory (docs/operations.md, "Limits and memory").
LIMIT_BOUNDS: dict[str, tuple[int, int]] = {
    "vips": (1, 65536),
    "backends": (2, 1 << 20),
    "conn_table": (64, 1 << 26),
    "hc_targets": (1, 0xFFFF),
    "acl_rules": (1, 1 << 20),
    "rate_limit_sources": (1, 1 << 24),
}


class FieldError(ValueError):
    """A model-level check that knows which field is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def check_table_size(v: int) -> None:
    """A Maglev table size: ValueError unless a prime within bounds."""
    if not 2 <= v <= MAX_TABLE_SIZE:
        raise ValueError(f"must be between 2 and {MAX_TABLE_SIZE}, got {v}")
    if not is_prime(v):
        raise ValueError(f"must be a prime (Maglev needs it), got {v}")


def check_limit_bounds(lim: Limits) -> None:
    """Every ``limits`` field within :data:`LIMIT_BOUNDS`, the connection table a power of 2."""
    for name, (lo, hi) in LIMIT_BOUNDS.items():
        v = getattr(lim, name)
        if not lo <= v <= hi:
            raise FieldError(name, f"must be between {lo} and {hi}, got {v}")
    n = lim.conn_table
    if n & (n - 1):
        lower = 1 << (n.bit_length() - 1)
        raise FieldError(
            "conn_table",
            f"must be a power of 2 (sets of {abi.CONN_WAYS} ways, a power-of-2 number of "
            f"sets), got {n}: {lower} or {lower * 2}?",
        )


def check_fits(
    lim: Limits, *, vips: int, backends: int, hc_targets: int, acl_rules: dict[int, int]
) -> None:
    """What a configuration needs (``acl_rules``: IP version -> prefixes) fits the maps
    ``lim`` sizes; the planner checks the transient needs of a change against what the
    maps hold (planner.check_capacity). Fields are relative to the whole configuration."""
    if vips > lim.vips:
        raise FieldError("limits.vips", f"{vips} VIPs configured, the limit is {lim.vips}")
    if backends > lim.backends - 1:
        raise FieldError(
            "limits.backends",
            f"{backends} distinct backends configured, at most {lim.backends - 1} fit "
            f"(slot 0 is never a backend)",
        )
    if hc_targets > lim.hc_targets:
        raise FieldError(
            "limits.hc_targets",
            f"{hc_targets} tunnelled health-check targets configured, the limit is "
            f"{lim.hc_targets}",
        )
    for version, rules in acl_rules.items():
        if rules > lim.acl_rules:
            raise FieldError(
                "limits.acl_rules",
                f"{rules} IPv{version} ACL rules configured, the limit is {lim.acl_rules}",
            )


def check_limits_unchanged(old: Limits, new: Limits) -> None:
    """A running instance's maps keep their sizes: ConfigError naming the first
    ``limits`` field ``new`` changes."""
    for name in LIMIT_BOUNDS:
        a, b = getattr(old, name), getattr(new, name)
        if a != b:
            raise ConfigError(
                f"limits.{name}",
                f"cannot change while running ({a} -> {b}): the maps keep their sizes; "
                f"`xdplb stop` and start again to resize (drops the connection table)",
            )
