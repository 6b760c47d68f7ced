"""The `rdmamw` command: `demo-stream` (the batched-vs-ack stream that `demo` was
before it became the training cluster) still runs; `demo -h` is the cluster's."""

from __future__ import annotations

import pytest

from rdmamw import cli


def test_demo_stream_compares_batched_and_ack(capsys):
    assert cli.main(["demo-stream", "--seconds", "0.2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "demo-stream" in out and "batched moves" in out
    assert sum(line.split()[0] in ("batched", "ack") for line in out.splitlines()
               if line.strip()) == 4


def test_demo_help_is_the_training_cluster(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--consistency" in out and "--straggler" in out and "--plot" in out
