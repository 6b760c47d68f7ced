"""Dependencies point down only (docs/architecture.md): no import circles in rdmamw/,
counting imports inside functions and Cython cimports, and each layer imports only
the layers below it."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "rdmamw"

#: layer -> the packages and modules it may import (besides itself and its own
#: submodules); everything not named is off limits
BELOW = {
    "rdmamw.errors": set(),
    "rdmamw.steps": set(),
    "rdmamw._fork": {"rdmamw.errors"},
    "rdmamw._host": set(),
    "rdmamw.config": {"rdmamw.errors"},
    "rdmamw.log": {"rdmamw.errors", "rdmamw._fork", "rdmamw.config"},
    "rdmamw.transport": {"rdmamw.errors", "rdmamw._fork", "rdmamw.config"},
    "rdmamw.bitmap": {"rdmamw.errors", "rdmamw.transport"},
    "rdmamw.auth": {"rdmamw.errors", "rdmamw.config", "rdmamw.transport"},
    "rdmamw.engine": {"rdmamw.errors", "rdmamw._fork", "rdmamw.transport", "rdmamw.bitmap"},
    "rdmamw.memory": {"rdmamw.errors", "rdmamw._fork", "rdmamw.config"},
    #: the accept loop of every listener: the providers' and the bootstrap store's
    "rdmamw.listener": {"rdmamw.errors", "rdmamw.config", "rdmamw.auth"},
    "rdmamw.providers": {"rdmamw.errors", "rdmamw._fork", "rdmamw._host", "rdmamw.config",
                         "rdmamw.log", "rdmamw.transport", "rdmamw.auth", "rdmamw.listener"},
    "rdmamw.bootstrap": {"rdmamw.errors", "rdmamw._fork", "rdmamw._host", "rdmamw.config",
                         "rdmamw.log", "rdmamw.transport", "rdmamw.auth", "rdmamw.listener",
                         "rdmamw.providers"},
}
#: the package's shared words (channel modes, rendezvous strategies): below everything,
#: importable from everywhere, as rdmamw.errors is
for _allowed in BELOW.values():
    _allowed.add("rdmamw.vocabulary")
BELOW["rdmamw.vocabulary"] = set()
#: where the channels and collectives report what they did, for rdmamw.metrics above them
#: (rdmamw/observe.py): below everything but rdmamw._fork
for _allowed in BELOW.values():
    _allowed.add("rdmamw.observe")
BELOW["rdmamw.observe"] = {"rdmamw._fork", "rdmamw.errors", "rdmamw.vocabulary"}
BELOW["rdmamw._fork"].discard("rdmamw.observe")
BELOW["rdmamw.errors"].discard("rdmamw.observe")
BELOW["rdmamw.channel"] = set(BELOW) | {"rdmamw.memory"}
LIBS = set(BELOW["rdmamw.channel"]) | {"rdmamw.channel", "rdmamw"}
BELOW["rdmamw.collectives"] = LIBS
BELOW["rdmamw.sched"] = LIBS
BELOW["rdmamw.ps"] = LIBS | {"rdmamw.sched"}
BELOW["rdmamw.torch"] = LIBS | {"rdmamw.collectives", "rdmamw.ps"}
BELOW["rdmamw.aio"] = LIBS | {"rdmamw.collectives", "rdmamw.ps"}   # aio.collectives, aio.ps
BELOW["rdmamw.dask"] = LIBS | {"rdmamw.aio"}
BELOW["rdmamw.ray"] = LIBS | {"rdmamw.torch"}      # the torch backend's process group
#: reads what rdmamw.observe collected; imported by the package's front door (rdmamw)
BELOW["rdmamw.metrics"] = set(LIBS)
#: the timeline: fed by rdmamw.observe's hooks, as the metrics are
BELOW["rdmamw.trace"] = set(LIBS)
#: applications may use every library, never each other's insides
APPS = ("rdmamw.apps", "rdmamw.cli")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PKG.rglob("*"):
        if path.suffix not in (".py", ".pyx", ".pxd") or path.name.endswith(".c"):
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods.setdefault(name.removesuffix(".__init__"), path)
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path) -> set[str]:
    """The rdmamw modules ``path`` imports anywhere (inside functions too): for
    ``from P import x`` the module ``P.x`` if there is one, else ``P``."""
    text, out = path.read_text(), set()
    if path.suffix in (".pyx", ".pxd"):
        pat = r"^\s*(?:from\s+(rdmamw[\w.]*)\s+c?import\s+([\w, ()*]+)|c?import\s+(rdmamw[\w.]*))"
        for base_from, names, base_import in re.findall(pat, text, re.M):
            base = base_from or base_import
            subs = {f"{base}.{n}" for n in re.findall(r"\w+", names)} & set(MODULES)
            out |= subs or {_resolve(base)}
        return out
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names if a.name.startswith("rdmamw")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("rdmamw"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            out |= subs
            if len(subs) < len(node.names):
                out.add(_resolve(node.module))
    return out


GRAPH = {m: _imports(p) - {m, ""} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _layer(module: str) -> str | None:
    best = None
    for layer in (*BELOW, *APPS):
        if (module == layer or module.startswith(layer + ".")) and \
                (best is None or len(layer) > len(best)):
            best = layer
    return best


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_planted_circle():
    planted = {k: set(v) for k, v in GRAPH.items()}
    planted["rdmamw.transport.wire"].add("rdmamw.channel.channel")
    assert any("rdmamw.transport.wire" in c for c in _cycles(planted))


@pytest.mark.parametrize("layer", sorted(BELOW))
def test_each_layer_imports_only_what_is_below_it(layer):
    allowed = BELOW[layer]
    wrong = {}
    for module, deps in GRAPH.items():
        if _layer(module) != layer:
            continue
        for dep in deps:
            target = _layer(dep) or dep
            if target != layer and target not in allowed:
                wrong.setdefault(module, set()).add(dep)
    assert wrong == {}


def test_no_library_imports_an_application():
    users = {m: {d for d in deps if _layer(d) in APPS} for m, deps in GRAPH.items()
             if _layer(m) not in APPS}
    assert {m: d for m, d in users.items() if d} == {}


def test_the_package_never_imports_its_test_hooks():
    """The test-only hooks are not in the package (tests/support/hooks.py, built by
    tests/support/build_hooks.py), and no module of it imports anything of tests/."""
    assert "rdmamw.testing" not in MODULES
    users = {m for m, p in MODULES.items()
             if re.search(r"^\s*(?:from|c?import)\s+tests\b", p.read_text(), re.M)}
    assert users == set()


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) is None and m != "rdmamw"] == []


# ---- the providers: a package each, one inner shape (docs/architecture.md) ------------

PROVIDERS = PKG / "providers"
#: the built-in providers' packages
PROVIDER_PACKAGES = sorted(p.name for p in PROVIDERS.iterdir()
                           if (p / "__init__.py").is_file())
#: what each provider's package holds: its PROVIDER, the module that makes connections,
#: the transport extension the engine drives
SHAPE = ("__init__.py", "provider.py", "_transport.pyx", "_transport.pxd")
#: lines a provider's module may have, at most
MAX_LINES = 600


def test_the_builtin_providers_are_the_packages():
    from rdmamw.providers import BUILTIN
    assert PROVIDER_PACKAGES == sorted(BUILTIN)
    assert BUILTIN == {p: f"rdmamw.providers.{p}.provider" for p in PROVIDER_PACKAGES}


@pytest.mark.parametrize("name", PROVIDER_PACKAGES)
def test_every_provider_package_has_the_shape(name):
    pkg = PROVIDERS / name
    assert [f for f in SHAPE if not (pkg / f).is_file()] == []
    assert f"from rdmamw.providers.{name}.provider import PROVIDER" in \
        (pkg / "__init__.py").read_text()
    assert not list(pkg.glob("*/")) or all(p.name == "__pycache__" for p in pkg.glob("*/"))


@pytest.mark.parametrize("name", PROVIDER_PACKAGES)
def test_a_provider_imports_no_other_provider(name):
    """Each provider's package uses its own modules, the registry and the protocol
    (rdmamw.providers, .base), never another provider's."""
    own = f"rdmamw.providers.{name}"
    wrong = {m: {d for d in deps if d.startswith("rdmamw.providers.")
                 and d != "rdmamw.providers.base" and not d.startswith(own)}
             for m, deps in GRAPH.items() if m == own or m.startswith(own + ".")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_the_registry_names_no_provider_module():
    """rdmamw.providers and .base import no provider: BUILTIN names them as strings."""
    for m in ("rdmamw.providers", "rdmamw.providers.base"):
        assert {d for d in GRAPH[m] if d.startswith("rdmamw.providers.")} <= \
            {"rdmamw.providers.base"}, m


def _long_modules(root: pathlib.Path, limit: int) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines())
             for p in sorted(root.rglob("*")) if p.suffix in (".py", ".pyx", ".pxd", ".h")}
    return {p: n for p, n in sizes.items() if n > limit}


def test_no_provider_module_is_over_600_lines():
    assert _long_modules(PROVIDERS, MAX_LINES) == {}


def test_the_length_check_sees_a_long_module(tmp_path):
    (tmp_path / "_long.pyx").write_text("pass\n" * (MAX_LINES + 1))
    (tmp_path / "short.h").write_text("/* */\n" * MAX_LINES)
    assert list(_long_modules(tmp_path, MAX_LINES).values()) == [MAX_LINES + 1]
