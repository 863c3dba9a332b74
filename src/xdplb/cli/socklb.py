"""``xdplb socklb``: socket-level service balancing for the processes of a cgroup.

``attach`` loads sock_lb and hooks it into a cgroup as pinned links (it stays after the
command exits); ``apply`` hands it the whole desired state from a YAML file
(:mod:`xdplb.sockets.sock_lb`, planned by :mod:`xdplb.sockets.socklb_plan`); ``status``
reads the pins; ``detach`` removes it all.
Exit codes: 0 done, 1 a kernel call failed, 2 a bad file or option, 3 not attached.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_RUNTIME, JsonOpt
from xdplb.cli.console import fail
from xdplb.core import paths
from xdplb.core.errors import ConfigError, XdplbError

if TYPE_CHECKING:
    from xdplb.sockets.sock_lb import SockLbConfig

socklb_app = typer.Typer(
    help="Socket-level service balancing (cgroup connect/sendmsg hooks, docs: sock_lb).",
    no_args_is_help=True,
)


def _instance(value: str) -> str:
    try:
        return paths.instance_name(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


InstanceOpt = Annotated[
    str,
    typer.Option("--instance", "-i", callback=_instance, help="pins under /sys/fs/bpf/xdplb/"),
]
ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="sock_lb YAML file")]
_PROTO_NAMES = {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp"}


def _config(path: Path) -> SockLbConfig:
    from xdplb.sockets.sock_lb import load

    try:
        return load(path)
    except ConfigError as e:
        fail("invalid", e)
        raise typer.Exit(EXIT_CONFIG) from None


@socklb_app.command("attach")
def attach(
    cgroup: Annotated[
        Path | None, typer.Option(help="cgroup v2 directory (default: the file's cgroup)")
    ] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="sock_lb YAML")] = None,
    instance: InstanceOpt = "socklb",
) -> None:
    """Hook sock_lb into a cgroup; with -c, apply the file's services too."""
    from xdplb.datapath.sock_lb import SockLb
    from xdplb.sockets import socklb_plan

    cfg = _config(config) if config is not None else None
    target = cgroup or (cfg.cgroup if cfg is not None else None)
    if target is None:
        fail("invalid", "--cgroup: which cgroup? (or a file with a cgroup field)")
        raise typer.Exit(EXIT_CONFIG)
    if not (target / "cgroup.procs").exists():
        fail("invalid", f"--cgroup: {target} is not a cgroup v2 directory")
        raise typer.Exit(EXIT_CONFIG)
    try:
        with SockLb(instance) as lb:
            lb.attach(target)
            if cfg is not None:
                socklb_plan.apply(lb, cfg.to_services())
    except XdplbError as e:
        fail("failed", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    typer.echo(f"sock_lb {instance} attached to {target}")


@socklb_app.command("apply")
def apply(config: ConfigOpt, instance: InstanceOpt = "socklb") -> None:
    """Make sock_lb hold exactly the file's services (tables swapped whole); UDP sockets
    connected to backends that went down are destroyed, in this command's network
    namespace."""
    from xdplb.datapath.sock_lb import SockLb, pin_dir
    from xdplb.sockets import socklb_plan

    cfg = _config(config)
    if not pin_dir(instance).exists():
        typer.echo(f"sock_lb {instance} is not attached", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    try:
        with SockLb(instance) as lb:
            result = socklb_plan.apply(lb, cfg.to_services())
    except ConfigError as e:
        fail("invalid", e)
        raise typer.Exit(EXIT_CONFIG) from None
    except XdplbError as e:
        fail("failed", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    typer.echo(
        f"{len(result.plan.services)} services, {len(result.plan.backends)} backends; "
        f"{len(result.destroyed)} connected UDP sockets of backends down destroyed"
    )


@socklb_app.command("status")
def status(instance: InstanceOpt = "socklb", as_json: JsonOpt = False) -> None:
    """Services, the buckets each backend owns, and the counters."""
    from xdplb.datapath.sock_lb import Endpoint, SockLb, pin_dir

    if not pin_dir(instance).exists():
        typer.echo(f"sock_lb {instance} is not attached", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    with SockLb(instance) as lb:
        services = lb.services()
        events = {e.name.lower(): n for e, n in lb.events().items()}
        attached = lb.attached()
    doc = {
        "attached": attached,
        "services": [
            {
                "address": str(s.address),
                "port": s.port,
                "protocol": _PROTO_NAMES.get(s.proto, str(s.proto)),
                "affinity_seconds": s.affinity_ns / 1e9,
                "table_size": s.table_size,
                "buckets": {str(ep): n for ep, n in sorted(s.buckets.items(), key=str)},
            }
            for s in services
        ],
        "events": events,
    }
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    typer.echo(f"attached: {'yes' if attached else 'no'}")
    for s in services:
        typer.echo(f"{Endpoint(s.address, s.port)}/{_PROTO_NAMES.get(s.proto, s.proto)}")
        for ep, n in sorted(s.buckets.items(), key=str):
            typer.echo(f"  {ep!s:<28} {n:>7} buckets")
    for name, n in events.items():
        typer.echo(f"{name:<16} {n}")


@socklb_app.command("detach")
def detach(instance: InstanceOpt = "socklb") -> None:
    """Detach every hook and remove the instance's pins (its maps with them)."""
    from xdplb.datapath.sock_lb import detach as do_detach

    if not do_detach(instance):
        typer.echo(f"sock_lb {instance} is not attached", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    typer.echo(f"sock_lb {instance} detached")
