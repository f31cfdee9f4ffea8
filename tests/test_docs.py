"""The docs' shape (issue 40): a README a newcomer reads in minutes, one
title per document, one folder of images that every reference finds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _outside_fences(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks (a ``#`` there is a comment)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 150


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_each_document_has_one_title(doc):
    titles = [line for line in _outside_fences(doc.read_text()) if line.startswith("# ")]
    assert len(titles) == 1, titles


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_image_a_document_shows_is_in_docs_images(doc):
    for target in IMAGE.findall(doc.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_file(), f"{doc.name}: {target} does not exist"
        assert path.parent == ROOT / "docs" / "images", f"{doc.name}: {target} is outside docs/images"


def test_images_live_in_one_folder():
    suffixes = {".png", ".jpg", ".jpeg", ".gif", ".svg"}
    folders = {p.parent for p in (ROOT / "docs").rglob("*") if p.suffix.lower() in suffixes}
    assert folders <= {ROOT / "docs" / "images"}, folders


def test_the_title_check_sees_through_code_blocks():
    text = "# Title\n\n```sh\n# a comment\n```\n## Section\n"
    assert [line for line in _outside_fences(text) if line.startswith("# ")] == ["# Title"]
