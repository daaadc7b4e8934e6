"""The README is a front door (short, its links alive); the documentation site is built with --strict by `make test`,
which catches a broken link or a missing page inside docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_short_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) < 200
    links = re.findall(r"\]\(([^)#]+)\)", readme)
    assert links, "the README links to the documentation"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def test_every_page_of_docs_is_in_the_site_navigation():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", config, flags=re.MULTILINE))
    assert pages == listed
