"""Reading a configuration: a YAML file or a parsed document to a validated
:class:`~xdplb.config.schema.Config`. Pydantic's ValidationError becomes one
:class:`~xdplb.core.errors.ConfigError` whose ``field`` is the dotted path of the culprit
(``vips[0].backends[1].weight``), so an operator can find it; a refused configuration
never reaches the data path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from xdplb.config.checks import FieldError
from xdplb.config.schema import Config
from xdplb.core.errors import ConfigError


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith(("function-after", "function-before", "function-wrap")):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _errors(e: ValidationError) -> Iterator[tuple[str, str]]:
    for err in e.errors():
        ctx_err = err.get("ctx", {}).get("error")
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        if isinstance(ctx_err, FieldError):
            # A model-level check names its field relative to the model it checks.
            prefix = _loc(loc)
            yield (f"{prefix}.{ctx_err.field}" if prefix else ctx_err.field), ctx_err.message
            continue
        yield _loc(loc), err["msg"].removeprefix("Value error, ")


def parse_config(data: Any) -> Config:
    """Validate a parsed document; raise ConfigError naming the first bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", "the configuration must be a mapping at the top level")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        errs = list(_errors(e))
        field, msg = errs[0]
        if len(errs) > 1:
            msg += f" (and {len(errs) - 1} more: " + "; ".join(f"{f}: {m}" for f, m in errs[1:4])
            msg += ")"
        raise ConfigError(field, msg) from None


def load_config(path: str | Path) -> Config:
    """Read and validate a YAML configuration file."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path} is not valid YAML: {e}") from None
    return parse_config(data)
