"""Perfetto's trace processor for the timeline's tests: the ``perfetto`` package drives
a ``trace_processor_shell`` it downloads at first use (no network in CI's machines:
RDMAMW_TEST_TRACE_PROCESSOR or one on PATH, else the test skips)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest


def trace_processor_bin() -> str | None:
    """Perfetto's trace_processor_shell: RDMAMW_TEST_TRACE_PROCESSOR, on PATH, or the
    one the perfetto package cached (it downloads it at first use)."""
    given = os.environ.get("RDMAMW_TEST_TRACE_PROCESSOR") or \
        shutil.which("trace_processor_shell")
    if given:
        return given
    cache = os.path.expanduser("~/.local/share/perfetto/prebuilts")
    found = sorted(f for f in os.listdir(cache) if f.startswith("trace_processor_shell")
                   and not f.endswith(".tmp")) if os.path.isdir(cache) else []
    return os.path.join(cache, found[-1]) if found else None


def query(path: str, sql: str) -> list[Any]:
    """The rows of ``sql`` on the trace at ``path`` (skips without a trace processor).
    The binary is looked for first: the package imports pandas, which in the soft-RoCE
    VM (its files read over 9p, under TCG) takes longer than a test's timeout."""
    binary = trace_processor_bin()
    if binary is None:
        pytest.skip("no trace_processor_shell: the perfetto package downloads it from "
                    "commondatastorage.googleapis.com at first use (no network here); "
                    "set RDMAMW_TEST_TRACE_PROCESSOR to one")
    tp_mod = pytest.importorskip("perfetto.trace_processor")
    tp = tp_mod.TraceProcessor(trace=path, config=tp_mod.TraceProcessorConfig(bin_path=binary))
    try:
        return list(tp.query(sql))
    finally:
        tp.close()
