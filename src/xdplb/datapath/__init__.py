"""The datapath layer: the only xdplb code that makes bpf syscalls (libbpf via cffi).

- objects: BpfObject (open + pin-aware load of a .bpf.o, LoadError with verifier log)
- programs / testrun: Program handles and BPF_PROG_TEST_RUN
- maps: Map handles, element/iteration/batch operations, MapType, flags
- links: XDP bpf_link attach, TC clsact attach/detach
- lb, conns: lb_xdp's maps, snapshots, plan application, the connection table
- host, hc, live: host_tc on a backend, the health-check tunnel, XDP live frames

It speaks only the plain vocabulary of :mod:`xdplb.core` (state, map operations, limits),
so the kernel layer never depends on the configuration or the planner.

May import: core.
"""

from xdplb.datapath.links import (
    Link,
    XdpMode,
    attach_xdp,
    tc_attach,
    tc_detach,
    tc_hook_destroy,
    tc_query,
)
from xdplb.datapath.maps import (
    BPF_ANY,
    BPF_EXIST,
    BPF_F_INNER_MAP,
    BPF_F_LOCK,
    BPF_F_MMAPABLE,
    BPF_F_NO_PREALLOC,
    BPF_F_RDONLY_PROG,
    BPF_F_WRONLY_PROG,
    BPF_NOEXIST,
    Map,
    MapType,
    possible_cpus,
)
from xdplb.datapath.objects import BpfObject
from xdplb.datapath.programs import Program
from xdplb.datapath.testrun import TestRunResult

__all__ = [
    "BPF_ANY",
    "BPF_EXIST",
    "BPF_F_INNER_MAP",
    "BPF_F_LOCK",
    "BPF_F_MMAPABLE",
    "BPF_F_NO_PREALLOC",
    "BPF_F_RDONLY_PROG",
    "BPF_F_WRONLY_PROG",
    "BPF_NOEXIST",
    "BpfObject",
    "Link",
    "Map",
    "MapType",
    "Program",
    "TestRunResult",
    "XdpMode",
    "attach_xdp",
    "possible_cpus",
    "tc_attach",
    "tc_detach",
    "tc_hook_destroy",
    "tc_query",
]
