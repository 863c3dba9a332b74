"""The ``xdplb`` command.

Exit codes (documented in the README):
  0  success
  1  runtime failure (kernel or BPF error, daemon did not stop in time, the API answered
     5xx or could not be reached, a drain did not finish within --timeout)
  2  invalid configuration or usage (also: the API refused the request, 4xx)
  3  the instance is not running / has nothing pinned

The commands that change a running instance (``vip``, ``backend``) and ``status`` talk to
the daemon's HTTP API (:mod:`xdplb.cli.client`): its unix socket
``/run/xdplb/<instance>.api.sock`` by default, or ``--api http://host:port`` with
``--token`` (or ``XDPLB_API``, ``XDPLB_TOKEN``). Changes are runtime-only unless
``--persist`` writes them to the configuration file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from xdplb.cli.client import (
    ApiError,
    Client,
    DrainTimeout,
    NotRunning,
    Unreachable,
    parse_backend,
    parse_vip,
)
from xdplb.config import (
    AclConfig,
    BackendConfig,
    EncapKind,
    HashFields,
    TableKindName,
    VipConfig,
    load_config,
    parse_config,
)
from xdplb.config import Protocol as L4Protocol
from xdplb.control.interface import ChangeResult, DrainStatus, VipRef
from xdplb.control.status import MapStatus, Status, VipStatus, from_pins
from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError, XdplbError

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG, EXIT_NOT_RUNNING = 0, 1, 2, 3

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="xdplb: an XDP layer-4 load balancer."
)
console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML configuration file")]
InstanceOpt = Annotated[
    str | None, typer.Option("--instance", "-i", help="instance name (default: from -c)")
]
OptConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML file (for the instance name)")
]
ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api",
        envvar="XDPLB_API",
        help="the daemon's API URL, e.g. http://198.18.0.2:9100 "
        "(default: the unix socket /run/xdplb/<instance>.api.sock)",
    ),
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="XDPLB_TOKEN", help="bearer token of the API")
]
PersistOpt = Annotated[
    bool, typer.Option("--persist", help="also write the change to the configuration file")
]


def _instance(config: Path | None, instance: str | None) -> str:
    if instance:
        return instance
    if config is not None:
        try:
            return load_config(config).instance
        except ConfigError as e:
            err.print(f"[red]invalid configuration[/red] {config}: {e}")
            raise typer.Exit(EXIT_CONFIG) from None
    return "default"


@app.command()
def validate(config: ConfigOpt) -> None:
    """Check a configuration file; print the first error with its field."""
    try:
        cfg = load_config(config)
    except ConfigError as e:
        err.print(f"[red]invalid[/red] {config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    n_be = len(cfg.backend_addresses())
    console.print(f"{config}: ok ({len(cfg.vips)} VIPs, {n_be} backends)")


@app.command()
def run(
    config: ConfigOpt,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Attach, apply the configuration and keep it applied (SIGHUP or a file change
    reloads). Exiting leaves the programs attached; `xdplb stop` detaches them."""
    from xdplb.daemon.main import Daemon

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        daemon = Daemon(config)
    except ConfigError as e:
        err.print(f"[red]invalid configuration[/red] {config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    except XdplbError as e:
        err.print(f"[red]cannot start[/red]: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    try:
        daemon.run()
    except XdplbError as e:
        err.print(f"[red]failed[/red]: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None


@app.command()
def stop(
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    instance: InstanceOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the daemon")] = 10.0,
) -> None:
    """Stop the daemon of an instance, detach its programs and remove its pins."""
    from xdplb.daemon.main import read_pid
    from xdplb.datapath.hc import destroy_health_tunnel
    from xdplb.datapath.lb import destroy

    name = _instance(config, instance)
    pid = read_pid(name)
    if pid is None and not paths.pin_root(name).exists():
        err.print(f"instance {name} is not running")
        raise typer.Exit(EXIT_NOT_RUNNING)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while read_pid(name) is not None:
            if time.monotonic() > deadline:
                err.print(f"daemon {pid} did not exit within {timeout:g} s")
                raise typer.Exit(EXIT_RUNTIME)
            time.sleep(0.05)
    destroy_health_tunnel(name)  # the device and rules of this namespace, the pins
    destroy(name)
    console.print(f"instance {name} stopped and detached")


@app.command()
def status(
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    instance: InstanceOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """VIPs, backends and counters of a running instance: from the daemon's API (health,
    drain state, weights, shares, established connections), or read from the pins when
    the daemon does not answer (``source: pins``: what only the daemon knows is left
    out). --json prints the Status object of ``GET /api/v1/status`` either way."""
    name = _instance(config, instance)
    try:
        with Client(name, api=api, token=token) as client:
            st = client.status()
    except (NotRunning, Unreachable):
        try:
            st = from_pins(name)
        except FileNotFoundError as e:
            err.print(str(e))
            raise typer.Exit(EXIT_NOT_RUNNING) from None
    except ApiError as e:
        _api_failed(e)
    if as_json:
        sys.stdout.write(st.model_dump_json(indent=2) + "\n")
    else:
        _print_status(st)


def _api_failed(e: ApiError) -> NoReturn:
    where = f" (field {e.field})" if e.field else ""
    typer.echo(f"error {e.status}: {e.error}{where}", err=True)
    raise typer.Exit(EXIT_CONFIG if 400 <= e.status < 500 else EXIT_RUNTIME)


@contextlib.contextmanager
def _api(
    config: Path | None, instance: str | None, api: str | None, token: str | None
) -> Iterator[Client]:
    """A client of the instance's daemon; its failures become the documented exits."""
    name = _instance(config, instance) if api is None else (instance or "default")
    try:
        with Client(name, api=api, token=token) as client:
            yield client
    except NotRunning as e:
        typer.echo(f"instance {name} is not running: {e}", err=True)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    except Unreachable as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(EXIT_RUNTIME) from None
    except ApiError as e:
        _api_failed(e)


def _vip_config(data: dict[str, Any]) -> VipConfig:
    """A VIP validated by the configuration's own rules, before any request is sent."""
    try:
        return parse_config({"vips": [data]}).vips[0]
    except ConfigError as e:
        where = f" (field {e.field.removeprefix('vips[0]').lstrip('.')})" if e.field else ""
        typer.echo(f"invalid VIP: {e.message}{where}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _vip_arg(text: str) -> VipRef:
    try:
        return parse_vip(text)
    except ValueError as e:
        typer.echo(f"invalid VIP: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _address_arg(text: str, what: str) -> IPAddress:
    try:
        return parse_backend(text)
    except ValueError as e:
        typer.echo(f"invalid {what}: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None


def _backend_arg(text: str) -> IPAddress:
    return _address_arg(text, "backend")


def _changed(what: str, r: ChangeResult) -> None:
    where = (
        "written to the configuration file"
        if r.persisted
        else "runtime only (--persist writes the file)"
    )
    typer.echo(f"{what}: {r.operations} map operations, {where}")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _vip_lines(vips: list[VipStatus], counters: bool) -> Iterator[str]:
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


def _map_lines(maps: list[MapStatus]) -> Iterator[str]:
    """One line per sized map: entries of max, the fill, the field that sizes it."""
    if maps:
        yield "maps (entries of max, fill, sized by):"
    for m in maps:
        fill = m.entries / m.max_entries if m.max_entries else 0.0
        approx = "~" if m.estimated else ""
        yield (f"  {m.name:<13} {approx}{m.entries} of {m.max_entries}  {fill:.1%}  {m.config_key}")


def _print_status(st: Status) -> None:
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
    for line in _vip_lines(st.vips, counters=True):
        typer.echo(line)
    for line in _map_lines(st.maps):
        typer.echo(line)
    typer.echo("events: " + ("  ".join(f"{k} {n}" for k, n in st.events.items()) or "none"))
    typer.echo("drops: " + ("  ".join(f"{k} {n}" for k, n in st.drops.items()) or "none"))
    acl = [h for h in st.acl if h.scope != "global" or h.allow or h.deny or h.default]
    for h in acl:
        typer.echo(f"acl {h.scope}: allow {h.allow}  deny {h.deny}  default {h.default}")


vip_app = typer.Typer(no_args_is_help=True, help="VIPs of a running instance (through its API).")
app.add_typer(vip_app, name="vip")


@vip_app.command("list")
def vip_list(
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Every VIP and its backends, like ``ipvsadm -L -n``."""
    with _api(config, instance, api, token) as client:
        vips = client.vips()
    if as_json:
        sys.stdout.write(json.dumps([v.model_dump(mode="json") for v in vips], indent=2) + "\n")
        return
    for line in _vip_lines(vips, counters=False):
        typer.echo(line)


app.command("list", help="Same as `xdplb vip list`.")(vip_list)


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
    """Add a VIP without backends (``xdplb backend add`` gives it some)."""
    vip = _vip_config(
        {
            "address": _address_arg(address, "VIP"),
            "port": port,
            "protocol": protocol,
            "encap": encap,
            "table": table,
            "hash": hash_,
            "table_size": table_size,
        }
    )
    with _api(config, instance, api, token) as client:
        _changed(f"added VIP {vip.name}", client.add_vip(vip, persist=persist))


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
    ref = VipRef(address=_address_arg(address, "VIP"), port=port, protocol=protocol)
    with _api(config, instance, api, token) as client:
        _changed(f"removed VIP {ref.name}", client.delete_vip(ref, persist=persist))


backend_app = typer.Typer(
    no_args_is_help=True, help="Backends of a VIP of a running instance (through its API)."
)
app.add_typer(backend_app, name="backend")
VipArg = Annotated[
    str, typer.Argument(help="ADDRESS:PORT/PROTOCOL (tcp when left out), e.g. 198.18.100.1:80/tcp")
]
BackendArg = Annotated[str, typer.Argument(help="backend address")]


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
    ref, addr = _vip_arg(vip), _backend_arg(backend)
    with _api(config, instance, api, token) as client:
        r = client.put_backend(ref, BackendConfig(address=addr, weight=weight), persist=persist)
        _changed(f"backend {addr} of {ref.name}, weight {weight}", r)


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
    """Remove a backend from a VIP at once (``backend drain`` first keeps its connections)."""
    ref, addr = _vip_arg(vip), _backend_arg(backend)
    with _api(config, instance, api, token) as client:
        _changed(
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
    ref, addr = _vip_arg(vip), _backend_arg(backend)
    with _api(config, instance, api, token) as client:
        r = client.set_weight(ref, addr, weight, persist=persist)
        _changed(f"backend {addr} of {ref.name}, weight {weight}", r)


def _drain_line(d: DrainStatus) -> str:
    if d.established is None:
        est = "established connections unknown (no agent report yet)"
    else:
        est = f"{d.established} established"
    return f"backend {d.backend} of {d.vip}: {d.admin}, {est}"


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
    ref, addr = _vip_arg(vip), _backend_arg(backend)
    with _api(config, instance, api, token) as client:
        start = time.monotonic()
        typer.echo(_drain_line(client.drain(ref, addr)))
        if not wait:
            return
        try:
            client.wait_drained(ref, addr, timeout=max(0.0, timeout - (time.monotonic() - start)))
        except DrainTimeout as e:
            typer.echo(_drain_line(e.last), err=True)
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
    ref, addr = _vip_arg(vip), _backend_arg(backend)
    with _api(config, instance, api, token) as client:
        typer.echo(_drain_line(client.enable(ref, addr)))


acl_app = typer.Typer(
    no_args_is_help=True,
    help="Source ACLs of a running instance (through its API): global, or one VIP's "
    "with --vip. The longest matching prefix decides; with an allow list, a source no "
    "rule matches is denied.",
)
app.add_typer(acl_app, name="acl")
AclVipOpt = Annotated[
    str | None,
    typer.Option("--vip", help="a VIP's own ACL (ADDRESS:PORT/PROTOCOL); default: global"),
]
PrefixesArg = Annotated[
    list[str], typer.Argument(help="source prefixes, e.g. 198.18.7.0/24 fd78:6470:6c62::/48")
]


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
    ref = _vip_arg(vip) if vip is not None else None
    try:
        new = AclConfig.model_validate({"deny": prefixes})
    except ValidationError as e:
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        typer.echo(f"invalid prefix: {msg}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    with _api(config, instance, api, token) as client:
        view = client.acl(ref)
        allow, deny = list(view.allow), list(view.deny)
        for p in (str(x) for x in new.deny):
            present = p in allow or p in deny
            allow, deny = [a for a in allow if a != p], [d for d in deny if d != p]
            if action == "allow":
                allow.append(p)
            elif action == "deny":
                deny.append(p)
            elif not present:
                typer.echo(f"{p} is in no list of the {view.hits.scope} ACL", err=True)
                raise typer.Exit(EXIT_CONFIG)
        r = client.put_acl(
            AclConfig.model_validate({"allow": allow, "deny": deny}), ref, persist=persist
        )
        what = {"allow": "allowed", "deny": "denied", "del": "removed"}[action]
        _changed(f"{view.hits.scope} ACL: {what} {' '.join(prefixes)}", r)


@acl_app.command("list")
def acl_list(
    vip: AclVipOpt = None,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """The rules of the global ACL (or a VIP's) and how many packets each list matched."""
    ref = _vip_arg(vip) if vip is not None else None
    with _api(config, instance, api, token) as client:
        view = client.acl(ref)
    if as_json:
        sys.stdout.write(json.dumps(view.model_dump(mode="json"), indent=2) + "\n")
        return
    h = view.hits
    typer.echo(f"{h.scope} ACL" + (" (allow list: other sources denied)" if view.allow else ""))
    for p in view.allow:
        typer.echo(f"  allow {p}")
    for p in view.deny:
        typer.echo(f"  deny  {p}")
    typer.echo(f"hits: allow {h.allow}  deny {h.deny}  default {h.default}")


@acl_app.command("allow")
def acl_allow(
    prefixes: PrefixesArg,
    vip: AclVipOpt = None,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Allow source prefixes (makes the scope an allow list: others are denied)."""
    _acl_change(vip, prefixes, "allow", persist, config, instance, api, token)


@acl_app.command("deny")
def acl_deny(
    prefixes: PrefixesArg,
    vip: AclVipOpt = None,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Deny source prefixes: their packets to the VIPs are dropped in XDP."""
    _acl_change(vip, prefixes, "deny", persist, config, instance, api, token)


@acl_app.command("del")
def acl_del(
    prefixes: PrefixesArg,
    vip: AclVipOpt = None,
    persist: PersistOpt = False,
    config: OptConfigOpt = None,
    instance: InstanceOpt = None,
    api: ApiOpt = None,
    token: TokenOpt = None,
) -> None:
    """Remove source prefixes from the scope's lists."""
    _acl_change(vip, prefixes, "del", persist, config, instance, api, token)


host_app = typer.Typer(no_args_is_help=True, help="host_tc on a backend host.")
app.add_typer(host_app, name="host")
HostInstance = Annotated[
    str, typer.Option("--instance", "-i", help="pins under /sys/fs/bpf/xdplb/")
]


@host_app.command("attach")
def host_attach(
    dev: Annotated[str, typer.Option(help="interface the tunnels arrive on")],
    addr: Annotated[list[str], typer.Option(help="an address of this host that tunnels target")],
    gue_port: Annotated[int, typer.Option(min=1, max=65535)] = abi.GUE_PORT,
    instance: HostInstance = "host",
) -> None:
    """Load host_tc, attach it at TC ingress of DEV and configure it; it stays attached
    after the command exits (run again to change addresses or upgrade in place)."""
    import ipaddress

    from xdplb.datapath.host import HostDatapath

    try:
        addrs = [ipaddress.ip_address(a) for a in addr]
    except ValueError as e:
        err.print(f"[red]invalid[/red] --addr: {e}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        ifindex = socket.if_nametoindex(dev)
    except OSError:
        err.print(f"[red]invalid[/red] --dev: no interface {dev!r}")
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        dp = HostDatapath(instance)
        try:
            dp.configure(addrs, gue_port)
            dp.attach(ifindex)
        finally:
            dp.close()
    except XdplbError as e:
        err.print(f"[red]failed[/red]: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    console.print(f"host_tc attached to {dev} for {', '.join(map(str, addrs))} (GUE {gue_port})")


@host_app.command("detach")
def host_detach(
    dev: Annotated[str, typer.Option(help="interface host_tc is attached to")],
    instance: HostInstance = "host",
) -> None:
    """Take host_tc off DEV and remove the instance's pins."""
    from xdplb.datapath.host import detach

    if not paths.pin_root(instance).exists():
        err.print(f"host instance {instance} is not attached")
        raise typer.Exit(EXIT_NOT_RUNNING)
    try:
        detach(instance, socket.if_nametoindex(dev))
    except OSError:
        err.print(f"[red]invalid[/red] --dev: no interface {dev!r}")
        raise typer.Exit(EXIT_CONFIG) from None
    except XdplbError as e:
        err.print(f"[red]failed[/red]: {e}")
        raise typer.Exit(EXIT_RUNTIME) from None
    console.print(f"host_tc detached from {dev}")


@host_app.command("status")
def host_status(
    instance: HostInstance = "host",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """What host_tc did: decapsulations, second-hop forwards, drops."""
    from xdplb.datapath.host import events_from_pins

    try:
        events = {e.name.lower(): n for e, n in events_from_pins(instance).items()}
    except FileNotFoundError as e:
        err.print(str(e))
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    if as_json:
        sys.stdout.write(json.dumps({"instance": instance, "events": events}, indent=2) + "\n")
        return
    t = Table(title=f"host_tc ({instance})")
    t.add_column("event")
    t.add_column("packets", justify="right")
    for name, n in events.items():
        t.add_row(name, str(n))
    console.print(t)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
