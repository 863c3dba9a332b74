"""xdplb.core.btf against bpftool: every type of the built objects, field by field.

The session table's migration reads old entries through their map's BTF, so the
reader must agree with the kernel's own tool on every kind the objects carry, and its
flattening must give the offsets the compiler chose.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from xdplb.core import abi, paths
from xdplb.core.btf import Btf, BtfError, Kind
from xdplb.datapath import layout

pytestmark = pytest.mark.bpf

OBJECTS = ["lb_xdp", "hc_tc", "host_tc"]


def bpftool_types(path: Path) -> list[dict[str, Any]]:
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        pytest.fail("bpftool is missing (scripts/deps.sh installs it)")
    out = subprocess.run(
        [bpftool, "btf", "dump", "file", str(path), "-j"], capture_output=True, check=True
    )
    types: list[dict[str, Any]] = json.loads(out.stdout)["types"]
    return types


def _name(n: str) -> str:
    return "" if n == "(anon)" else n


def expected(t: dict[str, Any]) -> dict[str, Any]:
    """What our Type should say of bpftool's entry ``t``."""
    kind = Kind[t["kind"]]
    out: dict[str, Any] = {"kind": kind, "name": _name(t["name"])}
    if "size" in t:
        out["size"] = t["size"]
    match kind:
        case Kind.INT:
            enc = {"(none)": 0, "SIGNED": 1, "CHAR": 2, "BOOL": 4}[t["encoding"]]
            out |= {"encoding": enc, "int_offset": t["bits_offset"], "int_bits": t["nr_bits"]}
        case Kind.ARRAY:
            out |= {"ref": t["type_id"], "index_type": t["index_type_id"], "nelems": t["nr_elems"]}
        case Kind.STRUCT | Kind.UNION:
            out["members"] = [
                (_name(m["name"]), m["type_id"], m["bits_offset"], m.get("bitfield_size", 0))
                for m in t["members"]
            ]
        case Kind.ENUM | Kind.ENUM64:
            out["members"] = [(v["name"], v["val"]) for v in t["values"]]
        case Kind.FUNC_PROTO:
            out["ref"] = t["ret_type_id"]
            out["members"] = [(_name(p["name"]), p["type_id"]) for p in t["params"]]
        case Kind.DATASEC:
            out["members"] = [(v["type_id"], v["offset"], v["size"]) for v in t["vars"]]
        case _:
            if "type_id" in t:
                out["ref"] = t["type_id"]
    return out


def ours(btf: Btf, tid: int) -> dict[str, Any]:
    t = btf[tid]
    got: dict[str, Any] = {"kind": t.kind, "name": t.name}
    if t.kind in (Kind.INT, Kind.STRUCT, Kind.UNION, Kind.ENUM, Kind.ENUM64, Kind.DATASEC,
                  Kind.FLOAT):  # fmt: skip
        got["size"] = t.size
    match t.kind:
        case Kind.INT:
            got |= {"encoding": t.encoding, "int_offset": t.int_offset, "int_bits": t.int_bits}
        case Kind.ARRAY:
            got |= {"ref": t.ref, "index_type": t.index_type, "nelems": t.nelems}
        case Kind.STRUCT | Kind.UNION:
            got["members"] = [(m.name, m.type, m.offset, m.bits) for m in t.members]
        case Kind.ENUM | Kind.ENUM64:
            got["members"] = [(m.name, m.offset) for m in t.members]
        case Kind.FUNC_PROTO:
            got["ref"] = t.ref
            got["members"] = [(m.name, m.type) for m in t.members]
        case Kind.DATASEC:
            got["members"] = [(m.type, m.offset, m.bits) for m in t.members]
        case _:
            if t.ref or t.kind in (Kind.PTR, Kind.TYPEDEF, Kind.CONST, Kind.VOLATILE,
                                   Kind.RESTRICT, Kind.FUNC, Kind.VAR, Kind.TYPE_TAG,
                                   Kind.DECL_TAG):  # fmt: skip
                got["ref"] = t.ref
    return got


@pytest.mark.parametrize("name", OBJECTS)
def test_every_type_is_what_bpftool_says(name: str) -> None:
    path = paths.bpf_object(name)
    btf = layout.object_btf(path)
    want = bpftool_types(path)
    assert len(btf.types) == len(want) + 1  # id 0 is void
    for t in want:
        assert ours(btf, t["id"]) == expected(t), f"{name}: type {t['id']} {t['name']}"


def test_sizes_and_flattened_offsets_are_the_compilers() -> None:
    btf = layout.object_btf(paths.bpf_object("lb_xdp"))
    mirrors = {
        "xdplb_conn_set": abi.ConnSet,
        "xdplb_config": abi.Config,
        "xdplb_backend": abi.Backend,
        "xdplb_session": abi.Session,
    }
    for cname, mirror in mirrors.items():
        t = btf.find(cname, Kind.STRUCT)
        assert btf.size(t.id) == ctypes.sizeof(mirror), cname
    fields = {f.name: f for f in btf.fields(btf.find("xdplb_conn_set").id)}
    way, entry = abi.ConnSet.way.offset, ctypes.sizeof(abi.ConnEntry)
    assert (fields["meta.seq"].offset, fields["meta.seq"].size) == (0, 8)
    assert fields["meta.tag[2]"].offset == abi.ConnMeta.tag.offset + 2 * 4
    assert fields["meta.state[3]"].offset == abi.ConnMeta.state.offset + 3
    hop = fields["way[3].hop[1]"]
    assert (hop.offset, hop.size, hop.leaf) == (way + 3 * entry + abi.ConnEntry.hop.offset + 2, 2,
                                                "hop")  # fmt: skip
    assert fields["way[1].src[3]"].offset == way + entry + 12
    # Every byte of the set is in exactly one field, padding included (it is declared).
    covered = sorted((f.offset, f.offset + f.size) for f in fields.values())
    assert covered[0][0] == 0 and covered[-1][1] == ctypes.sizeof(abi.ConnSet)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))


