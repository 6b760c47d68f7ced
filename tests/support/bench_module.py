"""A bench script (bench/ is not a package) loaded as a module, for the unit tests of
its parsers and tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str, relpath: str) -> ModuleType:
    """``bench/<relpath>`` as the module ``name`` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / relpath)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
