"""BTF, the kernel's type format, read in pure Python: enough to lay out a map's value.

A pinned map whose layout this xdplb does not know (an older or newer release's) is
still described by its BTF: the kernel keeps the type information of the object that
created it (``bpf_map_info.btf_id``, ``btf_value_type_id``). :class:`Btf` parses the raw
bytes libbpf hands out (``btf__raw_data``: header, type section, string section; see
the kernel's Documentation/bpf/btf.rst), and :meth:`Btf.fields` flattens a struct into
named scalar fields with their byte offsets (``meta.tag[2]``, ``way[3].hop[1]``), which
is what the session-table migration (:mod:`xdplb.datapath.upgrade`) reads entries by.

The bytes come from :mod:`xdplb.datapath` (libbpf); nothing here makes a syscall.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from xdplb.core.errors import XdplbError

BTF_MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")  # magic, version, flags, hdr_len, type/str off+len
_TYPE = struct.Struct("<III")  # name_off, info, size_or_type
_U32 = struct.Struct("<I")


class BtfError(XdplbError):
    """Bytes that are not BTF, or a type that is not what was asked for."""


class Kind(enum.IntEnum):
    """``BTF_KIND_*`` (include/uapi/linux/btf.h)."""

    UNKN = 0
    INT = 1
    PTR = 2
    ARRAY = 3
    STRUCT = 4
    UNION = 5
    ENUM = 6
    FWD = 7
    TYPEDEF = 8
    VOLATILE = 9
    CONST = 10
    RESTRICT = 11
    FUNC = 12
    FUNC_PROTO = 13
    VAR = 14
    DATASEC = 15
    FLOAT = 16
    DECL_TAG = 17
    TYPE_TAG = 18
    ENUM64 = 19


#: Kinds that only qualify or rename another type: what :meth:`Btf.resolve` skips.
_MODIFIERS = frozenset({Kind.TYPEDEF, Kind.VOLATILE, Kind.CONST, Kind.RESTRICT, Kind.TYPE_TAG})
#: Kinds whose third word is a size, not a type id.
_SIZED = frozenset({Kind.INT, Kind.STRUCT, Kind.UNION, Kind.ENUM, Kind.DATASEC, Kind.FLOAT,
                    Kind.ENUM64})  # fmt: skip

INT_SIGNED = 1 << 0
INT_CHAR = 1 << 1
INT_BOOL = 1 << 2


@dataclass(frozen=True)
class Member:
    """A member of a struct or union (``struct btf_member``), an enum value, a function
    parameter or a section's variable: whichever the owning kind has."""

    name: str
    type: int
    #: STRUCT/UNION: offset in bits; DATASEC: offset in bytes; ENUM/ENUM64: the value.
    offset: int = 0
    #: STRUCT/UNION with kind_flag: bitfield size in bits (0: not a bitfield);
    #: DATASEC: the variable's size in bytes.
    bits: int = 0


@dataclass(frozen=True)
class Type:
    """One BTF type (``struct btf_type`` and what follows it)."""

    id: int
    kind: Kind
    name: str
    #: Size in bytes (INT, STRUCT, UNION, ENUM, ENUM64, DATASEC, FLOAT), else 0.
    size: int = 0
    #: The type this one refers to (PTR, TYPEDEF, modifiers, FUNC, VAR, DECL_TAG,
    #: FUNC_PROTO's return type, ARRAY's element type), else 0.
    ref: int = 0
    kind_flag: bool = False
    members: tuple[Member, ...] = ()
    #: ARRAY: element count and index type.
    nelems: int = 0
    index_type: int = 0
    #: INT: encoding (INT_SIGNED, INT_CHAR, INT_BOOL), bit offset and bits.
    encoding: int = 0
    int_offset: int = 0
    int_bits: int = 0
    #: VAR: linkage; FUNC: linkage (vlen); DECL_TAG: component index (-1: the type).
    linkage: int = 0


@dataclass(frozen=True)
class Field:
    """A scalar inside a flattened struct: its path, where it lies, what it holds."""

    path: tuple[str | int, ...]
    """Member names and array indices from the outer struct: ``("way", 3, "hop", 1)``."""
    offset: int
    """Bytes from the start of the outer struct."""
    size: int
    """Bytes (a bitfield: the bytes holding it, see ``bits``)."""
    signed: bool = False
    kind: Kind = Kind.INT
    bits: int = 0
    """A bitfield's width (0: not a bitfield); ``bit_offset`` its offset in bits."""
    bit_offset: int = 0

    @property
    def name(self) -> str:
        """The path as C would write it: ``way[3].hop[1]``."""
        return path_name(self.path)

    @property
    def leaf(self) -> str:
        """The innermost member name (``hop`` for ``way[3].hop[1]``)."""
        return next(p for p in reversed(self.path) if isinstance(p, str))


