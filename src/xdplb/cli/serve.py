"""``xdplb serve``: run an unmodified server under the supervisor of
:mod:`xdplb.sockets.serve`, or reload or show a running one.

::

    xdplb serve --name web --tcp 0.0.0.0:80 --udp 0.0.0.0:443 -- /usr/bin/server --flag
    xdplb serve --name web --reload        (a new generation; waits until it is ready)
    xdplb serve --name web --status

Registered in :mod:`xdplb.cli.app` as
``app.command("serve", context_settings=SERVE_CONTEXT)(serve_command)``: everything
after the first argument that is not an option belongs to the server (``--`` makes that
explicit). ``python -m xdplb.cli.serve`` runs the same command alone.

Exit codes: 0 stopped by SIGTERM/SIGINT or reload done, 1 runtime failure (a child that
keeps dying, BPF refused, a reload that failed), 2 usage, 3 no supervisor of that name.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Annotated, Any

import typer

from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_RUNTIME
from xdplb.cli.console import console, fail
from xdplb.core import paths
from xdplb.core.errors import XdplbError
from xdplb.sockets.serve import (
    NotServing,
    ServeConfig,
    ServeError,
    parse_endpoint,
    read_status,
    reload,
    serve,
)

#: The server's own options after its name are not the supervisor's.
SERVE_CONTEXT: dict[str, Any] = {"allow_interspersed_args": False}


def _fail(label: str, message: object, code: int) -> typer.Exit:
    fail(label, message)
    return typer.Exit(code)


def serve_command(
    name: Annotated[str, typer.Option("--name", "-n", help="service name (pins, run files)")],
    command: Annotated[
        list[str] | None, typer.Argument(help="the server and its arguments (after --)")
    ] = None,
    tcp: Annotated[
        str | None, typer.Option("--tcp", metavar="HOST:PORT", help="TCP listener")
    ] = None,
    udp: Annotated[
        str | None, typer.Option("--udp", metavar="HOST:PORT", help="UDP address")
    ] = None,
    udp_sockets: Annotated[
        int, typer.Option("--udp-sockets", min=1, help="UDP sockets per generation")
    ] = 4,
    ready_timeout: Annotated[
        float, typer.Option("--ready-timeout", help="seconds to wait for READY=1")
    ] = 10.0,
    drain: Annotated[
        float, typer.Option("--drain", help="seconds the old generation keeps its UDP flows")
    ] = 5.0,
    stop_timeout: Annotated[
        float, typer.Option("--stop-timeout", help="seconds after SIGTERM before SIGKILL")
    ] = 30.0,
    no_bpf: Annotated[
        bool,
        typer.Option("--no-bpf", help="pass the same sockets to every generation (no BPF)"),
    ] = False,
    do_reload: Annotated[
        bool, typer.Option("--reload", help="start a new generation of the running NAME")
    ] = False,
    status: Annotated[
        bool, typer.Option("--status", help="print the generations of the running NAME")
    ] = False,
    timeout: Annotated[
        float, typer.Option("--timeout", help="--reload: seconds to wait for it")
    ] = 60.0,
) -> None:
    """Own a service's sockets and run generations of a server on them; SIGHUP or
    --reload replaces the server without losing a datagram or a connection."""
    try:
        if do_reload:
            number = reload(name, timeout=timeout)
            console.print(f"{name}: generation {number} ready")
            return
        if status:
            console.print(json.dumps(read_status(name), indent=1))
            return
        if not command:
            raise _fail("usage", "no server command: xdplb serve ... -- COMMAND ARGS", EXIT_CONFIG)
        try:
            cfg = ServeConfig(
                name=name,
                command=tuple(command),
                tcp=parse_endpoint("tcp", tcp) if tcp else None,
                udp=parse_endpoint("udp", udp) if udp else None,
                udp_sockets=udp_sockets,
                ready_timeout=ready_timeout,
                drain=drain,
                stop_timeout=stop_timeout,
                bpf=not no_bpf,
            )
        except ValueError as e:
            raise _fail("usage", e, EXIT_CONFIG) from None
        logging.basicConfig(
            level=logging.INFO,
            format=f"%(asctime)s xdplb serve[{name}] %(message)s",
            stream=sys.stderr,
        )
        code = serve(cfg)
    except paths.BadName as e:
        raise _fail("usage", e, EXIT_CONFIG) from None
    except NotServing as e:
        raise _fail("not running", e, EXIT_NOT_RUNNING) from None
    except ServeError as e:
        raise _fail("failed", e, EXIT_RUNTIME) from None
    except XdplbError as e:  # BPF refused, a bad name
        raise _fail("failed", e, EXIT_RUNTIME) from None
    raise typer.Exit(code)


def main() -> None:
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command("serve", context_settings=SERVE_CONTEXT)(serve_command)
    app(prog_name="xdplb serve")


if __name__ == "__main__":
    main()
