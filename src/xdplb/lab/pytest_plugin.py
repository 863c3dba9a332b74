"""pytest fixtures for the lab. Load with ``pytest_plugins = ["xdplb.lab.pytest_plugin"]``.

- ``lab``: module-scoped, a built :class:`~xdplb.lab.Lab` with host_tc attached on every
  backend (``lab.hosts``); torn down after the module.
- ``lab_servers``: the lab's servers, one per backend (by name), killed after the test.
- ``lab_factory``: builds extra labs inside one test, all torn down after it.
- ``netns``: a fresh network namespace with only ``lo`` (up), and a bpffs pin directory
  of the same name, for the socket tier's tests; both removed after the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from xdplb.core import paths
from xdplb.lab import netns as netns_mod
from xdplb.lab.host import attach_host
from xdplb.lab.registry import cleanup_stale, new_prefix
from xdplb.lab.topology import Lab


def _require_lab() -> None:
    # Not a skip: CI runs as root with everything built, and a lab test that quietly
    # skipped would hide exactly what it is there to show.
    if os.geteuid() != 0:
        pytest.fail("the lab needs root (network namespaces, BPF)")
    for name in ("host_tc", "xdp_pass"):
        try:
            paths.bpf_object(name)
        except FileNotFoundError as exc:
            pytest.fail(str(exc))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """A lab with host_tc on every backend (3 backends, the default VIPs)."""
    _require_lab()
    cleanup_stale()
    with Lab() as built:
        for name in built.backends:
            attach_host(built, name)
        yield built


@pytest.fixture
def lab_servers(lab: Lab) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """The lab's servers (``Lab.start_servers``), by backend name; killed after the test."""
    procs = dict(zip(lab.backends, lab.start_servers(), strict=True))
    yield procs
    for p in procs.values():
        p.kill()
        p.wait()


@pytest.fixture
def lab_factory() -> Iterator[Callable[..., Lab]]:
    """``lab_factory(backends=1, ...)`` builds a lab (not attached); teardown after the test."""
    _require_lab()
    made: list[Lab] = []

    def make(**kw: Any) -> Lab:
        built = Lab(**kw)
        made.append(built)
        return built.__enter__()

    yield make
    for built in made:
        built.teardown()


@pytest.fixture
def netns() -> Iterator[str]:
    """A new namespace ``xl<pid><letter>-sk`` with ``lo`` up; its name is also a free pin
    directory under the bpffs root (``paths.pin_root(name)``). A stale one (its process
    gone) is removed by the next ``cleanup_stale``."""
    _require_lab()
    name = f"{new_prefix()}-sk"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        netns_mod.delete(name)
        shutil.rmtree(paths.pin_root(name), ignore_errors=True)
