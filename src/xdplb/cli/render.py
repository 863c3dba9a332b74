"""What the ``xdplb`` commands print: a :class:`~xdplb.control.status.Status` (one renderer
whether the daemon answered or the pins were read), VIP lists, drains, ACLs, the outcome
of a change, host_tc's counters; and the consoles they print on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import typer
from rich.table import Table

from xdplb.cli.console import console
from xdplb.control.interface import AclView, ChangeResult, DrainStatus
from xdplb.control.sessions import Connection
from xdplb.control.status import (
    BackendStatus,
    ClusterStatus,
    MapStatus,
    SocketLbStatus,
    Status,
    SyncStatus,
    VipStatus,
)


def print_json(doc: object) -> None:
    """``--json``: ``doc`` (JSON types) indented, on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _human(n: float) -> str:
    """ipvsadm's counts: as they are up to 99,999, then K, M, G (powers of 1000)."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 100_000 or unit == "T":
            return f"{n:.0f}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


# -- the VIP view ------------------------------------------------------------------------


def _conns(b: BackendStatus, table: dict[tuple[str, str], int] | None, vip: str) -> dict[str, Any]:
    """ActiveConn, InActConn and where they come from: the agent, else the session table
    (None: not read)."""
    if b.established is not None:
        inactive = b.inactive
        active = b.established - inactive if inactive is not None else b.established
        return {"active": active, "inactive": inactive, "conns_source": "agent"}
    if table is not None:
        return {"active": table.get((vip, b.address), 0), "inactive": None, "conns_source": "table"}
    return {"active": None, "inactive": None, "conns_source": None}


def view(
    vips: list[VipStatus],
    table: dict[tuple[str, str], int] | None,
    *,
    stats: bool = False,
    rate: dict[str, dict[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """The VIP view as JSON types (``--json``): ``rate`` maps a VIP's or a backend's
    key (its name, ``name backend``) to cps, pps, bps."""
    out = []
    for v in vips:
        doc: dict[str, Any] = {
            "vip": v.name,
            "protocol": v.protocol,
            "address": v.address,
            "port": v.port,
            "scheduler": v.table,
            "hash": v.hash,
            "all_down": v.all_down,
        }
        if stats:
            doc |= {"conns": v.new_flows, "packets": v.packets, "bytes": v.bytes}
        if rate is not None:
            doc |= rate.get(v.name, {})
        backends = []
        for b in v.backends:
            bd: dict[str, Any] = {
                "address": b.address,
                "port": v.port,
                "forward": v.encap,
                "weight": b.weight,
                "effective_weight": b.effective_weight,
                **_conns(b, table, v.name),
                "health": b.health,
                "admin": b.admin,
            }
            if stats:
                bd |= {"conns": b.new_flows, "packets": b.packets, "bytes": b.bytes}
            if rate is not None:
                bd |= rate.get(f"{v.name} {b.address}", {})
            backends.append(bd)
        doc["backends"] = backends
        out.append(doc)
    return out


def rates(before: Status, after: Status, seconds: float) -> dict[str, dict[str, float]]:
    def per(a: VipStatus | BackendStatus, b: VipStatus | BackendStatus) -> dict[str, float]:
        return {
            "cps": (b.new_flows - a.new_flows) / seconds,
            "pps": (b.packets - a.packets) / seconds,
            "bps": (b.bytes - a.bytes) / seconds,
        }

    out: dict[str, dict[str, float]] = {}
    old = {v.name: v for v in before.vips}
    for v in after.vips:
        was = old.get(v.name)
        if was is None:
            continue
        out[v.name] = per(was, v)
        old_b = {b.address: b for b in was.backends}
        for b in v.backends:
            if b.address in old_b:
                out[f"{v.name} {b.address}"] = per(old_b[b.address], b)
    return out


def _width(doc: list[dict[str, Any]]) -> int:
    """The first column's width: every VIP's and every backend's (with its arrow) fits."""
    names = [len(f"{v['protocol']:<4} {_host(v['address'])}:{v['port']}") for v in doc]
    ends = [5 + len(f"{_host(b['address'])}:{b['port']}") for v in doc for b in v["backends"]]
    return max([*names, *ends, 22])


