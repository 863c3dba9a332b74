"""What the configuration package promises as a whole: it loads a file where the C
extensions were never built (``xdplb validate`` on a bare checkout), importing nothing of
xdplb beyond core and tables.primes; and its plain-function checks know every ``limits``
field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xdplb.config import LimitsConfig
from xdplb.config.checks import LIMIT_BOUNDS

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lb.yaml"

# A fresh interpreter, so nothing this test process imported already is in sys.modules.
# None in sys.modules makes an import of that name fail, as if the module was never built.
SCRIPT = """
import json, sys
sys.modules["xdplb.tables._maglev_c"] = None
sys.modules["xdplb.datapath._libbpf_c"] = None
from xdplb.config import load_config
cfg = load_config(sys.argv[1])
mods = sorted(m for m in sys.modules if m.startswith("xdplb.") and sys.modules[m] is not None)
print(json.dumps({"vips": len(cfg.vips), "modules": mods}))
"""


def test_loads_without_the_c_extensions() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["vips"] > 0
    packages = {"xdplb.config", "xdplb.core", "xdplb.tables", "xdplb.tables.primes"}
    stray = [
        m
        for m in got["modules"]
        if m not in packages and not m.startswith(("xdplb.config.", "xdplb.core."))
    ]
    assert stray == []


def test_limit_bounds_cover_every_limits_field() -> None:
    # check_limit_bounds and check_limits_unchanged walk LIMIT_BOUNDS, not the model.
    assert list(LIMIT_BOUNDS) == list(LimitsConfig.model_fields)
