"""sock_lb's Python mirrors against the BTF of build/sock_lb.bpf.o, mechanically: a key
whose field moved would load fine and never match (STYLE.md, point 2). And the object
loads on this kernel: every hook passes the verifier, and the iter/udp program finds
bpf_sock_destroy and the kernel structs it reads (CO-RE)."""

from __future__ import annotations

import ctypes

import pytest

from xdplb.core import paths
from xdplb.core.btf import Btf, Kind
from xdplb.datapath import sock_lb
from xdplb.datapath.layout import object_btf
from xdplb.datapath.objects import BpfObject

pytestmark = pytest.mark.bpf


@pytest.fixture(scope="module")
def btf() -> Btf:
    return object_btf(paths.bpf_object(sock_lb.OBJECT))


@pytest.mark.parametrize("cls", sock_lb.STRUCTS, ids=lambda c: c.c_name)
def test_struct_matches_the_c_struct(btf: Btf, cls: type[sock_lb.AbiStruct]) -> None:
    t = btf.find(cls.c_name, Kind.STRUCT)
    assert t.size == ctypes.sizeof(cls)
    c_members = [(m.name, m.offset // 8, btf.size(m.type)) for m in t.members]
    py_members = [
        (field[0], getattr(cls, field[0]).offset, ctypes.sizeof(field[1])) for field in cls._fields_
    ]
    assert py_members == c_members


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
