"""The remote-memory examples (examples/kv_blocks.py, examples/weight_update.py) run
end to end on shm with small sizes, and check their own results."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=100)


def test_kv_blocks_reads_the_blocks_of_its_sequence_in_one_batch():
    p = run("kv_blocks.py", "--blocks", "96", "--block-kib", "8", "--want", "24", "--reps", "3")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "24 of 96 blocks (8 KiB each, 192 KiB) read in one batch (1 chain): content " \
           "correct" in p.stdout, p.stdout
    assert "GB/s" in p.stdout


def test_weight_update_readers_see_each_steps_weights_once_notified():
    p = run("weight_update.py", "--readers", "2", "--mib", "1", "--steps", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "4 steps x 2 readers x 1 MiB written with notify=: every reader checked its " \
           "weights" in p.stdout, p.stdout
