"""Every setting is read through the settings table (rdmamw/config.py): no module of the
package reads an environment variable around it -- not an ``RDMAMW_*`` setting, not a
launcher's variable (``RANK``, ``MASTER_ADDR``, ``OMPI_*``, ``PMI_*``, ``SLURM_*``,
``DMLC_*`` ...), not the whole environment -- except the few of other programs listed
in EXEMPT, each with the reason. The table declares the launchers' variables in a
section of their own; ``config.get(name, env)`` reads one from a given mapping."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from rdmamw import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "rdmamw"
TABLE = PKG / "config.py"

#: variables of other programs the package may touch outside the table, and why
EXEMPT = {
    "XDG_CONFIG_HOME": "the XDG base-directory standard's, not ours: where the token "
                       "file lives (rdmamw/auth.py), as every desktop program reads it",
    "PYTHONUNBUFFERED": "not read: `rdmamw tune` sets Python's own default so the ranks "
                        "it starts print as they go",
    "OMP_NUM_THREADS": "not read: the demo sets the BLAS libraries' own default (one "
                       "thread per rank) for the ranks it starts",
    "OPENBLAS_NUM_THREADS": "as OMP_NUM_THREADS",
    "MKL_NUM_THREADS": "as OMP_NUM_THREADS",
    "RDMAV_FORK_SAFE": "rdma-core's own (libibverbs reads it): the verbs provider only "
                       "looks whether the user set it, to know whether fork is safe",
    "IBV_FORK_SAFE": "as RDMAV_FORK_SAFE (its older name)",
}
#: what an access is called when its variable cannot be named (a computed key) or it
#: takes the whole environment (iterated, copied, passed on)
UNNAMED, WHOLE = "<computed name>", "<the whole environment>"
#: reads waiting for a change in another room: path -> variables; an entry that is no
#: longer true fails too (none now)
PENDING: dict[str, set[str]] = {}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def _constants(tree: ast.Module) -> dict[str, set[str]]:
    """Names bound to string constants: ``X = "..."`` at any level, and the target of
    ``for x in ("...", "...")``."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, set()).add(node.value.value)
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                isinstance(node.iter, (ast.Tuple, ast.List)) and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str)
                    for e in node.iter.elts):
            out.setdefault(node.target.id, set()).update(e.value for e in node.iter.elts)
    return out


def _names(key: ast.AST, consts: dict[str, set[str]]) -> set[str]:
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return {key.value}
    if isinstance(key, ast.Name) and key.id in consts:
        return consts[key.id]
    return {UNNAMED}


def python_reads(text: str) -> list[tuple[int, str]]:
    """(line, variable) of every environment access in Python source ``text``."""
    tree = ast.parse(text)
    consts = _constants(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "getenv")
                or (isinstance(node.func, ast.Name) and node.func.id == "getenv")):
            names = _names(node.args[0], consts) if node.args else {UNNAMED}
            found += [(node.lineno, n) for n in names]
        if not _is_environ(node):
            continue
        up = parents.get(node)
        call = parents.get(up) if up is not None else None
        if isinstance(up, ast.Attribute) and up.attr in ("get", "setdefault", "pop") and \
                isinstance(call, ast.Call) and call.func is up and call.args:
            names = _names(call.args[0], consts)
        elif isinstance(up, ast.Subscript) and up.value is node:
            names = _names(up.slice, consts)
        elif isinstance(up, ast.Compare) and node in up.comparators and \
                isinstance(up.ops[0], (ast.In, ast.NotIn)):
            names = _names(up.left, consts)
        elif isinstance(up, ast.ImportFrom):
            continue
        else:
            names = {WHOLE}
        found += [(node.lineno, n) for n in names]
    return found


def cython_reads(text: str) -> list[tuple[int, str]]:
    """The same for Cython (not Python's grammar): each line that touches the
    environment, with the string constants on it."""
    found = []
    for i, line in enumerate(text.splitlines(), 1):
        if re.search(r"\bos\.environ\b|\bgetenv\b|\benviron\.get\b", line.split("#")[0]):
            names = re.findall(r"[\"']([A-Za-z_][A-Za-z0-9_]*)[\"']", line) or [UNNAMED]
            found += [(i, n) for n in names]
    return found


