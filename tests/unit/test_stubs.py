"""The .pyi stubs of the extension modules say what the compiled modules have: every
extension that Python code imports has a stub, and each stub names exactly the public
functions, constants, classes, methods and attributes the module has at run time (no
more, no fewer). Signatures and types are stubtest's (`make lint`,
scripts/stubtest.py); this is the fast check the unit suite runs on every build."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

import pytest

from tests.unit.test_hooks_not_in_wheel import setup_extensions

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "rdmamw"

#: extensions with no stub: the engine's units, whose API is C-level (cimported by
#: _engine.pyx through their .pxd) and which no Python code imports
INTERNAL = {f"rdmamw.engine.{unit}" for unit in (
    "_link", "_leases", "_batch", "_rndv_send", "_eager_send", "_eager_recv",
    "_rndv_recv", "_waits")}

#: what Cython adds to every module and cdef class: no API
CYTHON_NAMES = {"__test__", "__pyx_capi__", "__pyx_vtable__", "__reduce_cython__",
                "__setstate_cython__"}


def stub_path(module: str) -> pathlib.Path:
    return ROOT / (module.replace(".", "/") + ".pyi")


def extensions() -> list[str]:
    return [e.name for e in setup_extensions()]


def stubbed() -> list[str]:
    return [m for m in extensions() if m not in INTERNAL]


def public(name: str) -> bool:
    return not name.startswith("_") and name not in CYTHON_NAMES


def imported_by_python() -> set[str]:
    """rdmamw.* modules that the package's .py files import (by statement or by
    importlib.import_module("...") with a literal name)."""
    found = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                found.add(node.args[0].value)
    return found


def stub_names(module: str) -> tuple[set[str], dict[str, set[str]]]:
    """The stub's public top-level names and, per class, its public member names."""
    tree = ast.parse(stub_path(module).read_text())
    names, classes = set(), {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            classes[node.name] = {m for m in members if public(m)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if public(n)}, classes


def runtime_names(module: str) -> tuple[set[str], dict[str, set[str]]]:
    """The compiled module's public names defined in it (not the ones it imports) and,
    per class, the public members its own __dict__ holds."""
    mod = importlib.import_module(module)
    names, classes = set(), {}
    for name, obj in vars(mod).items():
        if not public(name) or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", module) not in (module, None) and (
                inspect.isclass(obj) or callable(obj)):
            continue        # imported from elsewhere (rdmamw.errors, ...)
        names.add(name)
        if inspect.isclass(obj):
            classes[name] = {m for m in vars(obj) if public(m)}
    return names, classes


def test_every_extension_is_stubbed_or_internal():
    exts = extensions()
    assert set(INTERNAL) <= set(exts), sorted(set(INTERNAL) - set(exts))
    missing = [m for m in stubbed() if not stub_path(m).is_file()]
    assert not missing, f"extension modules without a .pyi stub: {missing}"
    # a stub for every extension module Python code imports, so none is untyped
    assert not sorted(INTERNAL & imported_by_python()), "an INTERNAL module is imported"
    strays = sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("_*.pyi")
                    if str(p.relative_to(ROOT))[:-4].replace("/", ".") not in exts)
    assert not strays, f"stubs of no extension: {strays}"


@pytest.mark.parametrize("module", stubbed())
def test_stub_names_match_the_compiled_module(module):
    got_names, got_classes = runtime_names(module)
    want_names, want_classes = stub_names(module)
    assert sorted(got_names - want_names) == [], f"{module}: not in the stub"
    assert sorted(want_names - got_names) == [], f"{module}: in the stub, not in the module"
    for cls in sorted(got_classes.keys() & want_classes.keys()):
        got, want = got_classes[cls], want_classes[cls]
        assert sorted(got - want) == [], f"{module}.{cls}: not in the stub"
        assert sorted(want - got) == [], f"{module}.{cls}: in the stub, not in the class"


def test_stubs_ship_in_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"**/*.pyi"' in text and '"py.typed"' in text
