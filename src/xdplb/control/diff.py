"""The differences between two configurations, one readable line per change, and which
changes made through the API a reload would drop.

This module owns the vocabulary of a configuration change as operators read it in the
daemon's log and in a refused reload: ``VIP 198.18.100.1:80/tcp: backend 198.18.0.12
weight 1 -> 3``, ``acl: + deny 203.0.113.0/24``, ``VIP [fd78::1]:53/udp added (backends
fd78::11)``. A configuration is seen as a tree keyed by what operators name (VIPs by
name, backends by address, ACL prefixes by list), so a change is a path in that tree
with the value before and after; :func:`diff` lists them in the configuration's order
and :func:`dropped` tells which runtime changes (the running configuration against the
file it came from) a new file would not keep. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from xdplb.config import AclConfig, Config


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


#: Stands for "not there" (a VIP, backend, prefix or optional field absent on one side).
ABSENT: Any = _Absent()

Path = tuple[str, ...]


#: VipConfig fields that are not settings: its name, and what has a branch of its own.
_VIP_KEYS = {"address", "port", "protocol", "acl", "backends"}


def _acl_tree(acl: AclConfig) -> dict[str, Any]:
    return {
        "allow": {str(p): True for p in acl.allow},
        "deny": {str(p): True for p in acl.deny},
    }


def tree(cfg: Config) -> dict[str, Any]:
    """``cfg`` as nested dicts keyed by what operators name: ``settings`` (every
    top-level field but the ACL and the VIPs), ``acl`` (prefixes per list), ``vips`` (by
    name: ``settings``, ``acl``, ``backends`` by address)."""
    vips: dict[str, Any] = {}
    for vip in cfg.vips:
        backends = {
            str(b.address): b.model_dump(mode="json", exclude={"address"}) for b in vip.backends
        }
        vips[vip.name] = {
            "settings": vip.model_dump(mode="json", exclude=_VIP_KEYS),
            "acl": _acl_tree(vip.acl),
            "backends": backends,
        }
    settings = cfg.model_dump(mode="json", exclude={"acl", "vips"})
    if cfg.api.token is not None:  # a log line must not carry it: its fingerprint tells a change
        digest = hashlib.sha256(cfg.api.token.encode()).hexdigest()[:12]
        settings["api"]["token"] = f"(secret, sha256 {digest})"
    return {
        "settings": settings,
        "acl": _acl_tree(cfg.acl),
        "vips": vips,
    }


def lookup(t: Mapping[str, Any], path: Path) -> Any:
    """The value at ``path`` of a :func:`tree` (:data:`ABSENT` if there is none)."""
    node: Any = t
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return ABSENT
        node = node[key]
    return node


@dataclass(frozen=True)
class Change:
    """One difference: the value at ``path`` of :func:`tree` went from ``before`` to
    ``after`` (either may be :data:`ABSENT`)."""

    path: Path
    before: Any
    after: Any

    @property
    def vip(self) -> str | None:
        """The VIP it concerns (its name), if any."""
        return self.path[1] if self.path[0] == "vips" else None

    @property
    def backend(self) -> str | None:
        """The backend it concerns (its address), if any."""
        if self.path[0] == "vips" and len(self.path) > 3 and self.path[2] == "backends":
            return self.path[3]
        return None

    def _parts(self) -> tuple[str, str | None]:
        """(what it concerns, which field or ACL rule of it; None: the whole of it)."""
        p = self.path
        if p[0] == "settings":
            return ".".join(p[1:]), None
        if p[0] == "acl":
            return "acl:", f"{p[1]} {p[2]}"
        vip = f"VIP {p[1]}"
        if len(p) == 2:
            return vip, None
        if p[2] == "settings":
            return f"{vip}:", ".".join(p[3:])
        if p[2] == "acl":
            return f"{vip}: acl:", f"{p[3]} {p[4]}"
        backend = f"{vip}: backend {p[3]}"
        return (backend, None) if len(p) == 4 else (backend, ".".join(p[4:]))

    @property
    def _acl(self) -> bool:
        return self.path[0] == "acl" or (len(self.path) > 2 and self.path[2] == "acl")

    def __str__(self) -> str:
        subject, item = self._parts()
        if self._acl:
            return f"{subject} {'+' if self.after is not ABSENT else '-'} {item}"
        if self.path[0] == "settings":
            return f"{subject}: {_show(self.before)} -> {_show(self.after)}"
        if item is not None:
            return f"{subject} {item} {_show(self.before)} -> {_show(self.after)}"
        if self.before is ABSENT:
            return f"{subject} added{_summary(self.path, self.after)}"
        return f"{subject} removed"

    def dropped(self, instead: Any) -> str:
        """This change, made through the API, would be undone by a file whose value at
        :attr:`path` is ``instead`` (:data:`ABSENT`: none): how to say so."""
        subject, item = self._parts()
        added = self.before is ABSENT
        if self._acl or (item is None and self.path[0] == "vips"):
            what = f"{subject} {item}" if item is not None else subject
            if self.after is ABSENT:
                return f"{what} (removed through the API) would be back"
            how = "dropped" if instead is ABSENT or not added else "replaced by the file's"
            return f"{what} ({'added' if added else 'changed'} through the API) would be {how}"
        what = subject if item is None else f"{subject} {item}"
        return f"{what} {_show(self.after)} (set through the API) would become {_show(instead)}"


def _show(value: Any) -> str:
    if value is ABSENT or value is None:
        return "none"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(_set(value), separators=(",", ":"))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _set(value: Any) -> Any:
    """``value`` without its None fields (a health check's unused checker kinds)."""
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None}
    return value


def _summary(path: Path, value: Any) -> str:
    """What an added VIP or backend holds, in a few words."""
    if len(path) == 2:
        backends = list(value["backends"])
        return f" (backends {', '.join(backends)})" if backends else " (no backends)"
    return f" (weight {value['weight']})"


def _walk(path: Path, a: Any, b: Any, out: list[Change]) -> None:
    if a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            _walk((*path, key), a.get(key, ABSENT), b.get(key, ABSENT), out)
        return
    out.append(Change(path, a, b))


def diff(old: Config, new: Config) -> list[Change]:
    """What changed from ``old`` to ``new``, in the configuration's order (old's VIPs and
    backends first, then those added). Empty if and only if they are equal but for the
    order of VIPs, backends or prefixes (which changes nothing in the maps)."""
    out: list[Change] = []
    _walk((), tree(old), tree(new), out)
    return out


def lines(old: Config, new: Config) -> list[str]:
    """:func:`diff` as the log prints it."""
    return [str(c) for c in diff(old, new)]


def dropped(file: Config, running: Config, new: Config) -> list[str]:
    """The changes made through the API (``running`` against ``file``, the file it was
    loaded from) that applying ``new`` would undo, each as a readable line; empty: a
    reload to ``new`` keeps every one of them (``new`` carries it too)."""
    t = tree(new)
    out = []
    for c in diff(file, running):
        instead = lookup(t, c.path)
        if instead != c.after:
            out.append(c.dropped(instead))
    return out
