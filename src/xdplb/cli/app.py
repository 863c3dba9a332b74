"""The ``xdplb`` command: the typer app and its commands. What they share on the way in
(exit codes, option types, argument parsing) is :mod:`xdplb.cli.args`, what they print
:mod:`xdplb.cli.render`.

The commands that change a running instance (``vip``, ``backend``, ``acl``) and
``status`` talk to the daemon's HTTP API (:mod:`xdplb.cli.client`), found in one order:
``--api http://host:port`` (or ``XDPLB_API``) with ``--token`` (or ``XDPLB_TOKEN``); else
the ``api`` section of the ``-c`` file; else the unix socket
``/run/xdplb/<instance>.api.sock``. ``status --offline`` reads the pinned maps instead.
Changes are runtime-only unless ``--persist`` writes them to the configuration file.
Help is plain text (no rich markup), and messages carrying data print through
:mod:`xdplb.cli.console`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from xdplb.cli import views
from xdplb.cli.args import (
    EXIT_CONFIG,
    EXIT_NOT_RUNNING,
    EXIT_RUNTIME,
    AclVipOpt,
    ApiOpt,
    BackendArg,
    ConfigOpt,
    HostInstanceOpt,
    InstanceOpt,
    JsonOpt,
    OptConfigOpt,
    PersistOpt,
    PrefixesArg,
    TokenOpt,
    VipArg,
    address_arg,
    backend_arg,
    daemon_of,
    instance_name,
    prefixes_arg,
    usage_error,
    vip_arg,
    vip_config,
)
from xdplb.cli.capture import capture as capture_command
from xdplb.cli.client import ApiError, Client, DrainTimeout, NotRunning, Unreachable
from xdplb.cli.console import console, fail
from xdplb.cli.host_sockets import register as register_host_sockets
from xdplb.cli.render import (
    changed,
    drain_line,
    print_acl,
    print_cluster,
    print_host_events,
    print_json,
    print_status,
    view,
    view_lines,
)
from xdplb.cli.serve import SERVE_CONTEXT, serve_command
from xdplb.cli.socklb import socklb_app
from xdplb.config import AclConfig, BackendConfig, EncapKind, HashFields, TableKindName, load_config
from xdplb.config import Protocol as L4Protocol
from xdplb.control.interface import VipRef
from xdplb.control.status import from_pins
from xdplb.core import abi, paths
from xdplb.core.errors import ConfigError, XdplbError
from xdplb.daemon.logs import LogFormat

EXAMPLES = """Examples:

