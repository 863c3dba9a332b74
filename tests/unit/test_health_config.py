"""Health-check settings: Nickel's format parses, and every refusal points at its field."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from xdplb.config.health import HealthCheckConfig

pytestmark = pytest.mark.unit

#: Bilibili Nickel's health_check section, verbatim.
NICKEL = (
    '{"checker": {"http": {"scheme": "http", "uri": "/", "check_port": 9080, "codes": [200]}},'
    ' "fall_count": 2, "interval_ms": 2000, "rise_count": 2}'
)


def test_nickel_example_parses_from_yaml() -> None:
    c = HealthCheckConfig.model_validate(yaml.safe_load(NICKEL))
    assert c.checker.kind == "http"
    http = c.checker.http
    assert http is not None
    assert (http.scheme, http.uri, http.check_port, http.codes) == ("http", "/", 9080, (200,))
    assert (c.fall_count, c.rise_count, c.interval_ms) == (2, 2, 2000)
    # Defaults for what Nickel does not say.
    assert (c.timeout_ms, c.jitter, c.via) == (1000, 0.1, "tunnel")
    assert c.checker.check_port == 9080


def test_block_yaml_too() -> None:
    text = """
    checker:
      tcp: {}
    interval_ms: 500
    timeout_ms: 200
    via: direct
    """
    c = HealthCheckConfig.model_validate(yaml.safe_load(text))
    assert c.checker.kind == "tcp"
    assert c.checker.check_port is None
    assert (c.interval_ms, c.timeout_ms, c.via) == (500, 200, "direct")


@pytest.mark.parametrize(
    ("checker", "kind", "fields"),
    [
        ({"tcp": {"check_port": 8080}}, "tcp", {"check_port": 8080}),
        (
            {
                "http": {
                    "scheme": "https",
                    "uri": "/health?full=1",
                    "method": "HEAD",
                    "codes": [200, 204],
                    "body": "ok",
                    "host": "www.example.com",
                    "verify_tls": True,
                }
            },
            "http",
            {"scheme": "https", "method": "HEAD", "codes": (200, 204), "host": "www.example.com"},
        ),
        (
            {"udp": {"check_port": 53, "payload": "ping", "expect": "pong"}},
            "udp",
            {"expect": "pong"},
        ),
        ({"command": {"command": ["/bin/check", "--fast"]}}, "command", {}),
    ],
    ids=["tcp", "http", "udp", "command"],
)
def test_each_checker_kind(checker: dict[str, Any], kind: str, fields: dict[str, Any]) -> None:
    c = HealthCheckConfig.model_validate({"checker": checker})
    assert c.checker.kind == kind
    spec = getattr(c.checker, kind)
    for name, value in fields.items():
        assert getattr(spec, name) == value
    if kind == "command":
        assert spec.command == ("/bin/check", "--fast")
        assert c.checker.check_port is None


def test_equal_settings_compare_and_hash_equal() -> None:
    # The monitor keeps a target's state across reloads when its settings compare equal.
    a = HealthCheckConfig.model_validate(yaml.safe_load(NICKEL))
    b = HealthCheckConfig.model_validate(yaml.safe_load(NICKEL))
    assert a == b
    assert hash(a) == hash(b)
    assert a != a.model_copy(update={"fall_count": 3})


def _errors(data: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    with pytest.raises(ValidationError) as info:
        HealthCheckConfig.model_validate(data)
    return [(e["loc"], e["msg"]) for e in info.value.errors()]


@pytest.mark.parametrize(
    ("data", "loc", "message"),
    [
        (
            {"checker": {"tcp": {}, "http": {}}},
            ("checker",),
            "give exactly one of tcp, http, udp, command (got tcp, http)",
        ),
        ({"checker": {}}, ("checker",), "give exactly one of tcp, http, udp, command (got none)"),
        (
            {"checker": {"http": {"codes": [200, 99]}}},
            ("checker", "http", "codes", 1),
            "greater than or equal to 100",
        ),
        ({"checker": {"http": {"codes": []}}}, ("checker", "http", "codes"), "at least one"),
        (
            {"checker": {"tcp": {}}, "interval_ms": 500, "timeout_ms": 600},
            ("timeout_ms",),
            "must not be above interval_ms (500), got 600",
        ),
        ({"checker": {"tcp": {}}, "retries": 3}, ("retries",), "Extra inputs are not permitted"),
        (
            {"checker": {"http": {"uri": "/", "verbose": True}}},
            ("checker", "http", "verbose"),
            "Extra inputs are not permitted",
        ),
        (
            {"checker": {"tcp": {"check_port": 0}}},
            ("checker", "tcp", "check_port"),
            "greater than or equal to 1",
        ),
        ({"checker": {"http": {"uri": "health"}}}, ("checker", "http", "uri"), "pattern"),
        ({"checker": {"http": {"method": "PUT"}}}, ("checker", "http", "method"), "'GET'"),
        (
            {"checker": {"command": {"command": []}}},
            ("checker", "command", "command"),
            "at least 1",
        ),
        (
            {"checker": {"tcp": {}}, "interval_ms": 10},
            ("interval_ms",),
            "greater than or equal to 50",
        ),
        ({"checker": {"tcp": {}}, "rise_count": 0}, ("rise_count",), "greater than or equal to 1"),
        ({"checker": {"tcp": {}}, "fall_count": 101}, ("fall_count",), "less than or equal to 100"),
        ({"checker": {"tcp": {}}, "jitter": 0.6}, ("jitter",), "less than or equal to 0.5"),
        ({"checker": {"tcp": {}}, "via": "nat"}, ("via",), "'tunnel' or 'direct'"),
        ({"interval_ms": 1000}, ("checker",), "Field required"),
    ],
    ids=[
        "two-checkers",
        "no-checker",
        "code-99",
        "no-codes",
        "timeout-above-interval",
        "unknown-field",
        "unknown-http-field",
        "port-0",
        "uri-without-slash",
        "method",
        "empty-command",
        "interval-too-short",
        "rise-0",
        "fall-101",
        "jitter",
        "via",
        "no-checker-key",
    ],
)
def test_refusals_name_the_field(data: dict[str, Any], loc: tuple[Any, ...], message: str) -> None:
    errors = _errors(data)
    assert len(errors) == 1, errors
    (got_loc, got_msg) = errors[0]
    assert got_loc == loc
    assert message.lower() in got_msg.lower()