def test_the_layout_version_is_the_objects() -> None:
    assert layout.object_version(paths.bpf_object("lb_xdp")) == abi.ABI_VERSION
    assert layout.object_version(paths.test_object("lb_xdp_abi_next")) == abi.ABI_VERSION + 1
    # host_tc has no enum xdplb_abi: it reads as the legacy layout.
    assert layout.object_version(paths.bpf_object("host_tc")) == paths.LEGACY_LAYOUT


def test_garbage_is_refused() -> None:
    with pytest.raises(BtfError, match="magic"):
        Btf.parse(b"\0" * 64)
    with pytest.raises(BtfError, match="too short"):
        Btf.parse(b"\x9f\xeb")
    raw = bytearray(24)
    raw[0:2] = (0xEB9F).to_bytes(2, "little")
    raw[2] = 1
    raw[4:8] = (24).to_bytes(4, "little")
    raw[12:16] = (99).to_bytes(4, "little")  # a type section past the end
    with pytest.raises(BtfError, match="past the end"):
        Btf.parse(bytes(raw))


#: Kinds the objects above lack: float, forward declaration, volatile, restrict, decl tags,
#: a union, bitfields, an anonymous member (clang 14 emits no ENUM64 nor TYPE_TAG: those
#: are built by hand below).
PROBE = r"""
struct undeclared;
enum big { BIG_SMALL = 1, BIG_TWO = 2 };
struct __attribute__((btf_decl_tag("probe"))) probe {
    volatile unsigned int v;
    float f;
    double d;
    struct undeclared *fwd;
    int *__attribute__((btf_type_tag("user"))) tagged;
    char *restrict r;
    union { unsigned short half[2]; unsigned int word; };
    unsigned int low : 3, high : 5;
    enum big e;
    struct { unsigned char tag[2]; } inner[3];
};
struct probe probe_var;
int probe_fn(struct probe *p __attribute__((btf_decl_tag("arg")))) { return p->low; }
"""


def test_every_kind_of_a_probe(tmp_path: Path) -> None:
    src, obj = tmp_path / "probe.c", tmp_path / "probe.o"
    src.write_text(PROBE)
    clang = shutil.which("clang")
    if clang is None:
        pytest.fail("clang is missing (scripts/deps.sh installs it)")
    subprocess.run([clang, "-O2", "-g", "-target", "bpf", "-c", str(src), "-o", str(obj)],
                   check=True, capture_output=True)  # fmt: skip
    btf = layout.object_btf(obj)
    want = bpftool_types(obj)
    kinds = {Kind[t["kind"]] for t in want}
    assert {Kind.FLOAT, Kind.FWD, Kind.VOLATILE, Kind.RESTRICT, Kind.DECL_TAG, Kind.UNION,
            Kind.FUNC, Kind.VAR, Kind.DATASEC} <= kinds  # fmt: skip
    for t in want:
        if Kind[t["kind"]] is Kind.DECL_TAG:
            assert btf[t["id"]].linkage == t["component_idx"]
        assert ours(btf, t["id"]) == expected(t), f"type {t['id']} {t['name']}"
    assert btf.enum_values("big") == {"BIG_SMALL": 1, "BIG_TWO": 2}
    fields = {f.name: f for f in btf.fields(btf.find("probe", Kind.STRUCT).id)}
    assert fields["half[1]"].offset == fields["word"].offset + 2
    assert fields["inner[2].tag[1]"].offset - fields["inner[0].tag[0]"].offset == 5
    assert (fields["high"].bits, fields["high"].bit_offset) == (5, 3)
    assert fields["f"].kind is Kind.FLOAT and fields["e"].kind is Kind.ENUM
    assert btf.size(btf.find("probe").id) == 64  # 58 bytes of members, aligned to 8


def _raw(types: list[bytes], strings: bytes) -> bytes:
    body = b"".join(types)
    head = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(body), len(body), len(strings))
    return head + body + strings


def test_enum64_and_type_tag_by_hand() -> None:
    strings = b"\0u64\0big\0LARGE\0NEG\0user\0"
    off = {n: strings.index(n.encode() + b"\0") for n in ("u64", "big", "LARGE", "NEG", "user")}
    types = [
        # [1] INT u64: 8 bytes, 64 bits
        struct.pack("<IIII", off["u64"], int(Kind.INT) << 24, 8, 64),
        # [2] ENUM64 big (signed: kind_flag), 2 values
        struct.pack("<III", off["big"], 1 << 31 | int(Kind.ENUM64) << 24 | 2, 8)
        + struct.pack("<III", off["LARGE"], 0, 1)
        + struct.pack("<III", off["NEG"], 0xFFFFFFFE, 0xFFFFFFFF),
        # [3] TYPE_TAG user -> 1; [4] PTR -> 3
        struct.pack("<III", off["user"], int(Kind.TYPE_TAG) << 24, 1),
        struct.pack("<III", 0, int(Kind.PTR) << 24, 3),
    ]
    btf = Btf.parse(_raw(types, strings))
    assert btf.enum_values("big") == {"LARGE": 1 << 32, "NEG": -2}
    assert btf.size(2) == 8 and btf.resolve(3).name == "u64" and btf.size(4) == 8
    assert [f.signed for f in btf.fields(2)] == [True]
