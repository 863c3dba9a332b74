"""Which map each ``limits`` field sizes, and how big that makes it.

The BPF objects declare today's defaults as their maps' ``max_entries``; the loader
(:meth:`xdplb.datapath.objects.BpfObject.load`) sets the configured sizes by map name
before the maps are created, skipping names an object does not have. Pinned maps keep
the size they were created with: a configuration asking for another one is refused
before anything is loaded (:class:`PinnedSizeMismatch`), since libbpf would refuse to
reuse them anyway, with a less helpful error.

Pure: no bpf syscalls here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from xdplb.core import abi
from xdplb.core.errors import ConfigError

#: sock_lb's fixed map sizes (bpf/include/sock_lb_abi.h; tests/bpf/test_sock_lb_abi.py
#: checks them against the object): not configurable, checked by the configuration.
SOCKLB_MAX_SERVICES = 256
SOCKLB_MAX_BACKENDS = 4096


class Limits(Protocol):
    """The sizes ``limits:`` sets (:class:`xdplb.config.LimitsConfig` is one): what this
    module needs of the configuration, without depending on it."""

    vips: int
    backends: int
    conn_table: int
    hc_targets: int
    acl_rules: int
    rate_limit_sources: int


@dataclass(frozen=True)
class SizedMap:
    """A map whose ``max_entries`` comes from a ``limits`` field: ``field * mul // div``."""

    name: str
    field: str
    mul: int = 1
    div: int = 1
    add: int = 0
    #: Round ``field * mul // div`` up to a power of 2, then take this many of it.
    pow2_copies: int = 0

    def size(self, limits: Limits) -> int:
        n = (int(getattr(limits, self.field)) + self.add) * self.mul // self.div
        if self.pow2_copies:
            n = self.pow2_copies << (n - 1).bit_length()
        return n


#: Every map sized from the configuration, by name (lb_xdp's, hc_tc's). lb_vips has
#: room for a plan that puts every new VIP before it deletes the old ones.
SIZED_MAPS: dict[str, SizedMap] = {
    m.name: m
    for m in (
        SizedMap("lb_vips", "vips", mul=2),
        SizedMap("lb_vip_addrs", "vips"),
        SizedMap("lb_tables", "vips"),
        SizedMap("lb_btables", "vips"),
        SizedMap("lb_vip_stats", "vips"),
        SizedMap("lb_members", "vips"),
        # Two tables of 8 slots per VIP, a power of 2 (lb_config.vip_index_mask + 1).
        SizedMap("lb_vip_index", "vips", mul=8, pow2_copies=2),
        SizedMap("lb_backends", "backends"),
        SizedMap("lb_be_stats", "backends"),
        SizedMap("lb_nexthops", "backends"),  # lb_xdp's per-CPU next-hop cache, not pinned
        SizedMap("lb_conns", "conn_table", div=abi.CONN_WAYS),
        SizedMap("hc_targets", "hc_targets"),
        SizedMap("lb_acl4", "acl_rules"),
        SizedMap("lb_acl6", "acl_rules"),
        SizedMap("lb_rate", "rate_limit_sources"),
        # A slot per VIP id plus the global one, each with a counter per list.
        SizedMap("lb_acl_hits", "vips", mul=len(abi.AclList), add=1),
    )
}


def map_sizes(limits: Limits) -> dict[str, int]:
    """Map name -> max_entries, for every map :data:`SIZED_MAPS` knows."""
    return {name: m.size(limits) for name, m in SIZED_MAPS.items()}


def config_key(name: str) -> str:
    """The configuration field that sizes map ``name`` (``limits.conn_table``)."""
    return f"limits.{SIZED_MAPS[name].field}"


@dataclass(frozen=True)
class PinnedSizeMismatch:
    """A pinned map whose size is not the one the configuration asks for."""

    name: str
    pinned: int
    wanted: int

    def error(self, instance: str) -> ConfigError:
        """The refusal, naming the field and the way out."""
        m = SIZED_MAPS.get(self.name)
        field = config_key(self.name) if m is not None else ""

        def entries(n: int) -> str:
            # The connection table is configured in connections, its map holds sets.
            return f"{n * m.div // m.mul}" if m is not None else str(n)

        what = "connections" if self.name == "lb_conns" else "entries"
        return ConfigError(
            field,
            f"pinned {self.name} holds {entries(self.pinned)} {what}, the configuration asks "
            f"for {entries(self.wanted)}: a pinned map keeps its size. Run `xdplb stop -i "
            f"{instance}` to start afresh (it detaches the instance and removes its pins, "
            f"the connection table with them), or keep the old value",
        )


def mismatches(pinned: Mapping[str, int], wanted: Mapping[str, int]) -> list[PinnedSizeMismatch]:
    """Pinned maps (name -> max_entries) whose size differs from ``wanted``'s."""
    return [
        PinnedSizeMismatch(n, pinned[n], wanted[n])
        for n in sorted(pinned.keys() & wanted.keys())
        if pinned[n] != wanted[n]
    ]
