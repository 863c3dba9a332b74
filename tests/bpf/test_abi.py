"""src/xdplb/core/abi.py against the BTF of the built objects, mechanically (STYLE.md, point 2).

A Python mirror that drifts from its C struct does not fail loudly: a key with a
field at the wrong offset simply never matches.  So every struct of
``abi.STRUCTS`` must have the size, member names, member offsets and member
sizes the compiler gave it in ``build/lb_xdp.bpf.o`` (``build/host_tc.bpf.o``
for the host's structs), and every enum value must be the C enumerator's.

Two sources of BTF:
- the objects themselves: the final word, but clang only emits types the
  program reaches through a global, a map definition or a function signature;
- a probe compiled here from ``bpf/include/xdplb_abi.h`` with one global per
  type: every type, so the values are checked even where the object omits them.
"""

from __future__ import annotations

import ctypes
import enum
import json
import platform
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from xdplb.core import abi, paths

pytestmark = pytest.mark.bpf

ROOT = paths.ROOT
BtfTypes = dict[int, dict[str, Any]]

#: Which object must carry each struct (by its C name).
HOST_STRUCTS = {"xdplb_host_config", "xdplb_addr"}
HC_STRUCTS = {"xdplb_hc_target", "xdplb_config"}
LB_STRUCTS = {s.c_name for s in abi.STRUCTS} - {"xdplb_host_config", "xdplb_hc_target"}

#: Python enum -> (C enum name, enumerator prefix, sentinel or None, objects that use it).
ENUMS: dict[type[enum.IntEnum], tuple[str, str, str | None, tuple[str, ...]]] = {
    abi.DropReason: ("xdplb_drop_reason", "XDPLB_DROP_", "XDPLB_DROP__MAX", ("lb_xdp",)),
    abi.Event: ("xdplb_event", "XDPLB_EV_", "XDPLB_EV__MAX", ("lb_xdp",)),
    abi.HostEvent: ("xdplb_host_event", "XDPLB_HOST_", "XDPLB_HOST_EV__MAX", ("host_tc",)),
    abi.HcEvent: ("xdplb_hc_event", "XDPLB_HC_", "XDPLB_HC_EV__MAX", ("hc_tc",)),
    abi.Family: ("xdplb_family", "XDPLB_FAMILY_", None, ()),
    abi.Encap: ("xdplb_encap", "XDPLB_ENCAP_", None, ()),
    abi.TableKind: ("xdplb_table_kind", "XDPLB_TABLE_", None, ()),
    abi.AclList: ("xdplb_acl_list", "XDPLB_ACL_", "XDPLB_ACL__MAX", ()),
    abi.CapDecision: ("xdplb_cap_decision", "XDPLB_CAP_", None, ("lb_xdp",)),
    abi.SessState: ("xdplb_sess_state", "XDPLB_SESS_", "XDPLB_SESS__MAX", ()),
    abi.MemberState: ("xdplb_member_state", "XDPLB_MEMBER_", None, ()),
    abi.ExportType: ("xdplb_export_type", "XDPLB_EXPORT_", None, ()),
}


