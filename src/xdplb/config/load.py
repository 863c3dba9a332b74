"""Reading a configuration: a YAML file or a parsed document to a validated
:class:`~xdplb.config.schema.Config`. Pydantic's ValidationError becomes one
:class:`~xdplb.core.errors.ConfigError` whose ``field`` is the dotted path of the culprit
(``vips[0].backends[1].weight``), so an operator can find it (an unknown field with the
known one it is closest to); a refused configuration never reaches the data path. Also the
API's bearer token as the configuration gives it (inline or from a file), which the
daemon serves with and the CLI sends.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from xdplb.config.checks import FieldError
from xdplb.config.schema import FLEET_FIELDS, ApiConfig, Config
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


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds (``X | None``, ``list[X]``, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def _unknown(loc: tuple[int | str, ...]) -> str:
    """The message for an unknown field at ``loc``: the known field it is closest to."""
    models: list[type[BaseModel]] = [Config]
    for part in loc[:-1]:
        if isinstance(part, str):
            inner = [
                m
                for c in models
                if part in c.model_fields
                for m in _models(c.model_fields[part].annotation)
            ]
            models = inner or models  # not a field: a union's tag in the location
    known = sorted({name for m in models for name in m.model_fields})
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"unknown field {loc[-1]!r}: did you mean {close[0]!r}?"
    return f"unknown field {loc[-1]!r} (known here: {', '.join(known)})"


def _errors(e: ValidationError) -> Iterator[tuple[str, str]]:
    for err in e.errors():
        ctx_err = err.get("ctx", {}).get("error")
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
        if isinstance(ctx_err, FieldError):
            # A model-level check names its field relative to the model it checks.
            prefix = _loc(loc)
            yield (f"{prefix}.{ctx_err.field}" if prefix else ctx_err.field), ctx_err.message
            continue
        if err["type"] == "extra_forbidden":
            yield _loc(loc), _unknown(loc)
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
    except UnicodeDecodeError as e:
        raise ConfigError("", f"{path} is not UTF-8 text: {e}") from None
    # From the text (a stream's errors lose their snippet and caret), named as the file.
    loader = yaml.SafeLoader(text)
    loader.name = str(path)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path} is not valid YAML:\n{e}") from None
    finally:
        loader.dispose()
    return parse_config(data)


def fleet_config(local: Config, text: str | bytes, where: str) -> Config:
    """``local`` (a node's own file) with the fields the fleet's document ``text`` (YAML,
    read from ``where``) sets: those of :data:`FLEET_FIELDS` it names replace the file's,
    the others stay the file's. ConfigError naming the field at fault."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{where} is not valid YAML:\n{e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{where} must be a mapping at the top level")
    for key in data:
        if key not in FLEET_FIELDS:
            raise ConfigError(
                str(key), f"not a fleet field ({', '.join(FLEET_FIELDS)}): each node sets it"
            )
    return parse_config({**local.model_dump(mode="json"), **data})


def api_token(api: ApiConfig) -> str | None:
    """The bearer token of ``api``: inline, or the first line of its ``token_file``
    (ConfigError naming ``api.token_file`` if it cannot be read or is too short)."""
    if api.token_file is None:
        return api.token
    try:
        token = api.token_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError) as e:
        raise ConfigError(
            "api.token_file", f"cannot read a token from {api.token_file}: {e}"
        ) from None
    if len(token) < 16:
        raise ConfigError("api.token_file", "the token must be at least 16 characters")
    return token
