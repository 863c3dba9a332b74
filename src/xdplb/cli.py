"""The ``xdplb`` command.

Exit codes (documented in the README):
  0  success
  1  runtime failure (kernel or BPF error, daemon did not stop in time)
  2  invalid configuration or usage
  3  the instance is not running / has nothing pinned
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from xdplb import abi, paths
from xdplb.config import load_config
from xdplb.errors import ConfigError, XdplbError

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
    from xdplb.daemon import Daemon

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
    from xdplb.daemon import read_pid
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
    destroy(name)
    console.print(f"instance {name} stopped and detached")


def _status_data(name: str) -> dict[str, Any]:
    from xdplb.datapath.lb import LbMaps

    maps = LbMaps.from_pins(paths.pin_root(name))
    try:
        snap = maps.snapshot()
        counters = maps.counters()
        vips = []
        for vip, st in sorted(snap.vips.items(), key=lambda kv: kv[1].vip_id):
            table = snap.tables.get(st.vip_id)
            share = table.counts() if table is not None else {}
            s = counters.vips.get(st.vip_id, abi.Stats())
            vips.append(
                {
                    "id": st.vip_id,
                    "address": str(vip.addr),
                    "port": vip.port,
                    "protocol": "tcp" if vip.proto == abi.IPPROTO_TCP else "udp",
                    "encap": st.encap.name.lower(),
                    "hash": "source" if st.flags & abi.VIP_F_SRC_HASH else "5tuple",
                    "table_size": st.table_size,
                    "table_share": {str(k): v / st.table_size for k, v in share.items()},
                    "packets": s.packets,
                    "bytes": s.bytes,
                    "new_flows": s.new_flows,
                }
            )
        backends = []
        for bid, b in sorted(snap.backends.items()):
            s = counters.backends.get(bid, abi.Stats())
            backends.append(
                {
                    "id": bid,
                    "address": str(b.addr),
                    "active": b.active,
                    "packets": s.packets,
                    "bytes": s.bytes,
                    "new_flows": s.new_flows,
                }
            )
        return {
            "instance": name,
            "attached": sorted(
                p.name.removeprefix("xdp_") for p in (paths.pin_root(name) / "links").glob("xdp_*")
            ),
            "vips": vips,
            "backends": backends,
            "drops": {r.name.lower(): n for r, n in counters.drops.items()},
            "events": {e.name.lower(): n for e, n in counters.events.items()},
            "connections": counters.conns,
        }
    finally:
        maps.close()


@app.command()
def status(
    config: Annotated[Path | None, typer.Option("--config", "-c")] = None,
    instance: InstanceOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """VIPs, backends and counters of a running instance."""
    name = _instance(config, instance)
    try:
        data = _status_data(name)
    except FileNotFoundError as e:
        err.print(str(e))
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    console.print(
        f"instance [bold]{name}[/bold], attached to "
        f"{', '.join(data['attached']) or 'nothing'}; "
        f"{data['connections']} connections tracked"
    )
    vt = Table(title="VIPs")
    for col in ("id", "VIP", "encap", "hash", "table", "packets", "bytes", "new flows"):
        numeric = col in {"packets", "bytes", "new flows"}
        vt.add_column(col, justify="right" if numeric else "left", no_wrap=col == "VIP")
    for v in data["vips"]:
        host = f"[{v['address']}]" if ":" in v["address"] else v["address"]
        vt.add_row(
            str(v["id"]),
            f"{host}:{v['port']}/{v['protocol']}",
            v["encap"],
            v["hash"],
            str(v["table_size"]),
            str(v["packets"]),
            str(v["bytes"]),
            str(v["new_flows"]),
        )
    console.print(vt)
    bt = Table(title="Backends")
    for col in ("id", "address", "state", "table share", "packets", "bytes", "new flows"):
        bt.add_column(col, no_wrap=col == "address")
    for b in data["backends"]:
        shares = [
            f"{v['table_share'][str(b['id'])]:.1%}"
            for v in data["vips"]
            if str(b["id"]) in v["table_share"]
        ]
        bt.add_row(
            str(b["id"]),
            b["address"],
            "active" if b["active"] else "removed",
            " ".join(shares) or "-",
            str(b["packets"]),
            str(b["bytes"]),
            str(b["new_flows"]),
        )
    console.print(bt)
    ct = Table(title="Events and drops")
    ct.add_column("counter")
    ct.add_column("value", justify="right")
    for k, n in data["events"].items():
        ct.add_row(k, str(n))
    for k, n in data["drops"].items():
        ct.add_row(f"drop: {k}", str(n), style="red" if n else None)
    console.print(ct)


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