def status_lines(st: Status) -> Iterator[str]:
    """``xdplb status``'s VIP table: configuration, health and counters, a backend a
    line within 100 columns for IPv4 (the weights' and counters' ``-``: not known)."""
    doc = view(st.vips, None, stats=True)
    width = _width(doc)
    yield (
        f"{'Prot LocalAddress:Port':<{width}}  Weight   Eff  Share ActConn InAct "
        f"{'InPkts':>8} {'InBytes':>8} State"
    )
    for v, vs in zip(doc, st.vips, strict=True):
        name = f"{v['protocol'].upper():<4} {_host(v['address'])}:{v['port']}"
        flags = f"{v['scheduler']} {vs.encap} {v['hash']}"
        down = "  ALL BACKENDS DOWN (last table kept)" if v["all_down"] else ""
        nums = f"{_human(v['packets']):>8} {_human(v['bytes']):>8}"
        yield f"{name:<{width}}  {flags:<33} {nums}{down}"
        for b, bs in zip(v["backends"], vs.backends, strict=True):
            end = f"{_host(b['address'])}:{b['port']}"
            normal = ("up", "unchecked", "enabled")
            state = ",".join(s for s in (b["health"], b["admin"]) if s not in normal) or "-"
            yield (
                f"  -> {end:<{width - 5}}  {_opt(b['weight']):>6} {_opt(b['effective_weight']):>5} "
                f"{bs.table_share:>6.1%} {_opt(b['active']):>7} {_opt(b['inactive']):>5} "
                f"{_human(b['packets']):>8} {_human(b['bytes']):>8} {state}"
            )


def view_lines(
    doc: list[dict[str, Any]], *, stats: bool = False, rate: bool = False
) -> Iterator[str]:
    """``ipvsadm -L -n``'s layout of :func:`view`'s ``doc``: a header, a line per VIP,
    an indented line per backend, columns aligned; numbers with K/M/G past 99,999."""
    width = _width(doc)
    head = f"  -> {'RemoteAddress:Port':<{width - 5}}"
    if stats:
        yield f"{'Prot LocalAddress:Port':<{width}}  {'Conns':>8} {'InPkts':>8} {'InBytes':>8}"
        yield f"{head}  {'Conns':>8} {'InPkts':>8} {'InBytes':>8}"
        cols: tuple[str, ...] = ("conns", "packets", "bytes")
    elif rate:
        yield f"{'Prot LocalAddress:Port':<{width}}  {'CPS':>8} {'InPPS':>8} {'InBPS':>8}"
        yield f"{head}  {'CPS':>8} {'InPPS':>8} {'InBPS':>8}"
        cols = ("cps", "pps", "bps")
    else:
        yield "Prot LocalAddress:Port Scheduler Flags"
        yield f"{head}  Forward Weight ActiveConn InActConn State"
        cols = ()
    for v in doc:
        name = f"{v['protocol'].upper():<4} {_host(v['address'])}:{v['port']}"
        if cols:
            nums = " ".join(f"{_human(v.get(c, 0)):>8}" for c in cols)
            yield f"{name:<{width}}  {nums}"
        else:
            flags = "sh" if v["hash"] == "source" else ""
            down = "  ALL BACKENDS DOWN (last table kept)" if v["all_down"] else ""
            yield f"{name} {v['scheduler']} {flags}".rstrip() + down
        for b in v["backends"]:
            end = f"{_host(b['address'])}:{b['port']}"
            if cols:
                nums = " ".join(f"{_human(b.get(c, 0)):>8}" for c in cols)
                yield f"  -> {end:<{width - 5}}  {nums}"
                continue
            state = [
                s for s in (b["health"], b["admin"]) if s not in ("up", "unchecked", "enabled")
            ]
            table = "*" if b["conns_source"] == "table" else ""
            yield (
                f"  -> {end:<{width - 5}}  {b['forward']:<7} {_opt(b['weight']):>6} "
                f"{_opt(b['active']) + table:>10} {_opt(b['inactive']):>9} "
                f"{','.join(state) or '-'}"
            ).rstrip()
    if any(b["conns_source"] == "table" for v in doc for b in v["backends"]) and not cols:
        yield "* entries of the session table (no agent reports for that backend)"
    if stats or rate:
        yield "(a backend's counters are its traffic over all VIPs)"


def connection_lines(conns: Iterator[Connection]) -> Iterator[str]:
    """``ipvsadm -L -n -c``'s layout, one line per session as it is read (widths fit
    IPv4): its state and idle seconds where ipvsadm has state and expiry."""
    yield (
        f"{'Pro':<4}{'FromIP:Port':<22} {'ToIP:Port':<22} {'Backend':<16} "
        f"{'State':<11} {'Idle':>7} Set:Way"
    )
    for c in conns:
        src = f"{_host(c.client)}:{c.client_port}"
        dst = f"{_host(c.destination)}:{c.destination_port}"
        yield (
            f"{c.protocol.upper():<4}{src:<22} {dst:<22} {_opt(c.backend):<16} "
            f"{c.state:<11} {c.idle:>7.1f} {c.set}:{c.way}"
        )


