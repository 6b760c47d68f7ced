"""The test-only hooks (tests/support/_hooks.pyx: put a queue pair in error, forge a
peer's records) are not in the wheel a user installs: what ``pip install .`` builds is
setup.py's extensions and the packages pyproject.toml finds (``rdmamw*``), and neither
holds them; the suite builds them in place (tests/support/build_hooks.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def setup_extensions() -> list:
    """The Extension objects setup.py hands to setup(), without building anything."""
    import setuptools
    from Cython import Build
    got: dict = {}
    real_setup, real_cythonize = setuptools.setup, Build.cythonize
    setuptools.setup = lambda **kw: got.update(kw)
    Build.cythonize = lambda exts, **kw: exts
    try:
        exec(compile((ROOT / "setup.py").read_text(), str(ROOT / "setup.py"), "exec"),
             {"__name__": "__main__", "__file__": str(ROOT / "setup.py")})
    finally:
        setuptools.setup, Build.cythonize = real_setup, real_cythonize
    return got["ext_modules"]


def tracked(under: str) -> list[str]:
    return subprocess.run(["git", "ls-files", under], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.split()


def test_the_wheel_has_no_test_hooks():
    exts = setup_extensions()
    assert exts and all(e.name.startswith("rdmamw.") for e in exts), [e.name for e in exts]
    assert not [e.name for e in exts if "_hooks" in e.name or ".testing" in e.name]
    assert not [s for e in exts for s in e.sources if not s.startswith("rdmamw/")]
    # the packages: pyproject finds rdmamw* only, and no file of rdmamw/ is a hook
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[tool\.setuptools\.packages\.find\]\ninclude = \["rdmamw\*"\]$',
                     pyproject, re.M)
    assert not [f for f in tracked("rdmamw") if "_hooks" in f or f.startswith("rdmamw/testing/")]
    assert "tests/support/_hooks.pyx" in tracked("tests/support")
