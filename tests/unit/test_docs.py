"""The README and the guides: every relative link reaches a file (and a heading, where it names
one), and the README stays a first screen: short, its picture small, no log of timings or
commits near its top."""

from __future__ import annotations

import re

import pytest
from PIL import Image

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # no headings in code
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _links(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for md, img in LINK.findall(text):
        target = md or img
        if not re.match(r"[a-z]+:", target):
            yield target


def test_slug_is_githubs():
    assert _slug("The README's two commands") == "the-readmes-two-commands"
    assert _slug("Before a large launch: plan and rehearse") == (
        "before-a-large-launch-plan-and-rehearse"
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_its_file_and_heading(doc):
    broken = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_found(tmp_path):
    text = '# A\n\n[b](b.md) [c](a.md#nowhere) [d](a.md#a) <img src="e.png">\n'
    (tmp_path / "a.md").write_text(text)
    links = list(_links(tmp_path / "a.md"))
    assert links == ["b.md", "a.md#nowhere", "a.md#a", "e.png"]
    assert "nowhere" not in _anchors(tmp_path / "a.md") and "a" in _anchors(tmp_path / "a.md")


def test_readme_is_a_first_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 150
    top = "\n".join(lines[:60])
    assert not re.search(r"\b[0-9a-f]{7,40}\b", top), "a commit hash near the README's top"
    assert not re.search(r"\b\d+:\d\d\b", top), "a timing log near the README's top"
    (picture,) = [t for t in _links(REPO / "README.md") if t.endswith(".png")]
    path = REPO / picture
    assert path.stat().st_size < 150_000
    with Image.open(path) as im:
        assert im.width <= 1000
