"""The load agent on a lab backend: ``python -m xdplb.agent`` inside its namespace."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from xdplb.core.errors import LabError
from xdplb.lab.topology import Lab


def start_agent(
    lab: Lab,
    backend: str,
    to: str,
    interval: float = 0.2,
    *,
    name: str | None = None,
    host_instance: str | None = None,
    **kw: Any,
) -> subprocess.Popen[Any]:
    """Start the agent of ``backend`` (``b1`` ...), reporting to ``to`` (``host:port``)
    every ``interval`` seconds; the lab kills it at teardown.

    ``name``: its identity, by default the backend's IPv4 address (as a configuration
    writes backends). ``host_instance``: the host_tc pins to read, by default the lab's
    own for that backend (:func:`xdplb.lab.host.attach_host`), so that a real host's
    ``host`` instance is never read; absent pins mean no ``chain`` in the reports.
    ``kw`` goes to subprocess.Popen.
    """
    if backend not in lab.backends:
        raise LabError(f"{backend!r} is not a backend of this lab: {lab.backends}")
    argv = [
        sys.executable,
        "-m",
        "xdplb.agent",
        "--name",
        name if name is not None else str(lab.addr(backend)),
        "--to",
        to,
        "--interval",
        str(interval),
        "--host-instance",
        host_instance if host_instance is not None else f"{lab.prefix}-{backend}",
    ]
    return lab.popen(backend, argv, **kw)
