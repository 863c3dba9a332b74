"""The rate history's counters (``Runtime.traffic``, a few lookups) are the ones the
status reports (``Runtime.status``, every map), per VIP and per backend, a backend of
two VIPs included, with counters spread over every CPU."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import yaml

from xdplb.control.runtime import Runtime
from xdplb.control.status import Traffic
from xdplb.core import abi
from xdplb.datapath.lb import destroy

pytestmark = pytest.mark.bpf

TUNNEL = {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"}


def test_traffic_is_what_the_status_counts(tmp_path: Path) -> None:
    instance = f"traffictest-{os.getpid()}"
    shared, own = {"address": "198.18.0.11"}, {"address": "198.18.0.12"}
    vips = [
        {"address": "198.18.100.1", "port": 80, "backends": [shared, own]},
        {"address": "198.18.100.2", "port": 53, "protocol": "udp", "backends": [shared]},
    ]
    path = tmp_path / "xdplb.yaml"
    path.write_text(yaml.safe_dump({"instance": instance, "tunnel": TUNNEL, "vips": vips}))
    rt = Runtime(path, tmp_path)
    try:
        rt.apply()
        snap = rt.dp.snapshot()
        cpus = len(rt.dp["lb_vip_stats"].lookup_percpu(struct.pack("<I", 0)))
        ids = [("lb_vip_stats", p.vip_id) for p in snap.vips.values()]
        ids += [("lb_be_stats", i) for i in snap.backends]
        for n, (name, i) in enumerate(ids, start=1):
            per_cpu = b"".join(
                bytes(abi.Stats(packets=n * 1000 + c, bytes=n * 10**6 + c, new_flows=n + c))
                for c in range(cpus)
            )
            rt.dp[name].update(struct.pack("<I", i), per_cpu)
        traffic = rt.traffic()
        assert traffic == Traffic.of(rt.status())
        assert set(traffic.vips) == {"198.18.100.1:80/tcp", "198.18.100.2:53/udp"}
        assert set(traffic.backends) == {"198.18.0.11", "198.18.0.12"}
        # Every counter was written, and summed over the CPUs.
        spread = cpus * (cpus - 1) // 2
        totals = sorted(c[0] for c in [*traffic.vips.values(), *traffic.backends.values()])
        assert totals == [n * 1000 * cpus + spread for n in range(1, len(ids) + 1)]
    finally:
        rt.close()
        destroy(instance)
