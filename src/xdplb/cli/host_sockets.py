"""``xdplb host check-binds`` and ``xdplb host steer ...``: the socket tier of a host.

``check-binds`` reads the namespace's bound sockets (:mod:`xdplb.sockets.binds`) and
warns about the bind() mix that makes the kernel walk a long bucket under a spin lock;
``steer`` manages host_sk_lookup (:mod:`xdplb.datapath.sk_lookup`), which sends an
address prefix and some ports, or every port, to one socket. Both work on the network
namespace the command runs in.

Exit codes: the ones of :mod:`xdplb.cli.args`; ``check-binds`` exits 1 when it prints a
warning (and when the scan itself fails, with the error on stderr), 0 when clean.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

import typer

from xdplb.cli.args import (
    EXIT_NOT_RUNNING,
    EXIT_OK,
    EXIT_RUNTIME,
    HostInstanceOpt,
    JsonOpt,
    usage_error,
)
from xdplb.cli.console import console, fail
from xdplb.cli.render import print_json
from xdplb.core.errors import XdplbError

#: check-binds printed a warning.
EXIT_WARNING = 1

ProtoOpt = Annotated[str, typer.Option("--proto", help="tcp or udp")]
PrefixOpt = Annotated[
    str, typer.Option("--prefix", help="destination addresses steered, e.g. 198.51.100.0/24")
]
PortsOpt = Annotated[str, typer.Option("--ports", help="'all' (every port) or a list, e.g. 80,443")]


def register(host_app: typer.Typer) -> None:
    """Add ``check-binds`` and the ``steer`` group to the ``xdplb host`` app."""
    host_app.command("check-binds")(check_binds)
    steer_app = typer.Typer(
        no_args_is_help=True,
        rich_markup_mode=None,
        help="Steer an address prefix and ports to one socket (sk_lookup).",
    )
    steer_app.command("add")(steer_add)
    steer_app.command("list")(steer_list)
    steer_app.command("del")(steer_del)
    steer_app.command("detach")(steer_detach)
    host_app.add_typer(steer_app, name="steer")


def check_binds(
    as_json: JsonOpt = False,
    long_bucket: Annotated[
        int, typer.Option("--long-bucket", min=2, help="report a port bucket this long")
    ] = 1000,
) -> None:
    """Warn about binds of one port with and without SO_REUSEPORT (the kernel then walks
    the port's whole bucket under a spin lock on every bind), and about ports with very
    many sockets. Exit 1 when a warning is printed, 0 when clean."""
    from xdplb.sockets import binds

    try:
        sockets = binds.scan()
    except OSError as e:
        fail("failed:", f"sock_diag: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    findings = binds.check(sockets, long_bucket)
    bound = [s for s in sockets if s.is_bind]
    unknown = sorted({s.endpoint for s in bound if s.reuseport is None})
    warnings = [f for f in findings if f.warning]
    if as_json:
        print_json(
            {
                "bound_sockets": len(bound),
                "sockets": len(sockets),
                "undetermined": unknown,
                "findings": [
                    {
                        "kind": f.kind,
                        "warning": f.warning,
                        "proto": f.proto,
                        "port": f.port,
                        "message": f.message,
                        "with_reuseport": list(f.with_reuseport),
                        "without_reuseport": list(f.without_reuseport),
                        "undetermined": list(f.undetermined),
                        "sockets": f.sockets,
                    }
                    for f in findings
                ],
            }
        )
    else:
        for f in findings:
            if f.warning:
                fail("warning:", f.message)
            else:
                console.print(f"note: {f.message}")
        if unknown:
            console.print(
                f"SO_REUSEPORT undetermined (held by no process visible here): {', '.join(unknown)}"
            )
        if not warnings:
            console.print(f"no bind problems ({len(bound)} bound of {len(sockets)} sockets)")
    raise typer.Exit(EXIT_WARNING if warnings else EXIT_OK)


def _prefix(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ipaddress.ip_network(text)
    except ValueError as e:
        raise usage_error(f"invalid --prefix: {e}") from None


def _ports(text: str) -> list[int]:
    """``all`` -> [] (every port); ``80,443`` -> [80, 443]."""
    if text.strip() == "all":
        return []
    try:
        ports = [int(p) for p in text.split(",")]
    except ValueError:
        raise usage_error(f"invalid --ports {text!r}: 'all' or numbers, e.g. 80,443") from None
    if not all(0 < p < 65536 for p in ports):
        raise usage_error(f"invalid --ports {text!r}: ports are 1 to 65535")
    return ports


def _proto(text: str) -> str:
    if text not in ("tcp", "udp"):
        raise usage_error(f"invalid --proto {text!r}: tcp or udp")
    return text


def steer_add(
    prefix: PrefixOpt,
    to: Annotated[
        str, typer.Option("--to", help="where the target socket is bound, e.g. 127.0.0.1:8080")
    ],
    ports: PortsOpt = "all",
    proto: ProtoOpt = "tcp",
    instance: HostInstanceOpt = "host",
) -> None:
    """Steer PROTO traffic to PREFIX on PORTS to the socket bound at TO (a TCP listener,
    an unconnected UDP socket), attaching host_sk_lookup to this network namespace if
    it is not yet. The prefix must be delivered locally (e.g. `ip route add local
    198.51.100.0/24 dev lo`)."""
    from xdplb.datapath import sk_lookup
    from xdplb.sockets import binds

    net, port_list, proto = _prefix(prefix), _ports(ports), _proto(proto)
    try:
        address, port, to_proto = binds.parse_endpoint(to, proto)
    except ValueError as e:
        raise usage_error(f"invalid --to: {e}") from None
    if to_proto != proto:
        raise usage_error(f"--to {to} is {to_proto}, --proto is {proto}")
    target = sk_lookup.Endpoint(address, port, proto)
    try:
        with binds.find_socket(address, port, proto) as sock, sk_lookup.SkLookup(instance) as sl:
            rules = sl.add(proto, net, port_list, sock, target)
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    which = "every port" if not port_list else "ports " + ",".join(map(str, port_list))
    console.print(f"steering {proto} to {net} ({which}) to {target} ({len(rules)} rules)")


def steer_list(instance: HostInstanceOpt = "host", as_json: JsonOpt = False) -> None:
    """The steering rules and what the program did (exit 3 when nothing is attached)."""
    from xdplb.datapath import sk_lookup

    if not sk_lookup.attached(instance):
        typer.echo(f"no sk_lookup steering is attached for instance {instance}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    try:
        with sk_lookup.SkLookup(instance) as sl:
            rules, events = sl.rules(), sl.events()
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    if as_json:
        print_json(
            {
                "instance": instance,
                "rules": [
                    {
                        "proto": r.proto,
                        "prefix": str(r.prefix),
                        "port": r.port or "all",
                        "to": str(r.target),
                    }
                    for r in rules
                ],
                "events": {e.name.lower(): n for e, n in events.items()},
            }
        )
        return
    for r in rules:
        console.print(f"{r.proto} {r.prefix} port {r.port or 'all'} -> {r.target}")
    if not rules:
        console.print("no rules")
    console.print(", ".join(f"{e.name.lower()} {n}" for e, n in events.items()))


def steer_del(
    prefix: PrefixOpt,
    ports: PortsOpt = "all",
    proto: ProtoOpt = "tcp",
    instance: HostInstanceOpt = "host",
) -> None:
    """Remove the rules of PREFIX on PORTS (`all`: the every-port rule) for PROTO; exit 2
    when there were none."""
    from xdplb.datapath import sk_lookup

    net, port_list, proto = _prefix(prefix), _ports(ports), _proto(proto)
    if not sk_lookup.attached(instance):
        typer.echo(f"no sk_lookup steering is attached for instance {instance}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    try:
        with sk_lookup.SkLookup(instance) as sl:
            gone = sl.delete(proto, net, port_list)
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    if not gone:
        raise usage_error(f"no {proto} rule for {net} on ports {ports}")
    console.print(f"removed {gone} rules")


def steer_detach(instance: HostInstanceOpt = "host") -> None:
    """Detach host_sk_lookup from its namespace and remove its pins (exit 3 when nothing
    was attached)."""
    from xdplb.datapath import sk_lookup

    try:
        done = sk_lookup.detach(instance)
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    if not done:
        typer.echo(f"no sk_lookup steering is attached for instance {instance}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    console.print(f"sk_lookup steering of instance {instance} detached")