\b
  xdplb validate -c /etc/xdplb/xdplb.yaml
  xdplb run -c /etc/xdplb/xdplb.yaml
  xdplb list -c /etc/xdplb/xdplb.yaml          (the daemon named by the file's api section)
  xdplb status -i lb1 --offline                (read the pinned maps, no daemon needed)
  xdplb backend drain 198.18.100.1:80/tcp 198.18.0.11 --wait -c /etc/xdplb/xdplb.yaml
  xdplb acl deny 203.0.113.0/24 -c /etc/xdplb/xdplb.yaml --persist
  xdplb stop -c /etc/xdplb/xdplb.yaml
"""

# Every Typer here has plain help (rich_markup_mode=None): brackets in help stay as
# written, and flags show no "<bool>".
app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None, epilog=EXAMPLES
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"xdplb {importlib.metadata.version('xdplb')}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """xdplb: an XDP layer-4 load balancer."""


@app.command()
def validate(config: ConfigOpt) -> None:
    """Check a configuration file; print the first error with its field."""
    try:
        cfg = load_config(config)
    except ConfigError as e:
        fail("invalid", f"{config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    n_be = len(cfg.backend_addresses())
    console.print(f"{config}: ok ({len(cfg.vips)} VIPs, {n_be} backends)")


@app.command()
def run(
    config: ConfigOpt,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    log_format: Annotated[
        LogFormat, typer.Option(help="text (level logger message key=value) or json lines")
    ] = LogFormat.TEXT,
) -> None:
    """Attach, apply the configuration and keep it applied (SIGHUP or a file change
    reloads). Exiting leaves the programs attached; 'xdplb stop' detaches them."""
    from xdplb.daemon import logs
    from xdplb.daemon.main import Daemon

    logs.setup(log_format, verbose=verbose)
    try:
        daemon = Daemon(config)
    except ConfigError as e:
        fail("invalid configuration", f"{config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    except XdplbError as e:
        fail("cannot start:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    try:
        daemon.run()
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None


@app.command()
def stop(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the daemon")] = 10.0,
) -> None:
    """Stop the daemon of an instance, detach its programs and remove its pins, and say
    what was detached and removed. Fails (exit 1) and changes nothing where the pins are
    not visible (bpffs not mounted, as inside 'ip netns exec'); fails naming whatever is
    left after stopping."""
    from xdplb.daemon.main import read_pid
    from xdplb.datapath.hc import destroy_health_tunnel
    from xdplb.datapath.lb import checked_pin_root, destroy

    name = instance_name(config, instance)
    pid = read_pid(name)
    try:
        root = checked_pin_root(name)
    except XdplbError as e:
        fail("cannot stop", f"instance {name}: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    if not root.exists():
        if pid is None:
            typer.echo(f"instance {name} is not running", err=True)
            raise typer.Exit(EXIT_NOT_RUNNING)
        fail("cannot stop", f"instance {name}: its daemon {pid} runs but {root} does not exist")
        raise typer.Exit(EXIT_RUNTIME)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while read_pid(name) is not None:
            if time.monotonic() > deadline:
                typer.echo(f"daemon {pid} did not exit within {timeout:g} s", err=True)
                raise typer.Exit(EXIT_RUNTIME)
            time.sleep(0.05)
    try:
        done = destroy(name)
        destroy_health_tunnel(name)  # the device and rules of this namespace
    except XdplbError as e:
        fail("stop failed", f"instance {name}: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    if done.left:
        fail("stop failed", f"instance {name}: still there: {', '.join(done.left)}")
        raise typer.Exit(EXIT_RUNTIME)
    links = ", ".join(f"{i} ({hook}, link {link})" for i, hook, link, _ in done.detached)
    console.print(
        f"instance {name} stopped: the balancer detached from {links or 'no interface'}; "
        f"{done.pins} pins removed "
        f"with {root}"
    )


@app.command()
def status(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    as_json: JsonOpt = False,
    offline: Annotated[
        bool,
        typer.Option(
            "--offline", help="read the pinned maps instead of asking the daemon (source: pins)"
        ),
    ] = False,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """VIPs, backends and counters of a running instance, from its daemon's API (health,
    drain state, weights, shares, established connections). With --offline, read from the
    pinned maps, no daemon needed (source: pins; what only the daemon knows is left
    out). --json prints the Status object of GET /api/v1/status either way."""
    if offline:
        name = instance_name(config, instance)
        try:
            st = from_pins(name)
        except FileNotFoundError as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(EXIT_NOT_RUNNING) from None
        except XdplbError as e:
            fail("cannot read the pins:", e)
            raise typer.Exit(EXIT_RUNTIME) from None
    else:
        hint = " ('xdplb status --offline' reads the pinned maps)"
        with _api(config, instance, api, token, hint=hint) as client:
            st = client.status()
    if as_json:
        sys.stdout.write(st.model_dump_json(indent=2) + "\n")
    else:
        print_status(st)


def _api_failed(e: ApiError) -> NoReturn:
    where = f" (field {e.field})" if e.field else ""
    typer.echo(f"error {e.status}: {e.error}{where}", err=True)
    raise typer.Exit(EXIT_CONFIG if 400 <= e.status < 500 else EXIT_RUNTIME)


@contextlib.contextmanager
def _api(
    config: Path | None,
    instance: str | None,
    api: str | None,
    token: str | None,
    *,
    hint: str = "",
) -> Iterator[Client]:
    """A client of the instance's daemon, found as :func:`~xdplb.cli.args.daemon_of`
    says; its failures become the documented exits (``hint`` follows a NotRunning)."""
    name, where = daemon_of(config, instance, api, token)
    try:
        with Client(name, where=where) as client:
            yield client
    except NotRunning as e:
        typer.echo(f"instance {name} is not running: {e}{hint}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except Unreachable as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    except ApiError as e:
        _api_failed(e)


@app.command()
def reload(
    force: Annotated[
        bool, typer.Option("--force", help="apply the file even if it drops API changes")
    ] = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Re-read the configuration file and apply it. Refused (exit 2, naming each change)
    if that would drop changes made through the API and not persisted, unless --force."""
    with _api(config, instance, api, token) as client:
        r = client.reload(force=force)
    typer.echo(f"reloaded: {r.operations} map operations")


