"""The import rules: a package imports only the packages its docstring names.

Every package of src/xdplb says in its docstring which others it may import, on a line
``May import: core, tables.`` (or ``May import: nothing.``; a remark in parentheses
may follow a name); docs/architecture.md draws the
same rules as a picture. This test reads every module's imports from its source (lazy
imports inside functions included), and fails on any that the importing package's line
does not allow, and on rules that would let two packages import each other.
"""

from __future__ import annotations

import ast
import graphlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"
_RULE = re.compile(r"^May import: ([^.\n]+)", re.M)  # up to the first full stop


@dataclass(frozen=True)
class Edge:
    """``module`` (in package ``source``) imports ``target``'s module ``imported``."""

    module: str
    line: int
    source: str
    target: str
    imported: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported} ({self.source} -> {self.target})"


def package_of(module: str) -> str | None:
    """The top-level package of ``xdplb.a.b`` (``a``); None for ``xdplb`` itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imported_modules(module: str, tree: ast.AST, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, module) of every xdplb module ``tree`` imports, relative imports resolved."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = ".".join(base[: len(base) - node.level + 1])
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            # `from xdplb import core` imports the package xdplb.core.
            if target == "xdplb":
                for alias in node.names:
                    yield node.lineno, f"xdplb.{alias.name}"
            else:
                yield node.lineno, target


def edges(root: Path) -> Iterator[Edge]:
    """Every import across packages in the tree ``root`` (a folder holding ``xdplb/``)."""
    for path in sorted((root / "xdplb").rglob("*.py")):
        module = module_name(root, path)
        source = package_of(module)
        tree = ast.parse(path.read_text(), str(path))
        for line, imported in imported_modules(module, tree, path.name == "__init__.py"):
            if not imported.startswith("xdplb."):
                continue
            target = package_of(imported)
            if source is not None and target is not None and target != source:
                yield Edge(module, line, source, target, imported)


def rules(root: Path) -> dict[str, frozenset[str]]:
    """Package -> the packages its docstring says it may import."""
    out = {}
    for init in sorted((root / "xdplb").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        m = _RULE.search(doc)
        assert m, f"{init}: the docstring has no 'May import: ...' line"
        # "tables (primes)": a remark in parentheses says which part; the rule is the package.
        names = re.sub(r"\s*\([^)]*\)", "", m.group(1)).strip()
        allowed = set() if names == "nothing" else {n.strip() for n in names.split(",")}
        out[init.parent.name] = frozenset(allowed)
    return out


def violations(found: Iterator[Edge], allowed: Mapping[str, frozenset[str]]) -> list[Edge]:
    return [e for e in found if e.target not in allowed.get(e.source, frozenset())]


def check_layered(allowed: Mapping[str, frozenset[str]]) -> list[str]:
    """The rules must form layers: no package may import (through rules) one that may
    import it back. Returns them bottom first; CycleError otherwise."""
    return list(graphlib.TopologicalSorter(allowed).static_order())


# --- the real tree -----------------------------------------------------------------------


def test_every_package_states_its_rule_and_names_real_packages() -> None:
    allowed = rules(SRC)
    packages = set(allowed)
    assert {"core", "datapath", "config", "control", "daemon", "cli", "lab"} <= packages
    for pkg, names in allowed.items():
        assert names <= packages, f"{pkg} may import unknown packages {names - packages}"
    # Modules directly under xdplb/ (not in a package) have no rule: there must be none.
    loose = [p.name for p in (SRC / "xdplb").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules outside a package: {loose}"


def test_rules_are_layers() -> None:
    order = check_layered(rules(SRC))
    assert order[0] == "core"


def test_imports_follow_the_rules() -> None:
    bad = violations(edges(SRC), rules(SRC))
    assert not bad, "imports the rules do not allow:\n" + "\n".join(map(str, bad))


def test_the_kernel_layer_depends_on_nothing_above_it() -> None:
    """Stated once more on its own, as the architecture's first rule: datapath imports
    only core (never config, control, the daemon or the CLI)."""
    assert rules(SRC)["datapath"] == {"core"}
    assert rules(SRC)["core"] == frozenset()


# --- the checker itself, on trees made to break the rules ---------------------------------


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


FIXTURE = {
    "xdplb/__init__.py": "",
    "xdplb/core/__init__.py": '"""Bottom.\n\nMay import: nothing.\n"""\n',
    "xdplb/core/abi.py": "X = 1\n",
    "xdplb/config/__init__.py": '"""Config.\n\nMay import: core.\n"""\n',
    "xdplb/config/schema.py": "from xdplb.core import abi\n",
    "xdplb/datapath/__init__.py": '"""Kernel.\n\nMay import: core.\n"""\n',
    "xdplb/datapath/lb.py": (
        "from xdplb.core.abi import X\n"
        "from . import maps\n"
        "def load():\n"
        "    from xdplb.config.schema import Config  # the deliberate mistake\n"
    ),
    "xdplb/datapath/maps.py": "from ..config import schema\n",
}


def test_a_wrong_import_is_reported(tmp_path: Path) -> None:
    root = _tree(tmp_path, FIXTURE)
    bad = violations(edges(root), rules(root))
    assert [(e.module, e.line, e.target) for e in bad] == [
        ("xdplb.datapath.lb", 4, "config"),  # lazy, inside a function
        ("xdplb.datapath.maps", 1, "config"),  # relative
    ]
    assert "xdplb.datapath.lb:4 imports xdplb.config.schema (datapath -> config)" in map(str, bad)


def test_rules_that_allow_a_cycle_are_refused() -> None:
    with pytest.raises(graphlib.CycleError):
        check_layered({"core": frozenset(), "a": frozenset({"core", "b"}), "b": {"a"}})


def test_a_package_without_a_rule_is_refused(tmp_path: Path) -> None:
    root = _tree(tmp_path, {**FIXTURE, "xdplb/health/__init__.py": '"""No rule here."""\n'})
    with pytest.raises(AssertionError, match="no 'May import"):
        rules(root)
