"""Each field of the engine has one writer (docs/architecture.md, "The engine").

Cython has no C-level ``readonly``: a field declared in a ``.pxd`` can be assigned by
any extension that cimports the class. This test is what holds the rule. It reads the
engine's ``.pyx`` files (and the inline functions of its ``.pxd`` files), follows every
assignment target and every address taken (``&x.f``: a lock word handed to
``rm_spin_lock``, a flag handed to a setter) to the unit whose storage it is, and fails
on a write into another unit's field: a unit (an extension module of
``rdmamw/engine/``) writes only the fields of its own classes, through ``self``, or
of objects of its own classes. The transport (``rdmamw/transport/_base.pxd``) is no
unit of the engine: the engine writes none of its fields. The one exception is the
counters struct the Link holds for ``stats()`` (``_counters.pxd``): every unit adds
to its own counters there, and each counter must have exactly one writing unit.

It also holds the Link to being the only holder of the transport (no other unit
names ``.tp``), and no class of the engine to more than ``MAX_CLASS_LINES`` lines.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENGINE = ROOT / "rdmamw" / "engine"
BASE_PXD = ROOT / "rdmamw" / "transport" / "_base.pxd"
MAX_CLASS_LINES = 600

IDENT = r"[A-Za-z_]\w*"
DECL = re.compile(rf"^cdef\s+(?:readonly\s+|public\s+|const\s+)*({IDENT})\s*(\**)\s*(.*)$")
CLASS = re.compile(rf"^(?:cdef\s+)?class\s+({IDENT})\s*(?:\(\s*({IDENT})\s*\))?\s*:")
FUNC = re.compile(rf"^(?:cdef|cpdef|def)\s+(?:inline\s+)?[^(=]*?({IDENT})\s*\((.*)\)")
ASSIGN_OPS = ("+=", "-=", "*=", "/=", "|=", "&=", "^=", "<<=", ">>=", "//=", "%=", "=")


def _strip(text: str) -> list[tuple[int, str]]:
    """Logical lines (continuations joined), without comments and string literals,
    with their first line number."""
    out, buf, start, depth = [], "", 0, 0
    i, n, line = 0, len(text), 1
    cur = []
    while i < n:
        c = text[i]
        if c in "\"'":
            q = text[i:i + 3] if text[i:i + 3] in ('"""', "'''") else c
            j = text.find(q, i + len(q))
            while len(q) == 1 and j > 0 and text[j - 1] == "\\":
                j = text.find(q, j + 1)
            j = n if j < 0 else j + len(q)
            line += text.count("\n", i, j)
            cur.append('""')
            i = j
            continue
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "\\" and text[i + 1:i + 2] == "\n":
            i += 2
            line += 1
            cur.append(" ")
            continue
        if c == "\n":
            line += 1
            if depth <= 0:
                buf = "".join(cur)
                if buf.strip():
                    out.append((start, buf))
                cur, depth = [], 0
                start = line
                i += 1
                continue
            cur.append(" ")
            i += 1
            continue
        if not cur or not "".join(cur).strip():
            start = line
        cur.append(c)
        i += 1
    if "".join(cur).strip():
        out.append((start, "".join(cur)))
    return out


