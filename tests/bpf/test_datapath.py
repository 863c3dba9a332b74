"""xdplb.datapath against the kernel: load, test_run, maps, map-in-map, pins, attach.

Runs as root. Objects come from tests/bpf/progs (built by `make build`). Every pin
lives under /sys/fs/bpf/xdplb-test-<pid>-*, every namespace is xdplbt-<pid>-*, and
both are removed whatever happens.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy
import pytest

from xdplb.core import paths
from xdplb.core.errors import BpfError, LoadError
from xdplb.datapath import (
    BPF_ANY,
    BPF_EXIST,
    BPF_F_INNER_MAP,
    BPF_NOEXIST,
    BpfObject,
    Link,
    Map,
    MapType,
    Program,
    XdpMode,
    attach_xdp,
    possible_cpus,
    tc_attach,
    tc_detach,
    tc_query,
)
from xdplb.lab import netns

pytestmark = pytest.mark.bpf

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX = 0, 1, 2, 3
TC_ACT_OK = 0


# dst 02:..:01, src 02:..:02, IPv4 ethertype, then payload: enough for any program here.
PACKET = bytes.fromhex("02 00 00 00 00 01  02 00 00 00 00 02  08 00") + bytes(range(50))


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def pin_dir(tag: str) -> Path:
    return Path(f"/sys/fs/bpf/xdplb-test-{os.getpid()}-{tag}")


def load_test_object(pin_root: Path) -> BpfObject:
    path = paths.test_object("binding_test")
    assert path.exists(), f"{path} is missing: run `make build`"
    return BpfObject.load(path, pin_root=pin_root)


@pytest.fixture(scope="module")
def obj() -> Iterator[BpfObject]:
    # Always a private pin_root: without one, LIBBPF_PIN_BY_NAME pins to /sys/fs/bpf.
    root = pin_dir("obj")
    try:
        with load_test_object(root) as o:
            yield o
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- network namespaces -------------------------------------------------------------


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


@contextmanager
def veth_netns(tag: str) -> Iterator[tuple[str, int, int]]:
    """A fresh netns holding veth0 <-> veth1, both up; this thread runs inside it.

    Yields (netns name, ifindex of veth0, ifindex of veth1)."""
    name = f"xdplbt-{os.getpid()}-{tag}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "add", "veth0", "type", "veth", "peer", "name", "veth1")
        ip("-n", name, "link", "set", "veth0", "up")
        ip("-n", name, "link", "set", "veth1", "up")
        with netns.enter(name):
            yield name, socket.if_nametoindex("veth0"), socket.if_nametoindex("veth1")
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def xdp_prog_id(netns: str, dev: str) -> int:
    """The XDP program id on ``dev`` as netlink reports it (0 if none)."""
    (link,) = json.loads(ip("-n", netns, "-j", "-d", "link", "show", "dev", dev))
    return int(link.get("xdp", {}).get("prog", {}).get("id", 0))


# -- test_run ------------------------------------------------------------------------


def test_xdp_swap_macs_returns_tx(obj: BpfObject) -> None:
    res = obj.program("xdp_swap_tx").test_run(PACKET)
    assert res.retval == XDP_TX
    assert res.data == PACKET[6:12] + PACKET[0:6] + PACKET[12:]
    assert res.duration_ns >= 0


def test_xdp_adjust_head_grows_packet(obj: BpfObject) -> None:
    res = obj.program("xdp_grow").test_run(PACKET)
    assert res.retval == XDP_TX
    assert res.data == b"\xde\xad\xbe\xef" + PACKET


def test_output_buffer_too_small_is_enospc(obj: BpfObject) -> None:
    with pytest.raises(BpfError) as err:
        obj.program("xdp_grow").test_run(PACKET, data_size_out=len(PACKET))
    assert err.value.errno == errno.ENOSPC


def test_tc_program_test_run(obj: BpfObject) -> None:
    prog = obj.program("tc_pass")
    assert prog.test_run(PACKET).retval == TC_ACT_OK


def test_percpu_counter_moved_by_test_run(obj: BpfObject) -> None:
    counters = obj.map("bt_counters")
    assert counters.type is MapType.PERCPU_ARRAY
    counters.update(u32(0), bytes(8 * possible_cpus()))
    obj.program("xdp_pass").test_run(PACKET, repeat=100)
    obj.program("xdp_pass").test_run(PACKET)
    per_cpu = counters.lookup_percpu(u32(0))
    assert len(per_cpu) == possible_cpus()
    assert sum(struct.unpack("<Q", v)[0] for v in per_cpu) == 101


# -- maps ----------------------------------------------------------------------------


def test_hash_map_element_ops(obj: BpfObject) -> None:
    m = obj.map("bt_hash")
    assert (m.type, m.key_size, m.value_size, m.max_entries) == (MapType.HASH, 4, 8, 1024)
    for key in list(m.keys()):
        m.delete(key)

    assert m.lookup(u32(7)) is None
    m.update(u32(7), u64(49))
    assert m.lookup(u32(7)) == u64(49)
    with pytest.raises(BpfError) as err:
        m.update(u32(7), u64(0), BPF_NOEXIST)
    assert err.value.errno == errno.EEXIST
    with pytest.raises(BpfError) as err:
        m.update(u32(8), u64(0), BPF_EXIST)
    assert err.value.errno == errno.ENOENT
    m.update(u32(7), u64(50), BPF_EXIST)
    m.update(u32(8), u64(64), BPF_ANY)

    assert sorted(m.keys()) == sorted([u32(7), u32(8)])
    assert sorted(m) == sorted(m.keys())
    assert dict(m.items()) == {u32(7): u64(50), u32(8): u64(64)}
    assert m.delete(u32(7)) is True
    assert m.delete(u32(7)) is False
    assert list(m.keys()) == [u32(8)]

    with pytest.raises(ValueError, match="key is 2 bytes, want 4"):
        m.lookup(b"\0\0")


def test_hash_map_batches_take_numpy(obj: BpfObject) -> None:
    m = obj.map("bt_hash")
    for key in list(m.keys()):
        m.delete(key)
    keys = numpy.arange(100, 400, dtype=numpy.uint32)
    values = keys.astype(numpy.uint64) * 3
    m.update_batch(keys, values, len(keys))
    assert m.lookup(u32(123)) == u64(369)

    kbytes, vbytes, count = m.lookup_batch()
    assert count == 300
    got = dict(
        zip(
            numpy.frombuffer(kbytes, numpy.uint32).tolist(),
            numpy.frombuffer(vbytes, numpy.uint64).tolist(),
            strict=True,
        )
    )
    assert got == {k: 3 * k for k in range(100, 400)}


def test_update_array_writes_the_whole_array(obj: BpfObject) -> None:
    """Its speed is bench.py's business (table push); here, what it writes."""
    table = obj.map("bt_table")
    assert table.max_entries == 65537
    values = numpy.arange(65537, dtype=numpy.uint64) * 7
    table.update_array(values)
    assert numpy.array_equal(numpy.frombuffer(table.lookup_array(), numpy.uint64), values)
    assert table.lookup(u32(65536)) == u64(65536 * 7)
    with pytest.raises(ValueError):
        table.update_array(bytes(12))


def test_map_create_pin_and_reopen() -> None:
    root = pin_dir("reopen")
    root.mkdir(parents=True)
    try:
        with Map.create(MapType.LRU_HASH, 4, 4, 8, name="bt_created") as m:
            assert (m.type, m.name, m.max_entries) == (MapType.LRU_HASH, "bt_created", 8)
            m.update(u32(1), u32(11))
            m.pin(root / "m")
            with Map.from_pinned(root / "m") as again, Map.from_id(m.id) as by_id:
                assert again.id == by_id.id == m.id
                assert again.lookup(u32(1)) == by_id.lookup(u32(1)) == u32(11)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_closed_map_raises_ebadf_and_close_is_idempotent() -> None:
    m = Map.create(MapType.ARRAY, 4, 4, 1)
    m.close()
    m.close()
    with pytest.raises(BpfError) as err:
        m.lookup(u32(0))
    assert err.value.errno == errno.EBADF


def test_map_in_map_inner_bigger_than_template(obj: BpfObject) -> None:
    outer = obj.map("bt_outer")
    assert outer.type is MapType.ARRAY_OF_MAPS
    # The template has max_entries 1; BPF_F_INNER_MAP lets this 16-entry table in.
    with Map.create(MapType.ARRAY, 4, 4, 16, name="bt_inner16", flags=BPF_F_INNER_MAP) as inner:
        inner.update(u32(10), u32(0xABCDEF01))
        outer.update(u32(0), u32(inner.fd))
        assert outer.lookup(u32(0)) == u32(inner.id)
        res = obj.program("xdp_inner").test_run(PACKET)
        assert res.retval == XDP_TX
        assert res.data == u32(0xABCDEF01) + PACKET[4:]

    # Same shape but no BPF_F_INNER_MAP: flags differ from the template.
    with Map.create(MapType.ARRAY, 4, 4, 16) as other, pytest.raises(BpfError) as err:
        outer.update(u32(1), u32(other.fd))
    assert err.value.errno == errno.EINVAL
    outer.delete(u32(0))


# -- objects -------------------------------------------------------------------------


def test_pin_root_reuses_maps_across_loads() -> None:
    root = pin_dir("reuse")
    try:
        with load_test_object(root) as first:
            first.map("bt_pinned").update(u32(1), u64(XDP_PASS))
            first_id = first.map("bt_pinned").id
        assert (root / "bt_pinned").exists()
        with load_test_object(root) as second:
            assert second.map("bt_pinned").id == first_id
            assert second.map("bt_pinned").lookup(u32(1)) == u64(XDP_PASS)
            assert second.program("xdp_pinned").test_run(PACKET).retval == XDP_PASS
            assert second.map("bt_hash").id != first_id  # unpinned maps are fresh
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_no_pin_root_pins_nothing() -> None:
    """Without a pin root libbpf would pin LIBBPF_PIN_BY_NAME maps in /sys/fs/bpf itself,
    and the next such load would silently share them."""
    bpffs = Path("/sys/fs/bpf")
    before = set(bpffs.iterdir())
    with BpfObject.load(paths.test_object("binding_test")) as first:
        first.map("bt_pinned").update(u32(1), u64(XDP_PASS))
        assert set(bpffs.iterdir()) == before
        with BpfObject.load(paths.test_object("binding_test")) as second:
            assert second.map("bt_pinned").id != first.map("bt_pinned").id
            assert second.map("bt_pinned").lookup(u32(1)) is None


def test_verifier_rejection_raises_load_error_with_log() -> None:
    path = paths.test_object("binding_bad")
    assert path.exists(), f"{path} is missing: run `make build`"
    with pytest.raises(LoadError) as err:
        BpfObject.load(path)
    assert err.value.errno == errno.EACCES
    assert "invalid access to packet" in err.value.log
    assert "xdp_unchecked" in err.value.log


def test_missing_object_file_raises_load_error() -> None:
    with pytest.raises(LoadError) as err:
        BpfObject.load("/nonexistent/nothing.bpf.o")
    assert err.value.errno == errno.ENOENT


def test_program_pin_and_reopen(obj: BpfObject) -> None:
    root = pin_dir("prog")
    root.mkdir(parents=True)
    try:
        prog = obj.program("xdp_swap_tx")
        prog.pin(root / "p")
        with Program.from_pinned(root / "p") as again:
            assert again.id == prog.id
            assert again.name == "xdp_swap_tx"
            assert again.test_run(PACKET).retval == XDP_TX
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- attaching -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [XdpMode.NATIVE, XdpMode.GENERIC], ids=lambda m: m.name)
def test_xdp_link_attach_pin_update_detach(obj: BpfObject, mode: XdpMode) -> None:
    passer, dropper = obj.program("xdp_pass"), obj.program("xdp_drop")
    root = pin_dir(f"link-{mode.name}")
    root.mkdir(parents=True)
    try:
        with veth_netns(mode.name.lower()) as (ns, veth0, _):
            # test_run with a real ingress device (resolved in this netns).
            assert passer.test_run(PACKET, ingress_ifindex=veth0).retval == XDP_PASS

            link = attach_xdp(passer, veth0, mode)
            assert xdp_prog_id(ns, "veth0") == passer.id == link.prog_id
            link.pin(root / "link")
            link.close()  # the pin keeps it attached
            assert xdp_prog_id(ns, "veth0") == passer.id

            with Link.from_pinned(root / "link") as again:
                again.update_program(dropper)
                assert xdp_prog_id(ns, "veth0") == dropper.id
                with pytest.raises(BpfError) as err:  # one XDP program per device
                    attach_xdp(passer, veth0, mode)
                assert err.value.errno in (errno.EBUSY, errno.EEXIST)
                again.detach()
                assert xdp_prog_id(ns, "veth0") == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_tc_attach_and_detach(obj: BpfObject) -> None:
    prog = obj.program("tc_pass")
    with veth_netns("tc") as (_, veth0, _):
        assert tc_query(veth0) is None
        tc_attach(prog, veth0)
        tc_attach(prog, veth0)  # replace in place; clsact already there is fine
        assert tc_query(veth0) == prog.id
        tc_attach(prog, veth0, ingress=False, priority=2, handle=2)
        assert tc_query(veth0, ingress=False, priority=2, handle=2) == prog.id

        tc_detach(veth0)
        assert tc_query(veth0) is None
        assert tc_query(veth0, ingress=False, priority=2, handle=2) == prog.id
        tc_detach(veth0, ingress=False, priority=2, handle=2)
        with pytest.raises(BpfError) as err:
            tc_detach(veth0)
        assert err.value.errno == errno.ENOENT
