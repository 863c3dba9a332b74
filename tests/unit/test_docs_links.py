"""The README and docs/ link only inside the repository: every relative link names a file
of the tree (and a heading of it, for an anchor), no page points at a path outside it
(issue 10: design.md sent readers to KERNEL_NOTES.md, a file of the project brief)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from xdplb.core.paths import ROOT

pytestmark = pytest.mark.unit

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"[\w./-]*\b[A-Za-z_][\w-]*\.md\b")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(m) for m in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)}


def names() -> set[str]:
    return {p.name for p in ROOT.rglob("*.md") if ".venv" not in p.parts and "build" not in p.parts}


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_links_resolve_inside_the_repo(page: Path) -> None:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT) or not dest.exists():
            bad.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert bad == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_no_page_names_a_file_outside_the_repo(page: Path) -> None:
    text = page.read_text()
    known = names()
    missing = sorted({m for m in MD_NAME.findall(text) if Path(m).name not in known})
    assert missing == []
    assert not re.search(r"(\.\./shared|/work/)", text)
