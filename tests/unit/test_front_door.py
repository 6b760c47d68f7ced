"""The front door holds: README.md is short and for users, its two commands are what CI
runs, the docs carry no issue numbers, and every page of docs/ is in the site's nav in
docs/index.md's reading order."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 150


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def nav_pages() -> list[str]:
    """The .md files of mkdocs.yml's nav, in order (read as text: no YAML library)."""
    text = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", text, re.M)


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines"


def test_the_readme_s_two_commands_are_what_ci_runs():
    text = README.read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    assert re.findall(r"^make (\w+)", block, re.M) == ["demo", "test"]
    ci = re.findall(r"^make ([\w-]+)", (ROOT / ".ci" / "run").read_text(), re.M)
    assert "test" in ci and "docs" in ci and ci.index("docs") < ci.index("test"), ci


def test_no_issue_numbers_in_the_docs():
    bad = [f"{p.relative_to(ROOT)}:{no}: {line.strip()[:80]}" for p in pages()
           for no, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"\b[Ii]ssues? #?\d+", line)]
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_in_the_nav_in_the_index_s_order():
    nav = nav_pages()
    docs = sorted(p.relative_to(ROOT / "docs").as_posix()
                  for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == docs
    assert len(set(nav)) == len(nav)
    index = (ROOT / "docs" / "index.md").read_text()
    linked = [t.split("#")[0] for t in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", index)]
    assert [p for p in nav if p != "index.md"] == linked
