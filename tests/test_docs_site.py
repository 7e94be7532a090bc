"""The README is a short front door and the reference is the documentation site (mkdocs.yml over docs/):
every page is in the site's nav, and the README's links and test command hold. `tox -e docs` builds the site
strictly (broken links and anchors); this checks what it can without MkDocs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


class _Loader(yaml.SafeLoader):
    """safe_load that tolerates the `!!python/name:...` tags MkDocs configs may hold (read as None)."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages(nav) -> list[str]:
    """The page paths in an mkdocs nav: strings, {title: path} and {title: [...]} nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def mkdocs_config() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move reference text into docs/"


def test_every_docs_page_is_in_the_nav_and_every_nav_page_exists():
    config = mkdocs_config()
    assert config["docs_dir"] == "docs"
    listed = nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(listed)) == sorted(listed), "a page is listed twice in the nav"
    assert [p for p in pages if p not in listed] == [], "pages missing from mkdocs.yml's nav"
    assert [p for p in listed if p not in pages] == [], "nav entries with no page under docs/"


def test_readme_links_point_to_files_that_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#", 1)[0] for link in links if not re.match(r"[a-z]+:", link) and link[0] != "#"]
    assert local, "the README links into the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_the_readme_documents_the_ci_test_command_verbatim():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{command}\n```" in README.read_text()


# Measured figures, with their dates and machines, are on performance.md; their history is on performance-log.md
# (and in commit messages). Every other page, and the README, describes the code as it is (issue 48).
DATED_PAGES = {"performance.md", "performance-log.md"}
A_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HISTORY = re.compile(
    r"\bno longer\b|\bused to be\b|\bpredate[sd]?\b|\btoday\b|\buntil recently\b|\bpreviously\b|\bformerly\b"
    r"|\bbefore (?:the|its|this|that) (?:last |latest )?(?:fix|change|commit|rewrite)\b"
    r"|\bafter the fix\b|\b(?:ran|took|was|were) before\b|\bbefore the \w+ kernels\b",
    re.IGNORECASE,
)


def reference_pages() -> list[Path]:
    pages = [p for p in sorted(DOCS.rglob("*.md")) if str(p.relative_to(DOCS)) not in DATED_PAGES]
    return [*pages, README]


def test_only_the_performance_pages_hold_dates_and_history():
    found = [
        f"{page.relative_to(ROOT)}:{n}: {match.group(0)!r}"
        for page in reference_pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for pattern in (A_DATE, HISTORY)
        for match in pattern.finditer(line)
    ]
    assert found == [], (
        "dated figures or history outside performance.md and performance-log.md: " + "; ".join(found)
    )
