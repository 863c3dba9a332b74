"""``xdplb stop`` where the pins are not visible (issue 10, failure 3): bpffs not mounted
at the pin root, as inside ``ip netns exec``. It must fail, naming why, and change
nothing; the pin root here is a plain directory standing in for an unmounted bpffs."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_RUNTIME
from xdplb.core import paths

pytestmark = pytest.mark.unit


def test_stop_fails_and_keeps_everything_where_bpffs_is_not_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "bpf"
    link = root / "inst" / "links" / "xdp_eth0"
    link.parent.mkdir(parents=True)
    link.write_text("a pinned link, as far as the test knows")
    monkeypatch.setattr(paths, "BPFFS_ROOT", root)
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path / "run"))
    r = CliRunner().invoke(app, ["stop", "-i", "inst"])
    assert r.exit_code == EXIT_RUNTIME, r.output
    assert r.stderr.startswith(f"cannot stop instance inst: bpffs is not mounted at {root}/inst")
    assert "the pins of inst are not visible here" in r.stderr
    assert "stopped" not in r.output
    assert link.read_text() == "a pinned link, as far as the test knows"
    # status --offline says the same rather than "nothing pinned".
    r = CliRunner().invoke(app, ["status", "-i", "inst", "--offline"])
    assert r.exit_code == EXIT_RUNTIME
    assert "bpffs is not mounted" in r.stderr
