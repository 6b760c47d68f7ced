"""The per-message path's instruction budget: valgrind's count of one 8 B send + receive
+ release at batch 1 (bench/instructions.py) stays within 1 % of the count committed in
bench/instructions_baseline.json, which is updated deliberately (``--record``) when a
change is meant to cost more. The callgrind run is slow (~30 s: ``make test-slow``,
``make instructions``); the arithmetic around it is not."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("instructions", ROOT / "bench" / "instructions.py")
ins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ins)


def test_the_budget_allows_one_percent_and_no_more():
    base = {"batch1": 4000.0}
    assert ins.over_budget(4040.0, base, "batch1", 0.01) is None
    assert ins.over_budget(3000.0, base, "batch1", 0.01) is None
    why = ins.over_budget(4040.5, base, "batch1", 0.01)
    assert why is not None and "4,040.5" in why and "4,000.0" in why


def test_batches_read_as_messages_per_call_and_baseline_keys():
    assert [ins.per_batch(b) for b in ("1", "16", "one", "many256")] == [1, 16, 1, 256]
    assert [ins.baseline_key(b) for b in ("1", "one", "many256")] == \
        ["batch1", "one", "many256"]


def test_cython_names_read_as_module_class_function():
    assert ins.demangle("__pyx_f_6rdmamw_6engine_7_engine_6Engine__send") == \
        "engine._engine.Engine._send"
    assert ins.demangle("__pyx_pw_6rdmamw_6engine_7_engine_6Engine_7send_batch") == \
        "engine._engine.Engine.send_batch (wrapper)"
    assert ins.demangle("__pyx_tp_dealloc_6rdmamw_6engine_9_messages_Message") == \
        "engine._messages.Message.dealloc"
    assert ins.demangle("take_gil") == "take_gil"


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["1", "one"])     # send_batch/recv_batch; send/recv
def test_instructions_per_message_within_the_baseline(batch):
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        pytest.skip("valgrind (callgrind) is not installed (apt-get install valgrind)")
    base = json.loads(ins.BASELINE.read_text())
    here = ins.build()
    if {k: base.get(k) for k in here} != here:
        pytest.skip(f"the baseline was counted on {base.get('python')} / Cython "
                    f"{base.get('cython')}, this is {here['python']} / Cython "
                    f"{here['cython']}: counts differ between builds (re-record with "
                    f"bench/instructions.py --record)")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "instructions.py"), "--check",
                        "--batch", batch],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout + r.stderr
