"""Source ACLs and the new-flow rate limit as plain values (``bpf/lib/lb_acl.h``).

One vocabulary for the planner, the datapath layer and the model: an ACL rule is an
:class:`AclKey` (scope, source prefix) with an action (:class:`~xdplb.core.abi.AclList`
``ALLOW`` or ``DENY``). The scope is the global list (:data:`~xdplb.core.abi.ACL_GLOBAL`)
or a VIP's id. Within a scope the longest matching prefix decides; a source no rule
matches is allowed unless the scope has an allow list (docs/datapath.md, steps 5a, 6a).

:class:`AclIndex` answers the data path's question for the model, and
:func:`rate_key` names a source's token bucket.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xdplb.core import abi
from xdplb.core.addresses import IPAddress, IPNetwork


@dataclass(frozen=True)
class AclKey:
    """A rule's key in ``lb_acl4`` / ``lb_acl6``: the scope and the source prefix."""

    #: A VIP id, or ``abi.ACL_GLOBAL``.
    scope: int
    prefix: IPNetwork

    def abi_key(self) -> abi.AclKey4 | abi.AclKey6:
        """The C key (the trie's prefix length counts the scope's 32 bits)."""
        plen = 32 + self.prefix.prefixlen
        words = abi.addr_words(self.prefix.network_address)
        if self.prefix.version == 4:
            return abi.AclKey4(plen, self.scope, words[0])
        return abi.AclKey6(plen, self.scope, words)

    @classmethod
    def from_abi(cls, raw: bytes, version: int) -> AclKey:
        """From a raw ``lb_acl4`` (``version`` 4) or ``lb_acl6`` key."""
        if version == 4:
            k4 = abi.AclKey4.from_buffer_copy(raw)
            addr: IPAddress = ipaddress.IPv4Address(int(k4.addr).to_bytes(4, "little"))
            return cls(k4.scope, ipaddress.ip_network((addr, k4.prefixlen - 32)))
        k6 = abi.AclKey6.from_buffer_copy(raw)
        addr = abi.words_addr(k6.addr, abi.Family.V6)
        return cls(k6.scope, ipaddress.ip_network((addr, k6.prefixlen - 32)))

    @property
    def map_name(self) -> str:
        return "lb_acl4" if self.prefix.version == 4 else "lb_acl6"


def rule_value(action: abi.AclList) -> bytes:
    """An ``lb_acl4`` / ``lb_acl6`` value."""
    return abi.AclRule(int(action)).pack()


def hits_slot(scope: int) -> int:
    """A scope's slot in ``lb_acl_hits`` (index = slot * len(AclList) + list)."""
    return abi.ACL_GLOBAL_SLOT if scope == abi.ACL_GLOBAL else scope + 1


@dataclass(frozen=True)
class ScopeRules:
    """The rules of one scope as the configuration gives them."""

    allow: frozenset[IPNetwork] = frozenset()
    deny: frozenset[IPNetwork] = frozenset()

    @property
    def has_rules(self) -> bool:
        return bool(self.allow or self.deny)

    @property
    def default_deny(self) -> bool:
        """An allow list: a source no rule matches is denied."""
        return bool(self.allow)

    def entries(self, scope: int) -> dict[AclKey, abi.AclList]:
        out = {AclKey(scope, p): abi.AclList.ALLOW for p in self.allow}
        out.update({AclKey(scope, p): abi.AclList.DENY for p in self.deny})
        return out


class AclIndex:
    """Longest-prefix match per scope and family, as the LPM tries answer it."""

    def __init__(self, rules: Mapping[AclKey, abi.AclList]) -> None:
        #: (scope, version) -> [(prefix length, {network as int: action})], longest first.
        self._index: dict[tuple[int, int], list[tuple[int, dict[int, abi.AclList]]]] = {}
        by: dict[tuple[int, int], dict[int, dict[int, abi.AclList]]] = {}
        for key, action in rules.items():
            p = key.prefix
            lens = by.setdefault((key.scope, p.version), {})
            lens.setdefault(p.prefixlen, {})[
                int(p.network_address) >> (p.max_prefixlen - p.prefixlen)
            ] = action
        for sv, lens in by.items():
            self._index[sv] = sorted(lens.items(), reverse=True)

    def match(self, scope: int, src: IPAddress) -> abi.AclList | None:
        """The action of the longest prefix of ``scope`` holding ``src``; None: no rule."""
        bits = src.max_prefixlen
        n = int(src)
        for plen, nets in self._index.get((scope, src.version), ()):
            action = nets.get(n >> (bits - plen))
            if action is not None:
                return action
        return None

    def verdict(self, scope: int, src: IPAddress, default_deny: bool) -> abi.AclList | None:
        """The list the data path counts a hit under (``DENY`` and ``DEFAULT`` drop), or
        None when the source passes uncounted (no rule, no allow list)."""
        action = self.match(scope, src)
        if action is not None:
            return action
        return abi.AclList.DEFAULT if default_deny else None


def rate_key(src: IPAddress, prefix4: int, prefix6: int) -> IPNetwork:
    """The token bucket ``src`` draws from: its prefix of the configured length."""
    plen = prefix4 if src.version == 4 else prefix6
    return ipaddress.ip_network((src, min(plen, src.max_prefixlen)), strict=False)


def rate_map_key(prefix: IPNetwork) -> bytes:
    """The ``lb_rate`` key of a bucket (``struct xdplb_addr`` of the masked source)."""
    return abi.Addr.make(prefix.network_address).pack()


def sorted_keys(keys: Iterable[AclKey]) -> list[AclKey]:
    """Rules in a stable order (for plans and listings)."""
    return sorted(keys, key=lambda k: (k.scope, k.prefix.version, k.prefix))
