"""One settings table (rdmamw/config.py): every RDMAMW_* variable the package reads is
declared in it, by its component's settings module (the core's in config.py itself), read
when used (not at import), parsed with units, and a bad value is a ConfigError naming the
variable and the value; docs/config.md is the same table."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest

import rdmamw
from rdmamw import cli, config
from rdmamw.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: a value each kind refuses
BAD = {"int": "lots", "float": "fast", "bytes": "12Q", "seconds": "soon", "bool": "maybe",
       "choice": "nonesuch"}


#: the launchers' variables (declared in a section of their own)
LAUNCHERS = {n for n, s in config.declared().items() if s.component == "launcher"}


def _names_in_sources() -> set[str]:
    """RDMAMW_* names anywhere in the package; launchers' variables named outside the
    table (read by the bootstrap, or set by our launcher)."""
    names = set()
    for path in (ROOT / "rdmamw").rglob("*"):
        if path.suffix in (".py", ".pyx", ".pxd", ".h"):
            text = path.read_text()
            names |= set(re.findall(r"RDMAMW_[A-Z0-9_]+", text))
            if path != ROOT / "rdmamw" / "config.py":
                names |= {n for n in LAUNCHERS if re.search(rf"\b{n}\b", text)}
    return {n for n in names if not n.endswith("_")}     # "RDMAMW_VERBS_*": prose


def test_every_variable_the_package_names_is_declared_once():
    named = _names_in_sources() - set(config.NOT_LIBRARY)
    assert named - set(config.declared()) == set()
    assert set(config.declared()) - named == set(), "declared but never read"


def test_the_docs_table_is_the_declared_table():
    text = (ROOT / "docs" / "config.md").read_text()
    assert config.markdown_table() in text


def test_each_component_declares_its_settings_in_its_own_module():
    owners = {component: module or "rdmamw.config" for component, module in config.COMPONENTS}
    table = config.declared()
    assert [c for c, _ in config.COMPONENTS] == list(dict.fromkeys(
        s.component for s in table.values()))
    wrong = {s.name: (s.component, s.owner) for s in table.values()
             if s.owner != owners[s.component]}
    assert wrong == {}


def test_importing_the_components_one_by_one_declares_each_ones_settings_only():
    """In a fresh process: ``import rdmamw`` declares the core's settings (and those of
    the components it imports: the channel's memory); then each module of the manifest
    not imported yet declares its own component's settings and no other's."""
    code = textwrap.dedent("""
        import importlib, json
        from rdmamw import config
        seen = {n: s.component for n, s in config.SETTINGS.items()}
        steps = [("core", sorted(set(seen.values())))]
        for component, module in config.COMPONENTS:
            if module is None or component in seen.values():
                continue
            importlib.import_module(module)
            new = {n: s.component for n, s in config.SETTINGS.items() if n not in seen}
            seen.update(new)
            steps.append((component, sorted(set(new.values()))))
        print(json.dumps(steps))
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, text=True,
                         capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)
    assert set(steps[0][1]) >= {c for c, m in config.COMPONENTS if m is None}
    assert [added for _, added in steps[1:]] == [[c] for c, _ in steps[1:]]
    assert sorted(c for _, added in steps for c in added) == \
        sorted(c for c, _ in config.COMPONENTS)


def test_a_component_reads_only_settings_its_package_declares_first():
    """Every ``config.get/raw/source/setting`` of a named setting in the package is in
    a module of the package that declares it (its ``__init__`` imports settings.py), or
    the setting is the core's: no read depends on another component's import."""
    table, stray = config.declared(), []
    for path in sorted((ROOT / "rdmamw").rglob("*")):
        if path.suffix not in (".py", ".pyx"):
            continue
        text = path.read_text()
        consts = dict(re.findall(r'^(\w+) = "([A-Z][A-Z0-9_]+)"', text, re.M))
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for key in re.findall(r"config\.(?:get|raw|source|setting)\(\s*(\"?\w+)", text):
            name = key[1:] if key.startswith('"') else consts.get(key)
            if name not in table:
                continue                    # a computed name (bootstrap/env.py's loops)
            owner = table[name].owner
            if owner != "rdmamw.config" and \
                    not module.startswith(owner.rpartition(".")[0] + "."):
                stray.append((module, name, owner))
    assert stray == []


