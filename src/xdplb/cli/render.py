"""What the ``xdplb`` commands print: a :class:`~xdplb.control.status.Status` (one renderer
whether the daemon answered or the pins were read), VIP lists, drains, ACLs, the outcome
of a change, host_tc's counters; and the consoles they print on.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping

import typer
from rich.table import Table

from xdplb.cli.console import console
from xdplb.control.interface import AclView, ChangeResult, DrainStatus
from xdplb.control.status import MapStatus, Status, VipStatus


def print_json(doc: object) -> None:
    """``--json``: ``doc`` (JSON types) indented, on stdout."""
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def vip_lines(vips: list[VipStatus], counters: bool) -> Iterator[str]:
    """``ipvsadm -L -n``-like: a line per VIP, an indented line per backend."""
    yield "Prot LocalAddress:Port Table"
    yield "  -> RemoteAddress:Port  Forward  Weight  Effective  Health  Admin  ActiveConn  Share"
    for v in vips:
        line = f"{v.protocol.upper():<4} {_host(v.address)}:{v.port} {v.table}"
        if counters:
            line += f"  {v.hash}  packets {v.packets}  bytes {v.bytes}  new {v.new_flows}"
        if v.all_down:
            line += "  ALL BACKENDS DOWN (last table kept)"
        yield line
        ends = [f"{_host(b.address)}:{v.port}" for b in v.backends]
        width = max(map(len, ends), default=0)
        for b, end in zip(v.backends, ends, strict=True):
            line = (
                f"  -> {end:<{width}}  Tunnel({v.encap})  weight {_opt(b.weight)}  "
                f"eff {_opt(b.effective_weight)}  {b.health}  {b.admin}  "
                f"ActiveConn {_opt(b.established)}  share {b.table_share:.1%}"
            )
            if counters:
                line += f"  packets {b.packets}  bytes {b.bytes}  new {b.new_flows}"
                if b.health_detail:
                    line += f"  ({b.health_detail})"
            yield line


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
    head += f", attached to {', '.join(st.attached) or 'nothing'}"
    if st.uptime is not None:
        mins, secs = divmod(int(st.uptime), 60)
        head += f", up {mins}m{secs:02d}s"
    if st.source == "pins":
        head += "; no daemon answers: read from the pins"
    if st.runtime_changes:
        head += "; RUNTIME CHANGES NOT PERSISTED"
    typer.echo(head)
    line = f"connection table {st.conn_table.used} of {st.conn_table.capacity} entries"
    if st.rebuilds is not None:
        last = "" if st.last_rebuild_ms is None else f" (last {st.last_rebuild_ms:.1f} ms)"
        line += f"; {st.rebuilds} rebuilds{last}"
    if st.health_checks is not None:
        line += f"; {st.health_checks} health checks"
    typer.echo(line)
    for line in vip_lines(st.vips, counters=True):
        typer.echo(line)
    for line in map_lines(st.maps):
        typer.echo(line)
    typer.echo("events: " + ("  ".join(f"{k} {n}" for k, n in st.events.items()) or "none"))
    typer.echo("drops: " + ("  ".join(f"{k} {n}" for k, n in st.drops.items()) or "none"))
    acl = [h for h in st.acl if h.scope != "global" or h.allow or h.deny or h.default]
    for h in acl:
        typer.echo(f"acl {h.scope}: allow {h.allow}  deny {h.deny}  default {h.default}")


def changed(what: str, r: ChangeResult) -> None:
    """The outcome of a change made through the API."""
    where = (
        "written to the configuration file"
        if r.persisted
        else "runtime only (--persist writes the file)"
    )
    typer.echo(f"{what}: {r.operations} map operations, {where}")


def drain_line(d: DrainStatus) -> str:
    if d.established is None:
        est = "established connections unknown (no agent report yet)"
    else:
        est = f"{d.established} established"
    return f"backend {d.backend} of {d.vip}: {d.admin}, {est}"


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
