"""The address types every layer shares: one spelling of "an IPv4 or IPv6 address", and
one reading of an IPv4-mapped IPv6 address (as the IPv4 address it carries)."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def unmap(addr: IPAddress) -> IPAddress:
    """``::ffff:a.b.c.d`` as ``a.b.c.d``; any other address as it is."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr
