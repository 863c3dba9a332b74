"""sock_lb's Python mirrors against the BTF of build/sock_lb.bpf.o, mechanically: a key
whose field moved would load fine and never match (STYLE.md, point 2). And the object
loads on this kernel: every hook passes the verifier, and the iter/udp program finds
bpf_sock_destroy and the kernel structs it reads (CO-RE)."""

from __future__ import annotations

import pytest

from xdplb.core import paths
from xdplb.core.abi import AbiStruct
from xdplb.core.btf import Btf
from xdplb.datapath import sock_lb
from xdplb.datapath.layout import object_btf
from xdplb.datapath.objects import BpfObject

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def btf() -> Btf:
    return object_btf(paths.bpf_object(sock_lb.OBJECT))


@pytest.mark.parametrize("cls", sock_lb.STRUCTS, ids=lambda c: c.c_name)
def test_struct_matches_the_c_struct(btf: Btf, cls: type[AbiStruct]) -> None:
    assert cls.layout() == btf.struct_layout(cls.c_name)


def test_events_match_the_c_enum(btf: Btf) -> None:
    values = btf.enum_values("socklb_event")
    assert values.pop("SOCKLB_EV__MAX") == len(sock_lb.SockLbEvent)
    assert {k.removeprefix("SOCKLB_EV_"): v for k, v in values.items()} == {
        e.name: e.value for e in sock_lb.SockLbEvent
    }


def test_the_object_loads_with_the_sizes_python_assumes() -> None:
    with BpfObject.load(paths.bpf_object(sock_lb.OBJECT)) as obj:
        assert obj.map("socklb_services").max_entries == sock_lb.MAX_SERVICES
        assert obj.map("socklb_backends").max_entries == sock_lb.MAX_BACKENDS
        assert obj.map("socklb_events").max_entries == len(sock_lb.SockLbEvent)
        names = {name for name, _ in sock_lb.HOOKS} | {sock_lb.DESTROY_PROGRAM}
        assert set(obj.programs) == names
