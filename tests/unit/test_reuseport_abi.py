"""host_reuseport's Python mirrors against the BTF of build/host_reuseport.bpf.o,
mechanically: a flow key whose field moved would load fine and never match, and a state
field that moved would steer traffic by the wrong slot (STYLE.md, point 2). Reading an
object file's BTF needs neither root nor a kernel."""

from __future__ import annotations

import pytest

from xdplb.core import paths
from xdplb.core.abi import AbiStruct
from xdplb.core.btf import Btf
from xdplb.datapath.layout import object_btf
from xdplb.sockets import reuseport

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def btf() -> Btf:
    return object_btf(paths.bpf_object(reuseport.OBJECT))


@pytest.mark.parametrize("cls", reuseport.STRUCTS, ids=lambda c: c.c_name)
def test_struct_matches_the_c_struct(btf: Btf, cls: type[AbiStruct]) -> None:
    assert cls.layout() == btf.struct_layout(cls.c_name)


def test_events_match_the_c_enum(btf: Btf) -> None:
    values = btf.enum_values("rp_event")
    assert values.pop("RP_EV__MAX") == len(reuseport.ReuseportEvent)
    assert {k.removeprefix("RP_EV_"): v for k, v in values.items()} == {
        e.name: e.value for e in reuseport.ReuseportEvent
    }


def test_slot_states_match_the_c_enum(btf: Btf) -> None:
    values = btf.enum_values("rp_slot_state")
    assert {k.removeprefix("RP_SLOT_"): v for k, v in values.items()} == {
        s.name: s.value for s in reuseport.SlotState
    }


def test_the_state_has_one_slot_per_generation_the_library_counts() -> None:
    assert len(reuseport.StateValue().slots) == reuseport.SLOTS