def map_lines(maps: list[MapStatus]) -> Iterator[str]:
    """One line per sized map: entries of max, the fill, the field that sizes it."""
    if maps:
        yield "maps (entries of max, fill, sized by):"
    for m in maps:
        fill = m.entries / m.max_entries if m.max_entries else 0.0
        approx = "~" if m.estimated else ""
        yield (f"  {m.name:<13} {approx}{m.entries} of {m.max_entries}  {fill:.1%}  {m.config_key}")


def print_status(st: Status) -> None:
    """``xdplb status``; what the pins cannot say is left out."""
    head = f"instance {st.instance}" + (f" ({st.config_path})" if st.config_path else "")
    where = [f"{a.name} ({a.hook})" for a in st.hooks] or st.attached
    head += f", attached to {', '.join(where) or 'nothing'}"
    if st.uptime is not None:
        mins, secs = divmod(int(st.uptime), 60)
        head += f", up {mins}m{secs:02d}s"
    if st.source == "pins":
        head += "; no daemon answers: read from the pins"
    if st.runtime_changes:
        head += "; RUNTIME CHANGES NOT PERSISTED"
    typer.echo(head)
    used = "?" if st.conn_table.used is None else st.conn_table.used
    line = f"connection table {used} of {st.conn_table.capacity} entries"
    if st.conn_table.used is None:
        line += " (its layout is not one this xdplb reads)"
    if st.rebuilds is not None:
        last = "" if st.last_rebuild_ms is None else f" (last {st.last_rebuild_ms:.1f} ms)"
        line += f"; {st.rebuilds} rebuilds{last}"
    if st.health_checks is not None:
        line += f"; {st.health_checks} health checks"
    typer.echo(line)
    for a in st.hooks:
        if a.why:
            typer.echo(f"  {a.name}: {a.hook} ({a.why})")
    for line in status_lines(st):
        typer.echo(line)
    for v in st.vips:
        for b in v.backends:
            if b.health_detail and b.health == "down":
                typer.echo(f"{v.name} backend {b.address} down: {b.health_detail}")
    for line in map_lines(st.maps):
        typer.echo(line)
    for what, counts in (("events", st.events), ("drops", st.drops)):
        for line in _wrapped(f"{what}:", [f"{k} {n}" for k, n in counts.items()] or ["none"]):
            typer.echo(line)
    acl = [h for h in st.acl if h.scope != "global" or h.allow or h.deny or h.default]
    for h in acl:
        typer.echo(f"acl {h.scope}: allow {h.allow}  deny {h.deny}  default {h.default}")
    if st.socket_lb is not None:
        for line in socket_lb_lines(st.socket_lb):
            typer.echo(line)


def socket_lb_lines(sl: SocketLbStatus) -> Iterator[str]:
    """sock_lb: its cgroup and hooks, each VIP's backends in its table, its counters."""
    yield f"socket_lb on {sl.cgroup}: {'attached' if sl.attached else 'NOT ATTACHED'}"
    for s in sl.services:
        name = f"{s.protocol.upper():<4} {_host(s.address)}:{s.port}"
        up = f"{s.backends_up}/{s.backends} backends up"
        none = "  NO BACKEND UP" if not s.backends_up else ""
        yield f"  {name:<28} {up}, table {_opt(s.table_size)}{none}"
    yield from _wrapped("socket_lb events:", [f"{k} {n}" for k, n in sl.events.items()])


def _wrapped(head: str, items: list[str], width: int = 100) -> Iterator[str]:
    """``head`` and ``items`` two spaces apart, lines within ``width`` columns (the
    continuations indented)."""
    line, sep = head, " "
    for item in items:
        if len(line) + len(sep) + len(item) > width and sep == "  ":
            yield line
            line, sep = "", "  "  # a continuation: indented by its separator
        line += sep + item
        sep = "  "
    yield line


def changed(what: str, r: ChangeResult) -> None:
    """The outcome of a change made through the API."""
    where = (
        "written to the configuration file"
        if r.persisted
        else "runtime only (--persist writes the file)"
    )
    typer.echo(f"{what}: {r.operations} map operations, {where}")


def drain_line(d: DrainStatus) -> str:
    udp = d.vip.endswith("/udp")
    if d.established is None:
        est = f"{'flows' if udp else 'established connections'} unknown (no agent report yet)"
    else:
        est = f"{d.established} {'connected UDP sockets' if udp else 'established'}"
    idle = f", no packet for {d.idle:.1f} s" if d.idle is not None else ""
    return f"backend {d.backend} of {d.vip}: {d.admin}, {est}{idle}"


