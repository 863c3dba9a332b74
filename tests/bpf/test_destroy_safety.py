"""Removing an instance's pins never reaches outside its own directory (issue 10,
failure 11): ``xdplb stop -i ..`` once removed the whole pin root. Here a test pin root
inside the real bpffs has neighbours (another instance, another tool's pins beside the
root); every refused removal leaves them all in place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_CONFIG, EXIT_RUNTIME
from xdplb.core import paths
from xdplb.core.errors import XdplbError
from xdplb.datapath.lb import Destroyed, destroy
from xdplb.datapath.maps import Map, MapType

pytestmark = pytest.mark.bpf


def pin_map(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with Map.create(MapType.ARRAY, 4, 4, 1, name="t") as m:
        m.pin(path)


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """``<bpffs>/xdplb-safety-<pid>/xdplb`` as the pin root, with pins beside it and in a
    neighbouring instance."""
    base = Path("/sys/fs/bpf") / f"xdplb-safety-{os.getpid()}"
    root = base / "xdplb"
    pin_map(base / "other-tool" / "m")
    pin_map(root / "neighbour" / "m")
    monkeypatch.setattr(paths, "BPFFS_ROOT", root)
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    try:
        yield root
    finally:
        shutil.rmtree(base)


def survivors(root: Path) -> list[Path]:
    return [p for p in (root.parent / "other-tool" / "m", root / "neighbour" / "m") if p.exists()]


def test_stop_dotdot_is_a_usage_error_and_removes_nothing(root: Path) -> None:
    for name in ("..", ".", "../xdplb"):
        r = CliRunner().invoke(app, ["stop", "-i", name])
        assert r.exit_code == EXIT_CONFIG, r.output
        assert f"{name!r} is not an instance name" in r.stderr
    assert len(survivors(root)) == 2


def test_destroy_refuses_names_and_links_that_leave_the_root(root: Path) -> None:
    with pytest.raises(paths.BadName):
        destroy("..")
    # A symbolic link in the pin root to another instance's directory.
    (root / "evil").symlink_to(root / "neighbour")
    with pytest.raises(XdplbError, match="is a symbolic link"):
        destroy("evil")
    r = CliRunner().invoke(app, ["stop", "-i", "evil"])
    assert r.exit_code == EXIT_RUNTIME
    assert "is a symbolic link, not a directory of pins" in r.stderr
    assert len(survivors(root)) == 2


def test_destroy_removes_its_own_directory_and_says_what_it_removed(root: Path) -> None:
    pin_map(root / "mine" / "lb_vips")
    pin_map(root / "mine" / "hc" / "hc_targets")
    assert destroy("mine") == Destroyed(detached=(), pins=2, left=())
    assert not (root / "mine").exists()
    assert destroy("mine") == Destroyed(detached=(), pins=0, left=())
    assert len(survivors(root)) == 2
