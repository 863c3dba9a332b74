"""Fixtures for the lb_xdp tests: a lab namespace, the loaded program, a config helper.

- ``lb_netns`` (module): a fresh network namespace ``xdplbt-<pid>-<n>`` with a veth pair
  lb0/lb0p up, 198.18.0.2/24 and fd78:6470:6c62::2/64 (nodad) on lb0, forwarding on, and
  permanent neighbours for the fixture backends. This thread runs inside it (xdplb.lab.netns)
  for the whole module, so test_run's ingress_ifindex and bpf_fib_lookup() see its
  devices, routes and neighbours; it is left and deleted afterwards whatever happens.
- ``lb_obj`` (module): build/lb_xdp.bpf.o, then build/lb_tc.bpf.o (``lb_hook``: the
  module runs once per hook), loaded with its pins under /sys/fs/bpf/xdplbt-<pid>-<n>
  (removed afterwards).
- ``lb`` (function): the object with every map reset to the fixture configuration of
  tests/bpf/lb_fixtures.py, plus helpers to run packets and read counters
  (tests/bpf/lb_harness.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from lb_harness import LabNetns, Lb, configure_lab, serial

from xdplb.core import paths
from xdplb.datapath import BpfObject
from xdplb.lab import netns


@pytest.fixture(scope="module")
def lb_netns() -> Iterator[LabNetns]:
    name = f"xdplbt-{os.getpid()}-{next(serial)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        with netns.enter(name):
            yield configure_lab(name)
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@pytest.fixture(scope="module", params=["lb_xdp", "lb_tc"])
def lb_hook(request: pytest.FixtureRequest) -> str:
    """The balancer's program under test: every module that uses ``lb_obj`` runs once
    per hook (one table, two hooks), unless it overrides this fixture."""
    return str(request.param)


@pytest.fixture(scope="module")
def lb_obj(lb_hook: str) -> Iterator[BpfObject]:
    pin_root = Path(f"/sys/fs/bpf/xdplbt-{os.getpid()}-{next(serial)}")
    try:
        obj = BpfObject.load(paths.bpf_object(lb_hook), pin_root=pin_root)
        try:
            yield obj
        finally:
            obj.close()
    finally:
        shutil.rmtree(pin_root, ignore_errors=True)


@pytest.fixture(scope="module")
def lb_module(lb_obj: BpfObject, lb_netns: LabNetns) -> Lb:
    return Lb(lb_obj, lb_netns)


@pytest.fixture
def lb(lb_module: Lb) -> Lb:
    lb_module.reset()
    return lb_module