def print_acl(view: AclView) -> None:
    h = view.hits
    typer.echo(f"{h.scope} ACL" + (" (allow list: other sources denied)" if view.allow else ""))
    for p in view.allow:
        typer.echo(f"  allow {p}")
    for p in view.deny:
        typer.echo(f"  deny  {p}")
    typer.echo(f"hits: allow {h.allow}  deny {h.deny}  default {h.default}")


def print_host_events(instance: str, events: Mapping[str, int]) -> None:
    t = Table(title=f"host_tc ({instance})")
    t.add_column("event")
    t.add_column("packets", justify="right")
    for name, n in events.items():
        t.add_row(name, str(n))
    console.print(t)


def _sessions_up(sessions: Mapping[str, str]) -> str:
    """``1/2``: established BGP sessions of all; ``-`` without any."""
    if not sessions:
        return "-"
    up = sum(state.endswith("Established") for state in sessions.values())
    return f"{up}/{len(sessions)}"


def print_cluster(cl: ClusterStatus) -> None:
    """``xdplb cluster status``: what the node announces (or why not), its BGP sessions
    and self-checks; the fleet's store, the revision each node serves, the tables that
    differ."""
    if cl.bgp is not None:
        bgp = cl.bgp
        node = f"node {bgp.router_id} (AS {bgp.asn})"
        if bgp.withdrawn_because:
            console.print(f"{node}: withdrawn: {bgp.withdrawn_because}", style="red")
        else:
            console.print(f"{node}: announcing {', '.join(bgp.announced) or 'nothing'}")
        console.print(f"self-checks: {bgp.self_checks}, {bgp.self_check_failures} failed")
        table = Table("peer", "session", box=None, pad_edge=False)
        for sess in bgp.sessions:
            table.add_row(sess.peer, sess.state, style="" if sess.established else "red")
        console.print(table)
    if cl.store is not None:
        st = cl.store
        where = f"store {st.store} as {st.node}"
        if st.connected:
            console.print(f"{where}: serving revision {_opt(st.revision)}")
        else:
            console.print(
                f"{where}: unreachable ({st.error}), serving revision {_opt(st.revision)}",
                style="red",
            )
        if st.refused_revision is not None:
            console.print(
                f"refused revision {st.refused_revision}: {st.refused_error}", style="red"
            )
        nodes = Table(
            "node",
            "revision",
            "refused",
            "age",
            "BGP up",
            "announces",
            "tables differ",
            box=None,
            pad_edge=False,
        )
        for n in st.nodes:
            nodes.add_row(
                n.node,
                _opt(n.revision),
                _opt(n.refused_revision),
                f"{n.age:.1f}s",
                _sessions_up(n.sessions),
                ", ".join(n.announced) or "-",
                ", ".join(n.tables_differ) or "-",
                style="red" if n.tables_differ else "",
            )
        console.print(nodes)
    if cl.sync is not None:
        _print_sync(cl.sync)


def _print_sync(sy: SyncStatus) -> None:
    """Session sync: synced or why not, each peer's subscription, what was refused."""
    where = f"session sync as {sy.node} on {sy.listen}"
    if sy.ready:
        console.print(f"{where}: synced; {sy.sent} entries sent")
    else:
        console.print(f"{where}: not synced: {sy.waiting_for}", style="red")
    peers = Table(
        "peer", "state", "copies", "failed", "last copy", "received", "imported",
        box=None, pad_edge=False,
    )  # fmt: skip
    for p in sy.peers:
        last = "-" if p.last_copy_entries is None else (
            f"{p.last_copy_entries} in {p.last_copy_ms:.0f} ms"
        )  # fmt: skip
        peers.add_row(
            p.node, p.state, str(p.copies), str(p.copy_failures), last, str(p.received),
            str(p.imported),
            style="" if p.state == "synced" else "red",
        )  # fmt: skip
    console.print(peers)
    for p in sy.peers:
        if p.error:
            console.print(f"{p.node} ({p.address}): {p.error}", style="red")
    console.print(f"followed by: {', '.join(sy.subscribers) or 'nobody'}")
    if sy.refused:
        refused = ", ".join(f"{r} {n}" for r, n in sorted(sy.refused.items()))
        console.print(f"refused messages: {refused}", style="red")
    if sy.imported.get("evicted"):
        console.print(
            f"imports that evicted a live session: {sy.imported['evicted']} "
            "(limits.conn_table is too small for the cluster's sessions)",
            style="red",
        )
    if sy.skipped:
        console.print(
            "entries not imported: " + ", ".join(f"{w} {n}" for w, n in sorted(sy.skipped.items()))
        )
