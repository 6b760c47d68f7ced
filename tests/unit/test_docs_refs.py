"""The docs stand alone: every file they name is in the repository, and nothing in the
repository points a reader to a document outside it.

* README.md and docs/**/*.md: every relative link (``[text](path#anchor)``: the file, and
  the heading when there is an anchor), every path under docs/, rdmamw/, tests/, bench/,
  scripts/ or examples/ (a directory when it ends in ``/``; ``*`` and an upper-case
  placeholder such as ``_NAME`` stand for any name), every path inside a package of
  rdmamw written without ``rdmamw/`` (``collectives/api.py``) and every bare source file
  name (``_link.pyx``, ``rm_tcp.h``) names a file of the repository, and every dotted
  name under ``rdmamw.`` is a module of it (then a name that module defines or imports)
  or a logger the code creates; every ``test_...`` name is a test module or a test of
  tests/, and every ```make TARGET``` a target of the Makefile.
* rdmamw/, bench/, scripts/, tests/, examples/, setup.py and the Makefile: every
  ``docs/...`` path names a file of the repository.
* No file of the repository names the design page the project was started from, or the
  ``shared`` directory beside the repository that holds it: what the code relies on is
  in docs/design.md.

"A file of the repository" is one git tracks or would add (untracked, not ignored), so
build products (the ``.c`` files Cython writes, ``.so``) do not count."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP = ("docs", "rdmamw", "tests", "bench", "scripts", "examples")
CODE = ("rdmamw", "bench", "scripts", "tests", "examples", "setup.py", "Makefile")
CODE_SUFFIXES = {".py", ".pyx", ".pxd", ".pxi", ".h", ".sh", ".toml", ""}
SOURCE_EXT = r"(?:py|pyx|pxd|pxi|h|sh|md)"

#: names the docs mention that are not ours, on purpose
NOT_OURS = {
    "verbs.h": "rdma-core's header: rm_ibverbs.h declares its ABI, test_verbs_load.py "
               "compares the two",
}
#: paths the docs name that a command writes (each must be ignored by .gitignore)
WRITTEN = {
    "bench/results/": "bench/run.py writes its JSON there",
}

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
NOT_AFTER = r"(?<![\w./~$@-])"
TOP_PATH = re.compile(NOT_AFTER + r"((?:" + "|".join(TOP) + r")/[\w./*-]*)")
DOCS_PATH = re.compile(NOT_AFTER + r"(docs/[\w./*-]*)")
BARE = re.compile(NOT_AFTER + r"([\w-]+\." + SOURCE_EXT + r")(?![\w/-])")
DOTTED = re.compile(r"(?<![\w./-])(rdmamw(?:\.[\w*]+)+)")
TEST_NAME = re.compile(r"(?<![\w./-])(test_\w+)")
MAKE = re.compile(r"`make ([\w-]+)")
MAKE_LINE = re.compile(r"^\s*make ([\w-]+)")
LOGGER = re.compile(r"getLogger\(\s*[\"'](rdmamw[\w.]*)[\"']")
# the outside design page and its directory, spelled so that this file does not match
OUTSIDE = re.compile(rb"DESIGN" + rb"\.md|(?<![\w.-])sha" + rb"red/")


@cache
def repo_files() -> frozenset[str]:
    """Paths relative to ROOT, '/'-separated: tracked, or untracked and not ignored."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
        names = {n.decode() for n in out.split(b"\0") if n}
    except (OSError, subprocess.SubprocessError):    # not a git checkout: walk it
        names = set()
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in
                           ("build", "__pycache__", "results") and not d.endswith(".egg-info")]
            for f in filenames:
                p = Path(dirpath, f).relative_to(ROOT).as_posix()
                if not (f.endswith(".so") or (f.endswith(".c") and p.startswith("rdmamw/"))):
                    names.add(p)
    return frozenset(n for n in names if (ROOT / n).is_file())


@cache
def repo_dirs() -> frozenset[str]:
    out = set()
    for f in repo_files():
        parts = f.split("/")[:-1]
        out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


@cache
def basenames() -> frozenset[str]:
    return frozenset(f.rsplit("/", 1)[-1] for f in repo_files())


def packages() -> list[str]:
    return sorted({d.split("/")[1] for d in repo_dirs()
                   if d.startswith("rdmamw/") and d.count("/") == 1})


def resolves(path: str) -> bool:
    """``path`` (relative to ROOT) is a file of the repository, or a directory holding
    one when it ends in '/'; ``*`` and upper-case placeholders match any name."""
    path = path.rstrip(".,:;")
    want_dir = path.endswith("/")
    path = path.rstrip("/")
    pool = repo_dirs() if want_dir else repo_files() | repo_dirs()
    if path in pool:
        return True
    if "*" not in path and not re.search(r"[A-Z]", path):
        return False
    pattern = re.sub(r"[A-Z][A-Z0-9]*", "*", path)
    return any(fnmatch.fnmatchcase(p, pattern) for p in pool)


