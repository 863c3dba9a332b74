"""The runtime package needs none of the test-only libraries (the dev extra) to import:
every module of src/xdplb, in a fresh interpreter where scapy and selenium cannot be
imported. The lab's test helpers that use them (packets, browser) import them lazily."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

#: Importing any of these in the child raises ImportError.
BLOCKED = ("scapy", "selenium")

CHILD = f"""
import importlib, json, pkgutil, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # import of it halted: ModuleNotFoundError
import xdplb

failed = {{}}

def on_error(name):
    failed[name] = repr(sys.exc_info()[1])

names = []
for info in pkgutil.walk_packages(xdplb.__path__, "xdplb.", onerror=on_error):
    names.append(info.name)
    try:
        importlib.import_module(info.name)
    except BaseException as exc:  # SystemExit too: a module that runs on import
        failed[info.name] = repr(exc)
print(json.dumps({{"imported": names, "failed": failed}}))
"""


def test_every_module_imports_without_the_test_libraries() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["failed"] == {}
    # The walk reached every layer, the C extensions and both lazy users of the blocked ones.
    for name in (
        "xdplb.core.abi",
        "xdplb.tables._maglev_c",
        "xdplb.datapath._libbpf_c",
        "xdplb.agent.__main__",
        "xdplb.daemon.main",
        "xdplb.cli.app",
        "xdplb.lab.packets",
        "xdplb.lab.browser",
    ):
        assert name in result["imported"]
