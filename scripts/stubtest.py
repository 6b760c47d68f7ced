"""stubtest (mypy's) on every extension module that has a .pyi stub: it imports the
compiled module and checks each name, signature and property of the stub against it
(Cython's embedsignature makes the signatures introspectable). `make lint` runs it
after the build; tests/unit/test_stubs.py is its fast half (names only).

    python scripts/stubtest.py [stubtest options]
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

from mypy.stubtest import main as stubtest_main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def stubbed_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".")
                  for p in (ROOT / "rdmamw").rglob("_*.pyi"))


#: pyproject.toml's [tool.mypy] (the stubs are strict), less its unused-section
#: warning: a build of the stubs and what they import leaves some of its lists unused
def config_text() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    assert "warn_unused_configs = true" in text
    return text.replace("warn_unused_configs = true", "warn_unused_configs = false")


def main() -> int:
    sys.path.insert(0, str(ROOT))
    config = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
    config.write(config_text())
    config.close()
    sys.argv = [
        "stubtest", *stubbed_modules(),
        "--mypy-config-file", config.name,
        "--allowlist", str(ROOT / "scripts" / "stubtest_allowlist.txt"),
        # PEP 800's @disjoint_base: every cdef class is one; marking each adds nothing
        # a checker of this package's users needs
        "--ignore-disjoint-bases",
        *sys.argv[1:],
    ]
    try:
        return stubtest_main()
    finally:
        pathlib.Path(config.name).unlink()


if __name__ == "__main__":
    sys.exit(main())