@cache
def loggers() -> frozenset[str]:
    """The names the code passes to ``logging.getLogger``."""
    return frozenset(m.group(1) for f in repo_files() if f.startswith("rdmamw/")
                     and f.endswith((".py", ".pyx"))
                     for m in LOGGER.finditer((ROOT / f).read_text()))


@cache
def module_names(parts: tuple[str, ...]) -> frozenset[str] | None:
    """The names module ``rdmamw.<parts>`` defines or imports at its top level (a .py
    file or package by its syntax tree, a Cython module by its ``def``/``class``
    lines), or None when there is no such module."""
    base = "/".join(["rdmamw", *parts])
    for f in (base + ".py", base + "/__init__.py"):
        if f in repo_files():
            out = set()
            for node in ast.parse((ROOT / f).read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    out.add(node.name)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    out.update((a.asname or a.name).split(".")[0] for a in node.names)
                else:
                    out.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                               and isinstance(n.ctx, ast.Store))
            return frozenset(out)
    for f in (base + ".pyx", base + ".pxd"):
        if f in repo_files():
            return frozenset(re.findall(r"^(?:c?p?def|class|cdef class|cpdef)\s+(?:\w+\s+)*?"
                                        r"(\w+)\s*[(:]", (ROOT / f).read_text(), re.M))
    return None


def dotted_resolves(name: str) -> bool:
    """``rdmamw.a.b`` is a module, or ``rdmamw.a.b.c`` a module ``rdmamw.a.b`` that
    defines or imports ``c`` (``*`` matches any name), or a logger the code creates."""
    name = name.rstrip(".")
    if name in loggers():
        return True
    parts = tuple(name.split(".")[1:])
    for k in range(len(parts), -1, -1):
        names = module_names(parts[:k])
        if names is not None:
            return k == len(parts) or any(fnmatch.fnmatchcase(n, parts[k]) for n in names)
    return False


@cache
def known_tests() -> frozenset[str]:
    """The test modules of tests/ and the tests (and fixtures) they define."""
    out = set()
    for f in repo_files():
        if f.startswith("tests/") and f.endswith(".py"):
            out.add(f.rsplit("/", 1)[-1][:-3])
            out.update(re.findall(r"^\s*(?:async\s+)?def\s+(test_\w+)", (ROOT / f).read_text(),
                                  re.M))
    return frozenset(out)


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w-]+)\s*:", (ROOT / "Makefile").read_text(), re.M))


def docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shown(doc: Path) -> str:
    """A doc's path in a report: docs/collectives.md and docs/benchmarks/collectives.md
    share a name."""
    return doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc.name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> frozenset[str]:
    """The anchors of a markdown text's headings (outside fenced code)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def numbered(text: str) -> list[tuple[int, str]]:
    return list(enumerate(text.splitlines(), 1))


def broken_links(doc: Path, text: str) -> list[str]:
    """The links of ``text`` (the markdown file ``doc``, under ROOT) that name no file
    of the repository, or no heading of the markdown file they name."""
    bad = []
    for no, line in numbered(text):
        for m in LINK.finditer(line):
            target = m.group(1)
            if SCHEME.match(target):
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else ""
            if file and rel not in repo_files() | repo_dirs():
                bad.append(f"{shown(doc)}:{no}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(
                    (ROOT / rel).read_text() if file else text):
                bad.append(f"{shown(doc)}:{no}: link to {target}: no heading #{anchor} in "
                           f"{rel}")
    return bad


def broken_paths(doc: Path, text: str) -> list[str]:
    """The paths and file names in ``text`` that name no file of the repository."""
    bad = []
    nested = re.compile(NOT_AFTER + r"((?:" + "|".join(packages()) + r")/[\w./*-]*\."
                        + SOURCE_EXT + r")\b")
    for no, line in numbered(text):
        for m in TOP_PATH.finditer(line):
            p = m.group(1)
            if p.rstrip(".,:;") not in WRITTEN and not resolves(p):
                bad.append(f"{shown(doc)}:{no}: {p}")
        for m in nested.finditer(line):
            if not resolves("rdmamw/" + m.group(1)):
                bad.append(f"{shown(doc)}:{no}: {m.group(1)} (not under rdmamw/)")
        for m in BARE.finditer(line):
            name = m.group(1)
            if name not in basenames() and name not in NOT_OURS:
                bad.append(f"{shown(doc)}:{no}: {name} (no file of that name)")
        for m in DOTTED.finditer(line):
            if not dotted_resolves(m.group(1)):
                bad.append(f"{shown(doc)}:{no}: {m.group(1)} (no such module or name)")
        for m in TEST_NAME.finditer(line):
            if m.group(1) not in known_tests():
                bad.append(f"{shown(doc)}:{no}: {m.group(1)} (no such test or test module)")
    fenced = False
    for no, line in numbered(text):
        fenced ^= line.lstrip().startswith("```")
        targets = [m.group(1) for m in MAKE.finditer(line)]
        if fenced and MAKE_LINE.match(line):
            targets.append(MAKE_LINE.match(line).group(1))
        bad += [f"{shown(doc)}:{no}: make {t} (no such Makefile target)" for t in targets
                if t not in make_targets()]
    return bad


def code_files() -> list[str]:
    """The code whose ``docs/...`` paths must resolve (not this file: it plants broken
    ones on purpose)."""
    return sorted(f for f in repo_files() if f.split("/")[0] in CODE
                  and Path(f).suffix in CODE_SUFFIXES and f != "tests/unit/test_docs_refs.py")


@pytest.mark.parametrize("doc", docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_and_path_in_the_docs_is_in_the_repository(doc):
    text = doc.read_text()
    bad = broken_links(doc, text) + broken_paths(doc, text)
    assert not bad, "\n".join(bad)


def test_every_docs_path_in_the_code_is_in_the_repository():
    bad = [f"{f}:{no}: {m.group(1)}" for f in code_files()
           for no, line in numbered((ROOT / f).read_text())
           for m in DOCS_PATH.finditer(line) if not resolves(m.group(1))]
    assert not bad, "\n".join(bad)


def test_nothing_refers_to_a_document_outside_the_repository():
    bad = []
    for f in sorted(repo_files()):
        for no, line in enumerate((ROOT / f).read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{f}:{no}: {line.decode(errors='replace').strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_the_exceptions_are_what_they_say():
    """A path listed as written by a command is ignored by git (so never committed by
    mistake), and a name listed as not ours is indeed not in the tree."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for path in WRITTEN:
        probe = path + "x.json" if path.endswith("/") else path
        assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT,
                              timeout=60).returncode == 0, path
    assert not NOT_OURS.keys() & basenames()


def test_the_checks_find_what_they_guard():
    """Each kind of reference, planted broken in a doc, is reported; the same kinds,
    written right, are not."""
    doc = ROOT / "docs" / "planted.md"
    text = ("# Planted\n"
            "[a](architecture.md#no-such-heading) [b](lost.md) [c](#nowhere)\n"
            "`rdmamw/engine/_core.pyx`, `collectives/nope.py`, `gone.pyx`, `bench/absent/`\n"
            "`rdmamw.ps.demo`, `rdmamw.memory.pool.no_such_name`, `rdmamw.nowhere`\n"
            "`test_no_such_thing`, `make no-such-target`\n```sh\nmake gone-target\n```\n")
    bad = "\n".join(broken_links(doc, text) + broken_paths(doc, text))
    for want in ("no heading #no-such-heading in docs/architecture.md",
                 "link to lost.md: no such file", "no heading #nowhere",
                 "rdmamw/engine/_core.pyx", "collectives/nope.py", "gone.pyx",
                 "bench/absent/", "rdmamw.ps.demo (", "rdmamw.memory.pool.no_such_name",
                 "rdmamw.nowhere", "test_no_such_thing", "make no-such-target",
                 "make gone-target"):
        assert want in bad, (want, bad)
    good = ("# Planted\n[a](design.md#alignment-4k-aliasing) [b](../README.md) [c](#planted)"
            " [d](https://example.org/x.md)\n`rdmamw/providers/NAME/_transport.pyx`, `docs/*.md`, "
            "`collectives/api.py`, `_phase.pyx`, `rdmamw/engine/`, `bench/results/`, "
            "`verbs.h`, ~/.config/rdmamw/rendezvous.json, `rdmamw.memory.pool.allocate`, "
            "`rdmamw.collectives.api.plan_*`, `rdmamw.aio`, the `rdmamw.channel` logger.\n"
            "test_layers.py's `test_dirty_spans`, `make bench-rndv`\n")
    assert broken_links(doc, good) + broken_paths(doc, good) == []
    assert OUTSIDE.search(b"as " + b"DESIGN" + b".md says")
    assert OUTSIDE.search(b"(../sha" + b"red/softroce)")
    assert not OUTSIDE.search(b"docs/design.md, /dev/shm, shared-memory/")
