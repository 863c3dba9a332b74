"""``xdplb list``: the ipvsadm-style views of an instance, and the session-table listing.

This module owns what ``xdplb list`` shows: one line per VIP and one indented line per
backend with ``ipvsadm -L -n``'s columns (Forward, Weight, ActiveConn, InActConn),
``--stats`` (Conns, InPkts, InBytes from lb_xdp's counters), ``--rate`` (CPS, InPPS,
InBPS from two reads ``--interval`` apart), and ``--connections`` (``ipvsadm -L -n -c``:
one line per ``lb_conns`` entry, filtered, read a page at a time so neither the daemon
nor the CLI holds the table). ``--json`` gives each view as JSON (the connections as
NDJSON, one object per line, as they are read). The numbers come from the daemon's API,
or with ``--offline`` from the pins (the same models). ActiveConn/InActConn are the
agents' counts; where no agent reports, the session table's entries (``conns_source``
says which; the table cannot tell an active entry from an inactive one).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter

from xdplb.cli.args import (
    EXIT_CONFIG,
    EXIT_NOT_RUNNING,
    EXIT_RUNTIME,
    ApiOpt,
    InstanceOpt,
    JsonOpt,
    OptConfigOpt,
    TokenOpt,
    instance_name,
)
from xdplb.cli.client import Client
from xdplb.cli.render import connection_lines, print_json, rates, view, view_lines
from xdplb.control.sessions import (
    Connection,
    ConnectionPage,
    ConnectionQuery,
    SessionCount,
    parse_query,
)
from xdplb.control.status import Status
from xdplb.core.errors import ConfigError, XdplbError

#: Entries one request of ``--connections`` asks for.
PAGE = 1000

ApiContext = Callable[
    [Path | None, str | None, str | None, str | None], contextlib.AbstractContextManager[Client]
]


def _pages(read: Callable[[int, int], ConnectionPage], limit: int | None) -> Iterator[Connection]:
    """Every matching entry, a page at a time, at most ``limit``."""
    cursor: int | None = 0
    left = limit
    while cursor is not None and (left is None or left > 0):
        page = read(cursor, PAGE if left is None else min(PAGE, left))
        yield from page.connections
        if left is not None:
            left -= len(page.connections)
        cursor = page.next


def _daemon_page(client: Client, q: dict[str, str]) -> Callable[[int, int], ConnectionPage]:
    def read(cursor: int, limit: int) -> ConnectionPage:
        params = q | {"cursor": str(cursor), "limit": str(limit)}
        resp = client.request("GET", "/api/v1/connections", params=params)
        return ConnectionPage.model_validate_json(resp.content)

    return read


# -- the command -------------------------------------------------------------------------


def register(app: typer.Typer, api_context: ApiContext) -> None:
    """Add ``list`` to ``app``; ``api_context`` opens the daemon's client as the other
    commands do (their exits on failure)."""

    @app.command("list")
    def list_command(
        numeric: Annotated[
            bool, typer.Option("-n", "--numeric", help="accepted as ipvsadm's; never resolved")
        ] = False,
        stats: Annotated[bool, typer.Option("--stats", help="Conns, InPkts, InBytes")] = False,
        rate: Annotated[bool, typer.Option("--rate", help="CPS, InPPS, InBPS")] = False,
        interval: Annotated[
            float, typer.Option(min=0.05, help="seconds between --rate's two reads")
        ] = 1.0,
        connections: Annotated[
            bool,
            typer.Option("--connections", help="the session table, an entry a line"),
        ] = False,
        vip: Annotated[str | None, typer.Option(help="--connections of ADDR:PORT/PROTO")] = None,
        backend: Annotated[str | None, typer.Option(help="--connections to a backend")] = None,
        client: Annotated[str | None, typer.Option(help="--connections from a prefix")] = None,
        limit: Annotated[int | None, typer.Option(min=1, help="--connections: at most")] = None,
        offline: Annotated[
            bool, typer.Option("--offline", help="read the pins, not the daemon's API")
        ] = False,
        as_json: JsonOpt = False,
        config: OptConfigOpt = None,
        instance: InstanceOpt = None,
        api: ApiOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """VIPs and backends like 'ipvsadm -L -n' (ActiveConn/InActConn from the agents,
        else the session table), with --stats or --rate; --connections lists the
        session table like 'ipvsadm -L -n -c' (filters --vip, --backend, --client,
        --limit; --json: NDJSON). -c is --config, as in every xdplb command."""
        if stats and rate:
            typer.echo("--stats and --rate: choose one", err=True)
            raise typer.Exit(EXIT_CONFIG)
        filters = {"vip": vip, "backend": backend, "client": client}
        if not connections and any(filters.values()):
            given = next(k for k, v in filters.items() if v)
            typer.echo(f"--{given} filters --connections only", err=True)
            raise typer.Exit(EXIT_CONFIG)
        try:
            query = parse_query(vip, backend, client)
        except ConfigError as e:
            typer.echo(f"invalid --{e.field}: {e.message}", err=True)
            raise typer.Exit(EXIT_CONFIG) from None
        with _source(offline, config, instance, api, token, api_context) as src:
            if connections:
                q = {k: v for k, v in filters.items() if v}
                read = src.pages(query, q)
                if as_json:
                    for c in _pages(read, limit):
                        sys.stdout.write(c.model_dump_json() + "\n")
                else:
                    for line in connection_lines(_pages(read, limit)):
                        typer.echo(line)
                return
            st = src.status()
            table = None
            if any(b.established is None for v in st.vips for b in v.backends):
                table = {(c.vip, c.backend): c.entries for c in src.counts()}
            per_second = None
            if rate:
                time.sleep(interval)  # the interval the rates are taken over
                per_second = rates(st, src.status(), interval)
            doc = view(st.vips, table, stats=stats, rate=per_second)
        if as_json:
            print_json(doc)
            return
        for line in view_lines(doc, stats=stats, rate=rate):
            typer.echo(line)


class _Source:
    """Where a view reads from: the daemon's API, or the pins."""

    def __init__(self, client: Client | None, instance: str) -> None:
        self.client = client
        self.instance = instance

    def status(self) -> Status:
        if self.client is not None:
            return self.client.status()
        from xdplb.control.status import from_pins

        return from_pins(self.instance)

    def counts(self) -> list[SessionCount]:
        if self.client is not None:
            resp = self.client.request("GET", "/api/v1/connections/counts")
            return TypeAdapter(list[SessionCount]).validate_json(resp.content)
        from xdplb.control import sessions
        from xdplb.datapath.layout import pins_dir
        from xdplb.datapath.lb import LbMaps

        with LbMaps.from_pins(pins_dir(self.instance)) as maps:
            return sessions.counts(maps.conns, maps.snapshot())

    def pages(
        self, query: ConnectionQuery, q: dict[str, str]
    ) -> Callable[[int, int], ConnectionPage]:
        if self.client is not None:
            return _daemon_page(self.client, q)
        from xdplb.control import sessions
        from xdplb.datapath.layout import pins_dir
        from xdplb.datapath.lb import LbMaps

        def read(cursor: int, limit: int) -> ConnectionPage:
            # Opened per page: a long listing holds no map between pages.
            with LbMaps.from_pins(pins_dir(self.instance)) as maps:
                return sessions.page(maps.conns, maps.snapshot(), query, cursor=cursor, limit=limit)

        return read


@contextlib.contextmanager
def _source(
    offline: bool,
    config: Path | None,
    instance: str | None,
    api: str | None,
    token: str | None,
    api_context: ApiContext,
) -> Iterator[_Source]:
    if not offline:
        with api_context(config, instance, api, token) as client:
            yield _Source(client, instance or "default")
        return
    name = instance_name(config, instance)
    try:
        yield _Source(None, name)
    except FileNotFoundError as e:
        typer.echo(f"instance {name}: {e}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except XdplbError as e:  # pins of another layout (datapath.layout.LayoutMismatch)
        typer.echo(f"cannot read the pins: {e}", err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
