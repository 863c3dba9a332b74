"""What the ``xdplb`` commands share on the way in: the documented exit codes, the typer
option and argument types, and the parsing of instance, VIP, backend and prefix
arguments, each of which exits 2 naming what it could not read.

Exit codes (documented in the README):
  0  success
  1  runtime failure (kernel or BPF error, daemon did not stop in time, the API answered
     5xx or could not be reached, a drain did not finish within --timeout)
  2  invalid configuration or usage (also: the API refused the request, 4xx)
  3  the instance is not running / has nothing pinned
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from xdplb.cli.client import Endpoint, endpoint, parse_backend, parse_vip
from xdplb.cli.console import fail
from xdplb.config import AclConfig, Config, VipConfig, load_config, parse_config
from xdplb.control.interface import VipRef
from xdplb.core import paths
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG, EXIT_NOT_RUNNING = 0, 1, 2, 3


def _instance(value: str | None) -> str | None:
    """``-i``: a name that stays a plain file name under the pin root (usage error, 2)."""
    try:
        return None if value is None else paths.instance_name(value)
    except paths.BadName as e:
        raise typer.BadParameter(str(e)) from None


ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML configuration file")]
InstanceOpt = Annotated[
    str | None,
    typer.Option(
        "--instance",
        "-i",
        callback=_instance,
        help="instance name (default: from -c, else 'default')",
    ),
]
OptConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML file: its instance, and its api section says where the daemon is",
    ),
]
ApiOpt = Annotated[
    str | None,
    typer.Option(
        "--api",
        envvar="XDPLB_API",
        help="the daemon's API URL, e.g. http://198.18.0.2:9100 (default: api.listen of the "
        "-c file, else the unix socket /run/xdplb/INSTANCE.api.sock)",
    ),
]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="XDPLB_TOKEN", help="bearer token of the API")
]
PersistOpt = Annotated[
    bool, typer.Option("--persist", help="also write the change to the configuration file")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
VipArg = Annotated[
    str, typer.Argument(help="ADDRESS:PORT/PROTOCOL (tcp when left out), e.g. 198.18.100.1:80/tcp")
]
BackendArg = Annotated[str, typer.Argument(help="backend address")]
AclVipOpt = Annotated[
    str | None,
    typer.Option("--vip", help="a VIP's own ACL (ADDRESS:PORT/PROTOCOL); default: global"),
]
PrefixesArg = Annotated[
    list[str], typer.Argument(help="source prefixes, e.g. 198.18.7.0/24 fd78:6470:6c62::/48")
]
HostInstanceOpt = Annotated[
    str, typer.Option("--instance", "-i", callback=_instance, help="pins under /sys/fs/bpf/xdplb/")
]


def usage_error(message: str) -> typer.Exit:
    """Print ``message`` to stderr; the exit to raise (2)."""
    typer.echo(message, err=True)
    return typer.Exit(EXIT_CONFIG)


def _load(config: Path) -> Config:
    try:
        return load_config(config)
    except ConfigError as e:
        fail("invalid configuration", f"{config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None


def instance_name(config: Path | None, instance: str | None) -> str:
    """``-i``, else the instance of the ``-c`` file, else ``default``."""
    if instance:
        return instance
    return _load(config).instance if config is not None else "default"


def daemon_of(
    config: Path | None, instance: str | None, api: str | None, token: str | None
) -> tuple[str, Endpoint]:
    """The instance and where its daemon is, in the one order every command that talks
    to a daemon follows (:func:`xdplb.cli.client.endpoint`): ``--api``, else the ``api``
    section of the ``-c`` file, else the default socket."""
    if api is not None:
        name = instance or "default"
        return name, endpoint(name, api=api, token=token)
    cfg = _load(config) if config is not None else None
    name = instance or (cfg.instance if cfg is not None else "default")
    try:
        return name, endpoint(name, token=token, config=config, cfg=cfg)
    except ConfigError as e:
        fail("invalid configuration", f"{config}: {e}")
        raise typer.Exit(EXIT_CONFIG) from None


def vip_config(data: dict[str, Any]) -> VipConfig:
    """A VIP validated by the configuration's own rules, before any request is sent."""
    try:
        return parse_config({"vips": [data]}).vips[0]
    except ConfigError as e:
        where = f" (field {e.field.removeprefix('vips[0]').lstrip('.')})" if e.field else ""
        raise usage_error(f"invalid VIP: {e.message}{where}") from None


def vip_arg(text: str) -> VipRef:
    try:
        return parse_vip(text)
    except ValueError as e:
        raise usage_error(f"invalid VIP: {e}") from None


def address_arg(text: str, what: str) -> IPAddress:
    try:
        return parse_backend(text)
    except ValueError as e:
        raise usage_error(f"invalid {what}: {e}") from None


def backend_arg(text: str) -> IPAddress:
    return address_arg(text, "backend")


def prefixes_arg(prefixes: list[str]) -> list[str]:
    """The prefixes as the ACL writes them (each checked by the configuration's rules)."""
    try:
        return [str(p) for p in AclConfig.model_validate({"deny": prefixes}).deny]
    except ValidationError as e:
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise usage_error(f"invalid prefix: {msg}") from None