vip_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="VIPs of a running instance (through its API).",
)
app.add_typer(vip_app, name="vip")


@vip_app.command("list")
def vip_list(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every VIP and its backends, like 'ipvsadm -L -n' ('xdplb list' has more views);
    --json: the API's VIP objects."""
    with _api(config, instance, api, token) as client:
        vips = client.vips()
    if as_json:
        print_json([v.model_dump(mode="json") for v in vips])
        return
    for line in view_lines(view(vips, None)):
        typer.echo(line)


views.register(app, _api)


@vip_app.command("add")
def vip_add(
    address: Annotated[str, typer.Argument(help="VIP address")],
    port: Annotated[int, typer.Argument(min=0, max=65535, help="0: every port")],
    protocol: Annotated[L4Protocol, typer.Argument()] = L4Protocol.TCP,
    encap: Annotated[EncapKind, typer.Option()] = EncapKind.GUE,
    table: Annotated[TableKindName, typer.Option()] = TableKindName.MAGLEV,
    hash_: Annotated[HashFields, typer.Option("--hash")] = HashFields.FIVE_TUPLE,
    table_size: Annotated[int | None, typer.Option(help="buckets (default: global)")] = None,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Add a VIP without backends ('xdplb backend add' gives it some)."""
    vip = vip_config(
        {
            "address": address_arg(address, "VIP"),
            "port": port,
            "protocol": protocol,
            "encap": encap,
            "table": table,
            "hash": hash_,
            "table_size": table_size,
        }
    )
    with _api(config, instance, api, token) as client:
        changed(f"added VIP {vip.name}", client.add_vip(vip, persist=persist))


@vip_app.command("del")
def vip_del(
    address: Annotated[str, typer.Argument(help="VIP address")],
    port: Annotated[int, typer.Argument(min=0, max=65535)],
    protocol: Annotated[L4Protocol, typer.Argument()] = L4Protocol.TCP,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Remove a VIP (its connections are cut: drain its backends first)."""
    ref = VipRef(address=address_arg(address, "VIP"), port=port, protocol=protocol)
    with _api(config, instance, api, token) as client:
        changed(f"removed VIP {ref.name}", client.delete_vip(ref, persist=persist))


backend_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Backends of a VIP of a running instance (through its API).",
)
app.add_typer(backend_app, name="backend")


@backend_app.command("add")
def backend_add(
    vip: VipArg,
    backend: BackendArg,
    weight: Annotated[int, typer.Option(min=0, max=65535)] = 1,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Add a backend to a VIP (or set its weight if the VIP has it)."""
    ref, addr = vip_arg(vip), backend_arg(backend)
    with _api(config, instance, api, token) as client:
        r = client.put_backend(ref, BackendConfig(address=addr, weight=weight), persist=persist)
        changed(f"backend {addr} of {ref.name}, weight {weight}", r)


@backend_app.command("del")
def backend_del(
    vip: VipArg,
    backend: BackendArg,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Remove a backend from a VIP at once ('backend drain' first keeps its connections)."""
    ref, addr = vip_arg(vip), backend_arg(backend)
    with _api(config, instance, api, token) as client:
        changed(
            f"removed backend {addr} of {ref.name}",
            client.delete_backend(ref, addr, persist=persist),
        )


@backend_app.command("weight")
def backend_weight(
    vip: VipArg,
    backend: BackendArg,
    weight: Annotated[int, typer.Argument(min=0, max=65535)],
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Set a backend's weight (0: out of the table, still configured)."""
    ref, addr = vip_arg(vip), backend_arg(backend)
    with _api(config, instance, api, token) as client:
        r = client.set_weight(ref, addr, weight, persist=persist)
        changed(f"backend {addr} of {ref.name}, weight {weight}", r)


@backend_app.command("drain")
def backend_drain(
    vip: VipArg,
    backend: BackendArg,
    wait: Annotated[bool, typer.Option(help="return once no connection is left")] = False,
    timeout: Annotated[float, typer.Option(min=0, help="seconds --wait waits")] = 60.0,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """No new connections to the backend for this VIP; established ones continue. With
    --wait, poll every 0.1 s until its agent reports none left (exit 0, printing how long
    it took) or --timeout passes (exit 1)."""
    ref, addr = vip_arg(vip), backend_arg(backend)
    with _api(config, instance, api, token) as client:
        start = time.monotonic()
        typer.echo(drain_line(client.drain(ref, addr)))
        if not wait:
            return
        try:
            client.wait_drained(ref, addr, timeout=max(0.0, timeout - (time.monotonic() - start)))
        except DrainTimeout as e:
            typer.echo(drain_line(e.last), err=True)
            if e.last.done is None:
                typer.echo(
                    f"no agent reports for backend {addr}: cannot tell whether its "
                    f"connections are gone (waited {timeout:g} s)",
                    err=True,
                )
            else:
                typer.echo(f"backend {addr} not drained after {timeout:g} s", err=True)
            raise typer.Exit(EXIT_RUNTIME) from None
        typer.echo(f"backend {addr} of {ref.name} drained in {time.monotonic() - start:.2f} s")


@backend_app.command("enable")
def backend_enable(
    vip: VipArg,
    backend: BackendArg,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Undo a drain: the backend takes new connections again."""
    ref, addr = vip_arg(vip), backend_arg(backend)
    with _api(config, instance, api, token) as client:
        typer.echo(drain_line(client.enable(ref, addr)))


acl_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Source ACLs of a running instance (through its API): global, or one VIP's "
    "with --vip. The longest matching prefix decides; with an allow list, a source no "
    "rule matches is denied.",
)
app.add_typer(acl_app, name="acl")


def _acl_change(
    vip: str | None,
    prefixes: list[str],
    action: str,
    persist: bool,
    config: Path | None,
    instance: str | None,
    api: str | None,
    token: str | None,
) -> None:
    """Read the scope's ACL, add (``allow``/``deny``: moving a prefix from the other
    list) or remove (``del``) prefixes, and put it back whole."""
    ref = vip_arg(vip) if vip is not None else None
    new = prefixes_arg(prefixes)
    with _api(config, instance, api, token) as client:
        view = client.acl(ref)
        allow, deny = list(view.allow), list(view.deny)
        for p in new:
            present = p in allow or p in deny
            allow, deny = [a for a in allow if a != p], [d for d in deny if d != p]
            if action == "allow":
                allow.append(p)
            elif action == "deny":
                deny.append(p)
            elif not present:
                raise usage_error(f"{p} is in no list of the {view.hits.scope} ACL")
        r = client.put_acl(
            AclConfig.model_validate({"allow": allow, "deny": deny}), ref, persist=persist
        )
        what = {"allow": "allowed", "deny": "denied", "del": "removed"}[action]
        changed(f"{view.hits.scope} ACL: {what} {' '.join(prefixes)}", r)


@acl_app.command("list")
def acl_list(
    vip: AclVipOpt = None,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The rules of the global ACL (or a VIP's) and how many packets each list matched."""
    ref = vip_arg(vip) if vip is not None else None
    with _api(config, instance, api, token) as client:
        view = client.acl(ref)
    if as_json:
        print_json(view.model_dump(mode="json"))
        return
    print_acl(view)


#: The commands that change an ACL, and their help.
ACL_CHANGES = {
    "allow": "Allow source prefixes (makes the scope an allow list: others are denied).",
    "deny": "Deny source prefixes: their packets to the VIPs are dropped in XDP.",
    "del": "Remove source prefixes from the scope's lists.",
}


def _acl_command(action: str) -> Callable[..., None]:
    def command(
        prefixes: PrefixesArg,
        vip: AclVipOpt = None,
        persist: PersistOpt = False,
        config: OptConfigOpt = None,
        instance: InstanceOpt = None,
        api: ApiOpt = None,
        token: TokenOpt = None,
    ) -> None:
        _acl_change(vip, prefixes, action, persist, config, instance, api, token)

    return command


for _action, _help in ACL_CHANGES.items():
    acl_app.command(_action, help=_help)(_acl_command(_action))


host_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="A server host: host_tc, bind checks, sk_lookup steering (docs/sockets.md).",
)
app.add_typer(host_app, name="host")
register_host_sockets(host_app)
app.add_typer(socklb_app, name="socklb")
app.command("serve", context_settings=SERVE_CONTEXT)(serve_command)


@host_app.command("attach")
def host_attach(
    dev: Annotated[str, typer.Option(help="interface the tunnels arrive on")],
    addr: Annotated[list[str], typer.Option(help="an address of this host that tunnels target")],
    gue_port: Annotated[int, typer.Option(min=1, max=65535)] = abi.GUE_PORT,
    instance: HostInstanceOpt = "host",
) -> None:
    """Load host_tc, attach it at TC ingress of DEV and configure it; it stays attached
    after the command exits (run again to change addresses or upgrade in place)."""
    import ipaddress

    from xdplb.datapath.host import HostDatapath

    try:
        addrs = [ipaddress.ip_address(a) for a in addr]
    except ValueError as e:
        fail("invalid", f"--addr: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        ifindex = socket.if_nametoindex(dev)
    except OSError:
        fail("invalid", f"--dev: no interface {dev!r}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        dp = HostDatapath(instance)
        try:
            dp.configure(addrs, gue_port)
            dp.attach(ifindex)
        finally:
            dp.close()
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    console.print(f"host_tc attached to {dev} for {', '.join(map(str, addrs))} (GUE {gue_port})")


@host_app.command("detach")
def host_detach(
    dev: Annotated[str, typer.Option(help="interface host_tc is attached to")],
    instance: HostInstanceOpt = "host",
) -> None:
    """Take host_tc off DEV and remove the instance's pins."""
    from xdplb.datapath.host import detach

    if not paths.pin_root(instance).exists():
        typer.echo(f"host instance {instance} is not attached", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING)
    try:
        detach(instance, socket.if_nametoindex(dev))
    except OSError:
        fail("invalid", f"--dev: no interface {dev!r}")
        raise typer.Exit(EXIT_CONFIG) from None
    except XdplbError as e:
        fail("failed:", e)
        raise typer.Exit(EXIT_RUNTIME) from None
    console.print(f"host_tc detached from {dev}")


@host_app.command("status")
def host_status(
    instance: HostInstanceOpt = "host",
    as_json: JsonOpt = False,
) -> None:
    """What host_tc did: decapsulations, second-hop forwards, drops."""
    from xdplb.datapath.host import events_from_pins

    try:
        events = {e.name.lower(): n for e, n in events_from_pins(instance).items()}
    except FileNotFoundError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    if as_json:
        print_json({"instance": instance, "events": events})
        return
    print_host_events(instance, events)


cluster_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="This node in its cluster of balancers (docs/cluster.md).",
)
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("status")
def cluster_status(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    as_json: JsonOpt = False,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """The VIPs this node announces over BGP (or why it announces none), its BGP sessions
    and its self-checks, from its daemon (GET /api/v1/cluster). Exit 2 without a bgp
    section."""
    with _api(config, instance, api, token) as client:
        cl = client.cluster()
    if as_json:
        sys.stdout.write(cl.model_dump_json(indent=2) + "\n")
    else:
        print_cluster(cl)


# `xdplb capture` lives in its own module (cli/capture.py).
app.command("capture")(capture_command)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
