"""Host paths found at run time: the cgroup v2 mount, which depends on the host's layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from xdplb.core import paths
from xdplb.core.errors import XdplbError

pytestmark = pytest.mark.unit

#: systemd's unified layout (Debian 12's default): cgroup v2 is /sys/fs/cgroup itself.
UNIFIED = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0
bpf /sys/fs/bpf bpf rw,nosuid,nodev,noexec,relatime,mode=700 0 0
"""
#: The hybrid layout: v1 controllers under /sys/fs/cgroup, v2 beside them.
HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
#: v1 only.
LEGACY = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
"""


@pytest.mark.parametrize(
    ("table", "root"),
    [(UNIFIED, "/sys/fs/cgroup"), (HYBRID, "/sys/fs/cgroup/unified")],
    ids=["unified", "hybrid"],
)
def test_the_cgroup2_mount_is_found_in_either_layout(tmp_path: Path, table: str, root: str) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(table)
    assert paths.cgroup2_root(mounts) == Path(root)


def test_no_cgroup2_mount_is_a_clear_error(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(LEGACY)
    with pytest.raises(XdplbError, match="no cgroup v2 hierarchy"):
        paths.cgroup2_root(mounts)


def test_this_hosts_mount_is_a_cgroup2_directory() -> None:
    assert (paths.cgroup2_root() / "cgroup.procs").exists()