def stray_reads(root: pathlib.Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """rdmamw/ path -> the (line, variable) of each environment access outside the
    table that EXEMPT does not excuse."""
    out: dict[str, list[tuple[int, str]]] = {}
    for path in sorted((root / "rdmamw").rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd") or path == root / "rdmamw/config.py":
            continue
        text = path.read_text()
        reads = python_reads(text) if path.suffix == ".py" else cython_reads(text)
        bad = sorted((line, name) for line, name in reads if name not in EXEMPT)
        if bad:
            out[str(path.relative_to(root))] = bad
    return out


def _report(stray: dict[str, list[tuple[int, str]]]) -> str:
    return "read around the settings table (declare it in its component's settings module, " \
           "as listed by rdmamw/config.py COMPONENTS; read it with " \
        "config.get):\n" + "\n".join(f"  {path}:{line}: {name}" for path, reads in
                                      stray.items() for line, name in reads)


def test_no_setting_is_read_around_the_table():
    stray = stray_reads()
    pending = {p: {n for _, n in stray.pop(p, [])} for p in PENDING}
    assert stray == {}, _report(stray)
    assert pending == PENDING, "a pending read moved: update PENDING"


def test_the_launchers_variables_are_declared_in_a_section_of_their_own():
    launchers = {n for n, s in config.declared().items() if s.component == "launcher"}
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
            "PMI_RANK", "SLURM_PROCID", "DMLC_ROLE", "DMLC_NUM_SERVER"} <= launchers
    assert all(config.setting(n).set_by for n in launchers)
    assert not set(EXEMPT) & set(config.declared())        # exempt means: not a setting


@pytest.mark.parametrize("source, expect", [
    ('import os\nx = os.environ.get("RDMAMW_SLOTS")\n', [(2, "RDMAMW_SLOTS")]),
    ('import os\nK = "DMLC_NUM_SERVER"\nx = int(os.environ.get(K, 0))\n',
     [(3, "DMLC_NUM_SERVER")]),
    ('import os\nx = os.environ["RANK"]\n', [(2, "RANK")]),
    ('import os\nx = os.getenv("MASTER_ADDR")\n', [(2, "MASTER_ADDR")]),
    ('import os\nx = "SLURM_PROCID" in os.environ\n', [(2, "SLURM_PROCID")]),
    ('from os import environ\nx = environ.get("RDMAMW_TOKEN")\n', [(2, "RDMAMW_TOKEN")]),
    ('import os\ndef f(env=None):\n    env = os.environ if env is None else env\n',
     [(3, WHOLE)]),
    ('import os\nd = {k: v for k, v in os.environ.items()}\n', [(2, WHOLE)]),
    ('import os\nx = os.environ.get(name())\n', [(2, UNNAMED)]),
    ('import os\nfor v in ("OMP_NUM_THREADS",):\n    os.environ.setdefault(v, "1")\n',
     [(3, "OMP_NUM_THREADS")]),
])
def test_the_finder_names_each_kind_of_read(source, expect):
    assert python_reads(source) == expect


def test_the_finder_reads_cython_lines():
    assert cython_reads('    elif os.environ.get("RDMAV_FORK_SAFE"):  # x\n    y = 1\n') == \
        [(1, "RDMAV_FORK_SAFE")]


def test_a_planted_read_fails_naming_it(tmp_path):
    """A copy of the package with one read of a setting around the table planted."""
    pkg = tmp_path / "rdmamw"
    for path in PKG.rglob("*.py"):
        dest = pkg / path.relative_to(PKG)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    policy = pkg / "collectives" / "policy.py"
    policy.write_text(policy.read_text() + '\n\ndef _planted():\n    import os\n'
                      '    return os.environ.get("RDMAMW_ALLREDUCE_ALGORITHM")\n')
    stray = stray_reads(tmp_path)
    stray.pop("rdmamw/bootstrap/__init__.py", None)
    assert list(stray) == ["rdmamw/collectives/policy.py"]
    assert [n for _, n in stray["rdmamw/collectives/policy.py"]] == \
        ["RDMAMW_ALLREDUCE_ALGORITHM"]
