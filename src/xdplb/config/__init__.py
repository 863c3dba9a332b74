"""The configuration: one LB instance's YAML file as validated, frozen pydantic models
(:mod:`~xdplb.config.schema`; health-check settings :mod:`~xdplb.config.health`), the
checks that refuse what cannot work or would not fit the maps (:mod:`~xdplb.config.checks`)
and loading (:mod:`~xdplb.config.load`), where every refusal becomes a
:class:`~xdplb.core.errors.ConfigError` naming the field at fault. Nothing here needs a
built C extension, so ``xdplb validate`` works from a bare checkout.
May import: core, tables (primes only: validating a file needs no built extension).
"""

from xdplb.config.checks import check_limits_unchanged
from xdplb.config.load import fleet_config, load_config, parse_config
from xdplb.config.schema import (
    AclConfig,
    ApiConfig,
    BackendConfig,
    ClusterConfig,
    Config,
    EncapKind,
    HashFields,
    HookName,
    InterfaceConfig,
    LimitsConfig,
    LoadFeedbackConfig,
    Protocol,
    TableKindName,
    VipConfig,
    XdpModeName,
)

__all__ = [
    "AclConfig",
    "ApiConfig",
    "BackendConfig",
    "ClusterConfig",
    "Config",
    "EncapKind",
    "HashFields",
    "HookName",
    "InterfaceConfig",
    "LimitsConfig",
    "LoadFeedbackConfig",
    "Protocol",
    "TableKindName",
    "VipConfig",
    "XdpModeName",
    "check_limits_unchanged",
    "fleet_config",
    "load_config",
    "parse_config",
]