def btf_types(obj: Path) -> BtfTypes:
    out = subprocess.run(
        ["bpftool", "btf", "dump", "file", str(obj), "-j"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {t["id"]: t for t in json.loads(out)["types"]}


@cache
def object_btf(name: str) -> BtfTypes:
    return btf_types(paths.bpf_object(name))


def find(types: BtfTypes, kinds: tuple[str, ...], name: str) -> dict[str, Any] | None:
    for t in types.values():
        if t["kind"] in kinds and t["name"] == name:
            return t
    return None


def type_size(types: BtfTypes, type_id: int) -> int:
    """sizeof() of a BTF type, through typedefs, qualifiers and arrays."""
    t = types[type_id]
    kind = t["kind"]
    if kind in ("TYPEDEF", "CONST", "VOLATILE", "RESTRICT", "TYPE_TAG"):
        return type_size(types, t["type_id"])
    if kind == "ARRAY":
        return int(t["nr_elems"]) * type_size(types, t["type_id"])
    if kind == "PTR":
        return 8
    return int(t["size"])


def layout_of_btf(types: BtfTypes, struct: dict[str, Any]) -> dict[str, Any]:
    return {
        "size": struct["size"],
        "members": [
            (mem["name"], mem["bits_offset"] // 8, type_size(types, mem["type_id"]))
            for mem in struct["members"]
        ],
    }


def layout_of_ctypes(cls: type[ctypes.Structure]) -> dict[str, Any]:
    members = []
    for name, *_ in cls._fields_:
        desc = getattr(cls, name)
        members.append((name, desc.offset, desc.size))
    return {"size": ctypes.sizeof(cls), "members": members}


def enum_of_btf(t: dict[str, Any], prefix: str, sentinel: str | None) -> dict[str, int]:
    values = {v["name"]: int(v["val"]) for v in t["values"]}
    out = {}
    for cname, val in values.items():
        assert cname.startswith(prefix), f"enum {t['name']}: {cname} lacks prefix {prefix}"
        if cname == sentinel:
            continue
        out[cname.removeprefix(prefix)] = val
    if sentinel is not None:
        # Counter arrays are sized by the sentinel: it must follow the last reason.
        assert values.get(sentinel) == len(out), f"{sentinel} != number of enumerators"
    return out


def enum_of_python(cls: type[enum.IntEnum]) -> dict[str, int]:
    return {member.name: int(member) for member in cls}


# --- the probe: every ABI type, straight from the header ------------------------------------

PROBE = r"""
#include <linux/types.h>
#include "xdplb_abi.h"

/* One global per type so that clang emits BTF for each. */
%s
char LICENSE[] __attribute__((section("license"), used)) = "Dual BSD/GPL";
"""


@pytest.fixture(scope="module")
def probe_btf(tmp_path_factory: pytest.TempPathFactory) -> BtfTypes:
    clang = shutil.which("clang") or "clang"
    decls = [f"struct {s.c_name} probe_{s.c_name};" for s in abi.STRUCTS]
    decls += [f"enum {c_name} probe_{c_name};" for c_name, *_ in ENUMS.values()]
    decls.append("enum xdplb_abi probe_xdplb_abi;")  # the layout version
    tmp = tmp_path_factory.mktemp("abi")
    src = tmp / "probe.bpf.c"
    src.write_text(PROBE % "\n".join(decls))
    obj = tmp / "probe.bpf.o"
    arch_inc = f"/usr/include/{platform.machine()}-linux-gnu"
    subprocess.run(
        [clang, "-O2", "-g", "-target", "bpf", f"-I{arch_inc}", f"-I{ROOT / 'bpf/include'}",
         "-c", str(src), "-o", str(obj)],
        check=True,
    )  # fmt: skip
    return btf_types(obj)


# --- structs ------------------------------------------------------------------------------


def struct_ids() -> list[str]:
    return [s.c_name for s in abi.STRUCTS]


def objects_for(c_name: str) -> list[str]:
    objs = []
    if c_name in LB_STRUCTS:
        objs.append("lb_xdp")
    if c_name in HOST_STRUCTS:
        objs.append("host_tc")
    if c_name in HC_STRUCTS:
        objs.append("hc_tc")
    return objs


@pytest.mark.parametrize("cls", abi.STRUCTS, ids=struct_ids())
def test_struct_matches_header(cls: type[abi.AbiStruct], probe_btf: BtfTypes) -> None:
    t = find(probe_btf, ("STRUCT",), cls.c_name)
    assert t is not None, f"struct {cls.c_name} is not in xdplb_abi.h"
    assert layout_of_ctypes(cls) == layout_of_btf(probe_btf, t)


@pytest.mark.parametrize("cls", abi.STRUCTS, ids=struct_ids())
def test_struct_matches_object(cls: type[abi.AbiStruct]) -> None:
    for obj in objects_for(cls.c_name):
        types = object_btf(obj)
        t = find(types, ("STRUCT",), cls.c_name)
        assert t is not None, (
            f"struct {cls.c_name} is not in the BTF of {obj}.bpf.o: the program reaches it "
            "only through inlined code, so its layout cannot be checked against the object"
        )
        assert layout_of_ctypes(cls) == layout_of_btf(types, t), obj


def test_every_header_struct_is_mirrored() -> None:
    """A struct added to the header without a Python twin is caught here."""
    header = ROOT / "bpf/include/xdplb_abi.h"

    c_structs = set(re.findall(r"^struct (xdplb_\w+) \{", header.read_text(), re.M))
    assert c_structs == {s.c_name for s in abi.STRUCTS}


# --- enums --------------------------------------------------------------------------------


def enum_ids() -> list[str]:
    return [cls.__name__ for cls in ENUMS]


@pytest.mark.parametrize("cls", list(ENUMS), ids=enum_ids())
def test_enum_matches_header(cls: type[enum.IntEnum], probe_btf: BtfTypes) -> None:
    c_name, prefix, sentinel, _objs = ENUMS[cls]
    t = find(probe_btf, ("ENUM", "ENUM64"), c_name)
    assert t is not None, f"enum {c_name} is not in xdplb_abi.h"
    assert enum_of_python(cls) == enum_of_btf(t, prefix, sentinel)


@pytest.mark.parametrize("cls", [c for c, v in ENUMS.items() if v[3]], ids=lambda c: c.__name__)
def test_enum_matches_object(cls: type[enum.IntEnum]) -> None:
    c_name, prefix, sentinel, objs = ENUMS[cls]
    for obj in objs:
        types = object_btf(obj)
        t = find(types, ("ENUM", "ENUM64"), c_name)
        assert t is not None, (
            f"enum {c_name} is not in the BTF of {obj}.bpf.o (counters are indexed by a "
            "plain __u32, so no BTF type refers to it)"
        )
        assert enum_of_python(cls) == enum_of_btf(t, prefix, sentinel), obj


def test_counter_maps_are_sized_by_the_enums() -> None:
    """lb_drops / lb_events have one slot per enumerator (max_entries in the map BTF)."""
    types = object_btf("lb_xdp")
    sizes = {}
    for t in types.values():
        if t["kind"] == "VAR" and t["name"] in ("lb_drops", "lb_events"):
            struct = types[t["type_id"]]
            for mem in struct["members"]:
                if mem["name"] == "max_entries":
                    # __uint(max_entries, N) is an int (*)[N]: the array's length is N.
                    sizes[t["name"]] = types[types[mem["type_id"]]["type_id"]]["nr_elems"]
    assert sizes == {"lb_drops": len(abi.DropReason), "lb_events": len(abi.Event)}


def test_hc_counter_map_is_sized_by_the_enum() -> None:
    """hc_events has one slot per enumerator of enum xdplb_hc_event."""
    types = object_btf("hc_tc")
    sizes = []
    for t in types.values():
        if t["kind"] == "VAR" and t["name"] == "hc_events":
            for mem in types[t["type_id"]]["members"]:
                if mem["name"] == "max_entries":
                    sizes.append(types[types[mem["type_id"]]["type_id"]]["nr_elems"])
    assert sizes == [len(abi.HcEvent)]


def test_capture_defines_match_header() -> None:
    """The capture points and sizes are #defines: no BTF carries them, so read the header."""
    header = (ROOT / "bpf/include/xdplb_abi.h").read_text()
    values = {}
    for name, shift, plain in re.findall(
        r"^#define (XDPLB_CAP_\w+)\s+(?:\(1U << (\d+)\)|(\d+))", header, re.M
    ):
        values[name] = 1 << int(shift) if shift else int(plain)
    assert values == {
        "XDPLB_CAP_DROP": abi.CAP_DROP,
        "XDPLB_CAP_FORWARD": abi.CAP_FORWARD,
        "XDPLB_CAP_PASS": abi.CAP_PASS,
        "XDPLB_CAP_SNAP_MAX": abi.CAP_SNAP_MAX,
        "XDPLB_CAP_RING_SIZE": abi.CAP_RING_SIZE,
    }
    assert {p.name: int(p) for p in abi.CapPoint} == {"DROP": 1, "FORWARD": 2, "PASS": 4}


def test_abi_version_matches_header(probe_btf: BtfTypes) -> None:
    """``abi.ABI_VERSION`` is ``enum xdplb_abi``'s XDPLB_ABI_VERSION: the pin directory
    (abi-<N>) and the migration read it from Python, the maps' layout from C."""
    t = find(probe_btf, ("ENUM", "ENUM64"), "xdplb_abi")
    assert t is not None, "enum xdplb_abi is not in xdplb_abi.h"
    assert {v["name"]: int(v["val"]) for v in t["values"]} == {"XDPLB_ABI_VERSION": abi.ABI_VERSION}


def test_session_table_structs_are_the_layout_lb_conns_and_export_use() -> None:
    """What the session table's users rely on beyond offsets: a set is a metadata line
    and one line per way, a session record is 72 bytes and an export record 88 (the
    ring's capacity in records follows), and lb_conns / lb_sess_export / lb_vip_index
    in the object hold exactly these types."""
    assert ctypes.sizeof(abi.ConnMeta) == ctypes.sizeof(abi.ConnEntry) == 64
    assert ctypes.sizeof(abi.ConnSet) == 64 * (1 + abi.CONN_WAYS)
    assert ctypes.sizeof(abi.Session) == 72
    assert ctypes.sizeof(abi.ExportRec) == 88
    assert abi.Session.entry.offset == 8 and abi.ExportRec.sess.offset == 16
    types = object_btf("lb_xdp")
    values = {}
    for t in types.values():
        if t["kind"] == "VAR" and t["name"] in ("lb_conns", "lb_vip_index"):
            for mem in types[t["type_id"]]["members"]:
                if mem["name"] == "value":
                    values[t["name"]] = types[types[mem["type_id"]]["type_id"]]["name"]
    assert values == {"lb_conns": "xdplb_conn_set", "lb_vip_index": "xdplb_vip_slot"}


def test_session_defines_match_header() -> None:
    """The session table's, the export ring's, the member states' and the VIP filter's
    #defines: no BTF carries them, so read the header."""
    header = (ROOT / "bpf/include/xdplb_abi.h").read_text()
    values = {
        m.group(1): m.group(2).strip()
        for m in re.finditer(r"^#define (XDPLB_\w+)\s+(.+?)\s*(?:/\*.*)?$", header, re.M)
    }
    want = {
        "XDPLB_CONN_WAYS": abi.CONN_WAYS,
        "XDPLB_CONN_ENTRIES": abi.CONN_ENTRIES,
        "XDPLB_SESS_F_USED": abi.SESS_F_USED,
        "XDPLB_SESS_F_IMPORTED": abi.SESS_F_IMPORTED,
        "XDPLB_CFG_F_EXPORT": abi.CFG_F_EXPORT,
        "XDPLB_EXPORT_RING_SIZE": abi.EXPORT_RING_SIZE,
        "XDPLB_MEMBERS_PER_WORD": abi.MEMBERS_PER_WORD,
        "XDPLB_VIP_FILTER_BITS": abi.VIP_FILTER_BITS,
        "XDPLB_VIP_PROBES": abi.VIP_PROBES,
    }
    got = {name: _c_int(values[name]) for name in want}
    assert got == want
    assert abi.VIP_FILTER_WORDS == (1 << abi.VIP_FILTER_BITS) // 64


def _c_int(expr: str) -> int:
    """The value of a header's integer #define: ``N``, ``NU``, ``(NU << S)``."""
    m = re.fullmatch(r"\(?(\d+)U?(?: << (\d+))?\)?", expr)
    assert m is not None, f"not a plain integer define: {expr}"
    return int(m.group(1)) << int(m.group(2) or 0)