def _split_top(s: str, sep: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(s[last:i])
            last = i + 1
    parts.append(s[last:])
    return parts


def _assign_target(stmt: str) -> str | None:
    """The text left of a top-level assignment operator (``=``, ``+=``, ``<<=``, ...),
    or None: comparisons and keyword arguments are not assignments."""
    depth = 0
    for i, c in enumerate(stmt):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "=":
            before, after = stmt[:i], stmt[i + 1:i + 2]
            if after == "=" or before.endswith("=") or (
                    before[-1:] in ("!", "<", ">") and before[-2:] not in ("<<", ">>")):
                continue                        # ==, !=, <=, >=
            return before.rstrip("+-*/|&^<>%")
    return None


class Decls:
    """Classes of the engine and the transport: module, base and field types."""

    def __init__(self, extra=()) -> None:
        self.module: dict[str, str] = {}
        self.base: dict[str, str | None] = {}
        self.fields: dict[str, dict[str, str]] = {}    # class -> field -> "T", "T*", "T[]"
        extra = [p.with_suffix(".pxd") for p in extra if p.with_suffix(".pxd").exists()]
        for path in (sorted(ENGINE.glob("*.pxd")) + sorted(ENGINE.glob("*.pyx")) + [BASE_PXD]
                     + extra):
            self._read(path)

    def _read(self, path: pathlib.Path) -> None:
        cls, indent = None, 0
        for _, line in _strip(path.read_text()):
            body = line.strip()
            ind = len(line) - len(line.lstrip())
            m = CLASS.match(body)
            if m and ind == 0:
                cls, indent = m.group(1), None
                self.module.setdefault(cls, path.stem)
                self.base.setdefault(cls, m.group(2))
                self.fields.setdefault(cls, {})
                continue
            if ind == 0:
                cls = None
            if cls is None:
                continue
            if indent is None:
                indent = ind
            if ind != indent or "(" in body.split("=")[0]:
                continue
            d = DECL.match(body)
            if not d:
                continue
            typ, stars, rest = d.groups()
            for name in _split_top(rest, ","):
                name = name.split("=")[0].strip()
                ptr = stars or name.startswith("*")
                name = name.lstrip("*").strip()
                arr = "[" in name
                name = name.split("[")[0].strip()
                if re.fullmatch(IDENT, name):
                    self.fields[cls][name] = typ + ("*" if ptr else "[]" if arr else "")

    def field(self, cls: str, name: str) -> str | None:
        while cls is not None:
            if name in self.fields.get(cls, {}):
                return self.fields[cls][name]
            cls = self.base.get(cls)
        return None


CHAIN = re.compile(rf"({IDENT})((?:\s*\.\s*{IDENT}|\s*\[[^\]]*\])*)")
STEP = re.compile(rf"\s*(?:\.\s*({IDENT})|\[([^\]]*)\])")


def _owner(decls: Decls, expr: str, me: str | None, locals_: dict[str, str]):
    """(module owning the storage ``expr`` names, its field path) or None when it is
    local memory, a pointee, or not a field of any class of the engine."""
    m = CHAIN.fullmatch(expr.strip())
    if not m:
        return None
    root, rest = m.group(1), m.group(2)
    if root == "self" and me is not None:
        typ, mine = me, True
    else:
        typ, mine = locals_.get(root), False
    owner, path = None, []
    for step in STEP.finditer(rest):
        attr, _ = step.groups()
        if attr is not None:
            if typ in decls.module:             # a field of a unit's object
                owner = "self" if mine else decls.module[typ]
                path = [attr]
                mine = False
                ftyp = decls.field(typ, attr)
                if ftyp is None:
                    typ = None
                elif ftyp.endswith("*"):
                    typ = "*"
                elif ftyp.endswith("[]"):
                    typ = "[]"
                else:
                    typ = ftyp
            elif typ == "*":                    # a member through a pointer field
                path.append(attr)
                typ = None
            else:                               # a member of a struct field
                path.append(attr)
                typ = None
        else:                                   # an element of an array field, or
            typ = None                          # memory a pointer field of the unit holds
    if owner is None:
        return None
    return owner, ".".join(path)


def scan(files=None):
    """[(file, line, unit, written, owner module, field)] of every write into another
    unit's field; and {counter: {unit}} of the counters struct's writers."""
    decls = Decls(files or ())
    files = files or sorted(ENGINE.glob("*.pyx")) + sorted(ENGINE.glob("*.pxd"))
    bad, counters, tp_uses = [], {}, []
    for path in files:
        unit = path.stem
        me, locals_ = None, {}
        fn_indent = None
        for lineno, line in _strip(path.read_text()):
            body = line.strip()
            ind = len(line) - len(line.lstrip())
            m = CLASS.match(body)
            if m and ind == 0:
                me, locals_ = m.group(1), {}
                continue
            if ind == 0 and not body.startswith(("cdef inline", "@")):
                me = None if not body.startswith(("cdef", "def")) or "(" not in body else me
            if ind == 0 and FUNC.match(body):
                me = None
            f = FUNC.match(body)
            if f:
                locals_, fn_indent = {}, ind
                for p in _split_top(f.group(2), ","):
                    p = p.split("=")[0].split()
                    if len(p) >= 2 and re.fullmatch(IDENT, p[-1]):
                        locals_[p[-1]] = p[-2] if not p[-2].endswith("*") else "*"
                continue
            d = DECL.match(body)
            if d and fn_indent is not None and ind > fn_indent:
                typ, stars, rest = d.groups()
                for name in _split_top(rest, ","):
                    name = name.split("=")[0].strip()
                    ptr = bool(stars) or name.startswith("*")
                    name = name.lstrip("*").split("[")[0].strip()
                    locals_[name] = "*" if ptr else typ
                if "=" not in rest:
                    continue
                body = "cdef " + rest.split(",")[0]
            if re.search(r"(?<![\w.])tp\s*\.|\.\s*tp\b", body) and unit != "_link" and not (
                    path.suffix == ".pxd"):
                tp_uses.append((path.name, lineno, body.strip()))
            targets = []
            t = _assign_target(body)
            if t is not None and not body.startswith(("cdef ", "def ", "if ", "elif ", "while ",
                                                      "return ", "assert ")):
                targets += [x.strip() for x in _split_top(t, ",")]
            for a in re.finditer(r"(rm_load_acquire64\(\s*)?&\s*([A-Za-z_][\w.]*(?:\[[^\]]*\])?)",
                                 body):
                if not a.group(1):              # (an atomic load only reads)
                    targets.append(a.group(2))
            for tgt in targets:
                if tgt.startswith("(") or not tgt:
                    continue
                o = _owner(decls, tgt, me, locals_)
                if o is None:
                    continue
                owner, field = o
                if owner == "self" or owner == unit:
                    continue
                if owner == "_link" and field.startswith("cnt."):
                    counters.setdefault(field[4:], set()).add(unit)
                    continue
                bad.append((path.name, lineno, unit, tgt, owner, field))
    return bad, counters, tp_uses


def class_lines(files=None):
    """{class: lines} of every cdef class of the engine's .pyx files."""
    out = {}
    for path in files or sorted(ENGINE.glob("*.pyx")):
        lines = path.read_text().splitlines()
        cur, start = None, 0
        for i, line in enumerate(lines + ["END"]):
            if line and not line[0].isspace() and not line.startswith(("#", ")", '"""')):
                if cur is not None:
                    end = i
                    while end > start and not lines[end - 1].strip():
                        end -= 1
                    out[cur] = end - start
                m = CLASS.match(line)
                cur, start = (m.group(1), i) if m else (None, i)
    return out


def test_no_unit_writes_another_units_fields():
    bad, _, _ = scan()
    assert not bad, "writes into another unit's fields:\n" + "\n".join(
        f"  {f}:{ln} ({u}) {t}  -> {o}.{fld}" for f, ln, u, t, o, fld in bad)


def test_each_counter_has_one_writer():
    _, counters, _ = scan()
    assert counters, "no counter writes found: the scan is broken"
    shared = {c: sorted(u) for c, u in counters.items() if len(u) > 1}
    assert not shared, f"counters written by more than one unit: {shared}"


def test_only_the_link_holds_the_transport():
    _, _, uses = scan()
    assert not uses, "units reaching the transport past the Link:\n" + "\n".join(
        f"  {f}:{ln} {s}" for f, ln, s in uses)


def test_no_class_over_the_limit():
    sizes = class_lines()
    assert "Engine" in sizes and sizes["Engine"] > 100, sizes
    big = {c: n for c, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def test_the_scan_sees_a_planted_write(tmp_path):
    """The scan itself: a write through another unit's object, through a typed
    local, a struct member of another unit's field, an address taken, and the
    transport's field are found; a unit's own fields and local structs are not."""
    src = tmp_path / "_planted.pyx"
    src.write_text(
        "cdef class Planted:\n"
        "    cdef void f(self, Link link, rm_wr *wr) noexcept nogil:\n"
        "        cdef RndvSender rs = self.rs\n"
        "        cdef rm_wr w\n"
        "        self.link.closed = True\n"
        "        rs.upto += 1\n"
        "        link.tp.n_wakeups += 1\n"
        "        rm_spin_lock(&self.link.spin)\n"
        "        self.link.cnt.msgs_sent += 1\n"
        "        w.wr_id = 0\n"
        "        wr.length = 8\n"
        "        self.mine = 1\n"
        "        x = rm_load_acquire64(&link.ctrl[3])\n"
    )
    (tmp_path / "_planted.pxd").write_text(
        "cdef class Planted:\n    cdef Link link\n    cdef RndvSender rs\n    cdef int mine\n")
    bad, counters, uses = scan([src])
    fields = sorted((o, f) for _, _, _, _, o, f in bad)
    assert fields == [("_base", "n_wakeups"), ("_link", "closed"), ("_link", "spin"),
                      ("_rndv_send", "upto")], bad
    assert counters == {"msgs_sent": {"_planted"}}
    assert [ln for _, ln, _ in uses] == [7]


def test_a_receive_that_sleeps_is_counted_by_the_link():
    """The Link counts the sleeps (the engine no longer writes a counter of the
    transport's): a receive that times out on an idle channel spins, raises its flag at
    the peer, sleeps, and says so in stats()."""
    import rdmamw
    from tests.support.helpers import make_pair

    a, b, lst = make_pair("batched", slots=16, slot_size=4096, provider="shm")
    try:
        before = b.stats()
        with pytest.raises(rdmamw.Timeout):
            b.recv(timeout=0.05)
        after = b.stats()
        assert after["sleeps"] > before["sleeps"]
        assert after["arrival_sleeps"] == before["arrival_sleeps"] + 1
        a.send(b"x")
        assert bytes(b.recv(timeout=5)) == b"x"
    finally:
        a.close(), b.close(), lst.close()