def test_a_setting_is_declared_by_its_owner_without_the_full_listing():
    code = ("import sys, rdmamw.providers.tcp.provider\n"
            "from rdmamw import config\n"
            "print(config.get('RDMAMW_TCP_HEARTBEAT'))\n"
            "print(any(m in sys.modules for m in ('rdmamw.collectives', 'rdmamw.ps')))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), RDMAMW_TCP_HEARTBEAT="2s")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.0", "False"]


def test_import_rdmamw_imports_no_library_above_the_channel_for_its_settings():
    """The full listing (config.declared) imports every component; ``import rdmamw``
    does not ask for it unless the log is at info."""
    code = ("import sys, rdmamw\n"
            "print(sorted(m for m in sys.modules if m.startswith(('rdmamw.collectives', "
            "'rdmamw.ps'))))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RDMAMW_LOG_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_setting_not_declared_anywhere_is_a_key_error():
    for read in (config.get, config.raw, config.source, config.setting):
        with pytest.raises(KeyError):
            read("RDMAMW_NONESUCH")


def test_declaring_a_setting_twice_or_a_number_without_maximum_is_refused():
    with pytest.raises(AssertionError, match="declared twice"):
        config.declare("tcp", "RDMAMW_TCP_HEARTBEAT", "seconds", 1.0, "again")
    with pytest.raises(AssertionError, match="needs a maximum"):
        config.declare("tcp", "RDMAMW_TCP_NONESUCH", "int", 1, "unbounded")
    assert "RDMAMW_TCP_NONESUCH" not in config.SETTINGS


@pytest.mark.parametrize("name", sorted(n for n, s in config.declared().items()
                                        if s.kind in BAD))
def test_a_bad_value_is_config_error_naming_variable_and_value(monkeypatch, name):
    value = BAD[config.setting(name).kind]
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        config.get(name)
    assert name in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize("name, text, value", [
    ("RDMAMW_SLOT_SIZE", "64K", 65536), ("RDMAMW_SLOT_SIZE", "1MiB", 1 << 20),
    ("RDMAMW_MAX_PEER_RING", "1g", 1 << 30), ("RDMAMW_HANDSHAKE_TIMEOUT", "250ms", 0.25),
    ("RDMAMW_HANDSHAKE_TIMEOUT", "2m", 120.0), ("RDMAMW_TCP_HEARTBEAT", "0", 0.0),
    ("RDMAMW_SHM_CMA", "off", False), ("RDMAMW_SHM_CMA", "Yes", True),
    ("RDMAMW_PROVIDER", "TCP", "tcp"), ("RDMAMW_SLOTS", " 64 ", 64),
    ("RDMAMW_SHM_ALLOW_UIDS", "1000,1001", frozenset({1000, 1001})),
    ("RDMAMW_SHM_ALLOW_UIDS", "any", None),
])
def test_values_with_units_are_parsed(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert config.get(name) == value
    assert config.source(name) == "environment"


@pytest.mark.parametrize("name, text", [
    ("RDMAMW_SLOTS", "0"), ("RDMAMW_SLOT_SIZE", "32"), ("RDMAMW_LISTEN_BACKLOG", "4097"),
    ("RDMAMW_HANDSHAKE_TIMEOUT", "0"), ("RDMAMW_TCP_PEER_TIMEOUT", "-1"),
    ("RDMAMW_MAX_MESSAGE_SIZE", "0"), ("RDMAMW_SPIN_US", "nan"),
    ("RDMAMW_SHM_ALLOW_UIDS", "1000,-5"), ("RDMAMW_VERBS_TIMEOUT", "32"),
])
def test_values_out_of_range_are_refused(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError, match=name):
        config.get(name)


def test_unset_or_empty_is_the_default(monkeypatch):
    for name, setting in config.declared().items():
        monkeypatch.delenv(name, raising=False)
        assert config.get(name) == setting.default and config.source(name) == "default"
        monkeypatch.setenv(name, "  ")
        assert config.get(name) == setting.default


def test_settings_are_read_when_used_not_at_import(monkeypatch):
    """Every variable set to garbage: importing every module of the package works; the
    call that uses a setting fails with ConfigError naming it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name, setting in config.declared().items():
        if setting.kind in BAD and not name.startswith("RDMAMW_LOG_"):
            env[name] = BAD[setting.kind]
    code = ("import pkgutil, importlib, rdmamw\n"
            "import importlib.util\n"     # rdmamw.ray needs Ray (make test installs it)
            "skip = ('rdmamw.torch',) + (('rdmamw.ray',) if not importlib.util.find_spec('ray')"
            " else ())\n"
            "for m in pkgutil.walk_packages(rdmamw.__path__, 'rdmamw.'):\n"
            "    if not m.name.startswith(skip): importlib.import_module(m.name)\n"
            "try:\n"
            "    rdmamw.listen('shm://config-test')\n"
            "except rdmamw.errors.ConfigError as e:\n"
            "    print('ConfigError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "ConfigError: RDMAMW_" in out.stdout, out.stdout


def test_a_size_with_units_reaches_the_channel(monkeypatch):
    """RDMAMW_SLOT_SIZE=64K used to make `import rdmamw` fail with a bare ValueError."""
    monkeypatch.setenv("RDMAMW_SLOT_SIZE", "4K")
    monkeypatch.setenv("RDMAMW_SLOTS", "8")
    name = f"shm://config-units-{os.getpid()}"
    with rdmamw.listen(name) as lst, ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(lst.accept, 10)
        a = rdmamw.Channel.open(name, timeout=10)
        b = accepted.result(10)
    with a, b:
        assert (a.nslots, a.slot_size) == (8, 4096) == (b.nslots, b.slot_size)


def test_a_bad_setting_fails_the_call_that_uses_it(monkeypatch):
    monkeypatch.setenv("RDMAMW_SLOTS", "lots")
    with pytest.raises(ConfigError, match="RDMAMW_SLOTS='lots'"):
        rdmamw.listen("shm://config-bad")
    monkeypatch.setenv("RDMAMW_SLOTS", "8")
    monkeypatch.setenv("RDMAMW_OPEN_TIMEOUT", "never")
    with pytest.raises(ConfigError, match="RDMAMW_OPEN_TIMEOUT"):
        rdmamw.Channel.open("shm://config-bad")


def test_info_config_prints_every_setting_with_its_source(monkeypatch, capsys):
    for name in config.declared():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RDMAMW_SLOT_SIZE", "64K")
    monkeypatch.setenv("RDMAMW_TOKEN", "hunter2")
    monkeypatch.setenv("RDMAMW_SLOTZ", "3")
    assert cli.main(["info", "--config"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == set(config.declared())
    assert "65536" in rows["RDMAMW_SLOT_SIZE"] and "(environment)" in rows["RDMAMW_SLOT_SIZE"]
    assert "(default)" in rows["RDMAMW_SLOTS"] and " 128 " in rows["RDMAMW_SLOTS"]
    assert "hunter2" not in out and "***" in rows["RDMAMW_TOKEN"]
    assert "RDMAMW_SLOTZ" in out.splitlines()[-1]


def test_a_bad_value_shows_in_info_config_rather_than_failing_it(monkeypatch, capsys):
    monkeypatch.setenv("RDMAMW_SLOTS", "lots")
    assert cli.main(["info", "--config"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "RDMAMW_SLOTS " in x][0]
    assert "ERROR" in line and "'lots'" in line


def test_the_parameter_server_ring_has_its_own_default_and_yields_to_the_general(
        monkeypatch):
    from rdmamw.ps.job import ps_ring
    for name in ("RDMAMW_SLOTS", "RDMAMW_SLOT_SIZE", "RDMAMW_PS_SLOTS",
                 "RDMAMW_PS_SLOT_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ps_ring() == (16, 1 << 20)
    monkeypatch.setenv("RDMAMW_PS_SLOT_SIZE", "256K")
    assert ps_ring() == (16, 256 << 10)
    monkeypatch.setenv("RDMAMW_SLOTS", "8")
    monkeypatch.setenv("RDMAMW_SLOT_SIZE", "4096")
    assert ps_ring() == (8, 4096)