def path_name(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


@dataclass
class Btf:
    """Parsed BTF: ``types[i]`` is type id ``i`` (id 0 is void)."""

    types: list[Type]
    strings: bytes = b""
    _by_name: dict[str, list[int]] = field(default_factory=dict, repr=False)

    # -- parsing ------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: bytes) -> Btf:
        """BTF from its raw bytes (little-endian, as on every CPU xdplb runs on)."""
        if len(data) < _HEADER.size:
            raise BtfError(f"{len(data)} bytes are too short for a BTF header")
        magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(
            data
        )
        if magic != BTF_MAGIC:
            raise BtfError(f"not BTF: magic {magic:#06x}, not {BTF_MAGIC:#06x}")
        if version != 1:
            raise BtfError(f"BTF version {version}: this reader knows version 1")
        t0, s0 = hdr_len + type_off, hdr_len + str_off
        if t0 + type_len > len(data) or s0 + str_len > len(data):
            raise BtfError("BTF sections run past the end of the data")
        strings = bytes(data[s0 : s0 + str_len])
        btf = cls([Type(0, Kind.UNKN, "void")], strings)
        pos, end = t0, t0 + type_len
        while pos < end:
            t, pos = btf._parse_type(data, pos, len(btf.types))
            btf.types.append(t)
        if pos != end:
            raise BtfError(f"the type section ends inside a type ({pos} != {end})")
        for t in btf.types:
            if t.name:
                btf._by_name.setdefault(t.name, []).append(t.id)
        return btf

    def _str(self, off: int) -> str:
        if off >= len(self.strings):
            raise BtfError(f"string offset {off} is past the string section")
        end = self.strings.index(b"\0", off)
        return self.strings[off:end].decode()

    def _parse_type(self, data: bytes, pos: int, tid: int) -> tuple[Type, int]:
        name_off, info, size_or_type = _TYPE.unpack_from(data, pos)
        pos += _TYPE.size
        vlen = info & 0xFFFF
        try:
            kind = Kind((info >> 24) & 0x1F)
        except ValueError:
            raise BtfError(f"type {tid}: unknown kind {(info >> 24) & 0x1F}") from None
        kflag = bool(info >> 31)
        name = self._str(name_off)
        sized = kind in _SIZED
        base = Type(
            tid, kind, name, size_or_type if sized else 0, 0 if sized else size_or_type, kflag
        )

        def words(n: int) -> tuple[int, ...]:
            return struct.unpack_from(f"<{n}I", data, pos)

        match kind:
            case Kind.INT:
                (w,) = words(1)
                t = replace(
                    base, encoding=(w >> 24) & 0xF, int_offset=(w >> 16) & 0xFF, int_bits=w & 0xFF
                )
                return t, pos + 4
            case Kind.ARRAY:
                elem, index, n = words(3)
                return replace(base, ref=elem, nelems=n, index_type=index), pos + 12
            case Kind.STRUCT | Kind.UNION:
                ms = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                    bits, off = (m_off >> 24, m_off & 0xFFFFFF) if kflag else (0, m_off)
                    ms.append(Member(self._str(m_name), m_type, off, bits))
                return replace(base, members=tuple(ms)), pos + 12 * vlen
            case Kind.ENUM:
                signed = kflag
                ms = []
                for i in range(vlen):
                    m_name, val = struct.unpack_from("<Ii" if signed else "<II", data, pos + 8 * i)
                    ms.append(Member(self._str(m_name), 0, val))
                return replace(base, members=tuple(ms)), pos + 8 * vlen
            case Kind.ENUM64:
                ms = []
                for i in range(vlen):
                    m_name, lo, hi = struct.unpack_from("<III", data, pos + 12 * i)
                    val = hi << 32 | lo
                    if kflag and val >= 1 << 63:
                        val -= 1 << 64
                    ms.append(Member(self._str(m_name), 0, val))
                return replace(base, members=tuple(ms)), pos + 12 * vlen
            case Kind.FUNC_PROTO:
                ms = []
                for i in range(vlen):
                    p_name, p_type = struct.unpack_from("<II", data, pos + 8 * i)
                    ms.append(Member(self._str(p_name), p_type))
                return replace(base, members=tuple(ms)), pos + 8 * vlen
            case Kind.VAR:
                (linkage,) = words(1)
                return replace(base, linkage=linkage), pos + 4
            case Kind.DATASEC:
                ms = []
                for i in range(vlen):
                    v_type, v_off, v_size = struct.unpack_from("<III", data, pos + 12 * i)
                    ms.append(Member(self.types[v_type].name if v_type < tid else "", v_type,
                                     v_off, v_size))  # fmt: skip
                return replace(base, members=tuple(ms)), pos + 12 * vlen
            case Kind.DECL_TAG:
                (component,) = struct.unpack_from("<i", data, pos)
                return replace(base, linkage=component), pos + 4
            case Kind.FUNC:
                return replace(base, linkage=vlen), pos
            case _:  # PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FLOAT, TYPE_TAG
                return base, pos

    # -- lookups ------------------------------------------------------------------------

    def __getitem__(self, tid: int) -> Type:
        if not 0 <= tid < len(self.types):
            raise BtfError(f"no type {tid} (BTF has {len(self.types) - 1})")
        return self.types[tid]

    def find(self, name: str, kind: Kind | None = None) -> Type:
        """The type named ``name`` (of ``kind`` if given); BtfError if none."""
        for tid in self._by_name.get(name, []):
            t = self.types[tid]
            if kind is None or t.kind is kind:
                return t
        what = f"{kind.name.lower()} " if kind is not None else ""
        raise BtfError(f"no {what}type {name!r} in this BTF")

    def resolve(self, tid: int) -> Type:
        """Type ``tid`` with typedefs and qualifiers (const, volatile, ...) skipped."""
        t = self[tid]
        seen = 0
        while t.kind in _MODIFIERS:
            t = self[t.ref]
            seen += 1
            if seen > len(self.types):
                raise BtfError(f"type {tid}: a loop of typedefs or qualifiers")
        return t

    def size(self, tid: int) -> int:
        """Size in bytes of type ``tid`` (what sizeof() says in C)."""
        t = self.resolve(tid)
        match t.kind:
            case Kind.ARRAY:
                return t.nelems * self.size(t.ref)
            case Kind.PTR:
                return 8
            case Kind.INT | Kind.STRUCT | Kind.UNION | Kind.ENUM | Kind.ENUM64 | Kind.FLOAT:
                return t.size
            case Kind.DATASEC:
                return t.size
            case Kind.VAR:
                return self.size(t.ref)
            case _:
                raise BtfError(f"type {tid} ({t.kind.name}) has no size")

    def struct_layout(self, name: str) -> tuple[int, list[tuple[str, int, int]]]:
        """Struct ``name``'s size and its members as (name, byte offset, byte size): what
        :meth:`xdplb.core.abi.AbiStruct.layout` gives for its Python mirror."""
        t = self.find(name, Kind.STRUCT)
        return t.size, [(m.name, m.offset // 8, self.size(m.type)) for m in t.members]

    def enum_values(self, name: str) -> dict[str, int]:
        """The values of ``enum name`` (ENUM or ENUM64)."""
        for tid in self._by_name.get(name, []):
            t = self.types[tid]
            if t.kind in (Kind.ENUM, Kind.ENUM64):
                return {m.name: m.offset for m in t.members}
        raise BtfError(f"no enum {name!r} in this BTF")

    def fields(self, tid: int) -> list[Field]:
        """Every scalar of type ``tid`` (a struct, union, array or scalar), arrays
        expanded element by element, in offset order as declared."""
        return list(self._flatten(tid, (), 0))

    def _flatten(self, tid: int, path: tuple[str | int, ...], offset: int) -> Iterator[Field]:
        t = self.resolve(tid)
        match t.kind:
            case Kind.STRUCT | Kind.UNION:
                for m in t.members:
                    mpath = (*path, m.name) if m.name else path  # anonymous: its members
                    if m.bits:
                        size = self.size(m.type)
                        byte = m.offset // 8
                        yield Field(
                            mpath, offset + byte, size,
                            signed=self._signed(m.type), kind=self.resolve(m.type).kind,
                            bits=m.bits, bit_offset=m.offset - 8 * byte,
                        )  # fmt: skip
                        continue
                    if m.offset % 8:
                        raise BtfError(f"{path_name(mpath)}: not byte-aligned ({m.offset} bits)")
                    yield from self._flatten(m.type, mpath, offset + m.offset // 8)
            case Kind.ARRAY:
                step = self.size(t.ref)
                for i in range(t.nelems):
                    yield from self._flatten(t.ref, (*path, i), offset + i * step)
            case Kind.INT | Kind.ENUM | Kind.ENUM64 | Kind.PTR | Kind.FLOAT:
                yield Field(path, offset, self.size(t.id), signed=self._signed(t.id), kind=t.kind)
            case _:
                raise BtfError(f"{path_name(path) or 'type'}: cannot lay out a {t.kind.name}")

    def _signed(self, tid: int) -> bool:
        t = self.resolve(tid)
        if t.kind is Kind.INT:
            return bool(t.encoding & INT_SIGNED)
        if t.kind in (Kind.ENUM, Kind.ENUM64):
            return t.kind_flag
        return False
