"""The configuration file: YAML, validated by pydantic models (:mod:`xdplb.config.schema`)."""

from xdplb.config.checks import check_limits_unchanged
from xdplb.config.load import load_config, parse_config
from xdplb.config.schema import (
    AclConfig,
    ApiConfig,
    BackendConfig,
    Config,
    EncapKind,
    HashFields,
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
    "Config",
    "EncapKind",
    "HashFields",
    "LimitsConfig",
    "LoadFeedbackConfig",
    "Protocol",
    "TableKindName",
    "VipConfig",
    "XdpModeName",
    "check_limits_unchanged",
    "load_config",
    "parse_config",
]
