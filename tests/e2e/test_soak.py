"""``make soak`` in miniature, so that its code does not rot: 24 s of load and churn
(a backend killed and restarted, reloads, a backend removed and added, a daemon
restart, a drain) with nothing unexpected breaking and the report complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xdplb.lab import soak

pytestmark = pytest.mark.e2e


def test_short_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    rc = soak.main(["--seconds", "24", "--step", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, soak.summary(report) + f"\n{report['problems']}"
    kinds = {e["kind"] for e in report["events"]}
    # Six of the cycle's events at least (reloads and the restart take their time).
    assert {"backend killed", "backend restarted", "reload: weights", "daemon restart"} <= kinds
    assert report["unexpected"] == 0
    # Load really ran: every kind was attempted and most of it went through.
    for what in ("stream", "tcp", "udp"):
        assert report["attempted"].get(what, 0) >= 20, report["attempted"]
    assert report["failed"].get("tcp", 0) < report["attempted"]["tcp"] / 4
    assert report["failed"].get("udp", 0) < report["attempted"]["udp"] / 4
    assert report["stream_bytes_verified"] > 1_000_000
    # Killing a backend broke its streams, and they were told apart as expected.
    assert report["classes"].get("expected: backend died", 0) > 0
    mem = report["memory"]
    assert mem["rss_kib"]["start"] > 0 and mem["bpf_bytes"]["end"] == mem["bpf_bytes"]["start"]
    assert len(mem["samples"]) >= 5
