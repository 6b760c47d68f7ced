"""The whole stack over verbs, in the soft-RoCE VM: `rdmamw demo` (every consistency
model, and DSANA), the collectives for world sizes 2-5, and the DML examples, started
as users start them (the demo's own launcher, rdmamw.bootstrap.launch, mpirun) with
RDMAMW_PROVIDER=verbs (inside one host the providers would choose shm). Each test
checks that every channel was a verbs channel and carried the bytes: the channels'
own counters, or the line each one logs when it closes (RDMAMW_LOG_LEVEL=info)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import NO_DEVICE, VERBS_OK
from tests.test_bootstrap import ROOT, clean_env, json_objects

pytestmark = [pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)]
VERBS = {"RDMAMW_PROVIDER": "verbs", "RDMAMW_LOG_LEVEL": "info"}
COLL_WORKER = os.path.join(ROOT, "tests", "coll_worker.py")
UNTUNED = {"RDMAMW_COLL_CONFIG": os.path.join(ROOT, "tests", "no-such-config.json")}
CLOSED = re.compile(r"channel to (\S+) closed \((\w+)\): (\d+) messages / (\d+) bytes sent "
                    r"in (\d+) batches \((\d+) doorbells\), (\d+) messages / (\d+) bytes received")


def run(cmd: list[str], env: dict, cwd: str = ROOT, timeout: float = 400):
    p = subprocess.run(cmd, cwd=cwd, env={**clean_env(), "PYTHONPATH": ROOT, **env},
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def launch(n: int, *cmd: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", str(n), "--",
                sys.executable, *cmd], {**VERBS, **(env or {})})


def closed_channels(stderr: str, at_least: int) -> list[tuple]:
    """The channels' close lines: all on verbs, at least ``at_least``, and every one
    carried bytes one way or the other."""
    lines = CLOSED.findall(stderr)
    assert len(lines) >= at_least, stderr[-3000:]
    assert {x[1] for x in lines} == {"verbs"}, lines
    assert all(int(x[3]) + int(x[7]) > 0 for x in lines), lines
    assert not re.search(r"provider \((?!forced)", stderr)      # nothing chose another
    return lines


def test_demo_every_consistency_model_over_verbs(tmp_path):
    """All models in one job (2 workers, 1 server, 2 epochs), each above chance by far;
    BSP reaches exactly the accuracy it reaches over shm (its result does not depend on
    timing)."""
    args = ["-m", "rdmamw.cli", "demo", "--workers", "2", "--servers", "1", "--epochs", "2",
            "--compute-ms", "0", "--quiet", "--plot", ""]
    out = tmp_path / "verbs.json"
    p = run([sys.executable, *args, "--json", str(out)], VERBS, cwd=str(tmp_path))
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == sorted(["bsp", "asp", "ssp", "lsp", "alsp", "hybrid"])
    assert all(r["final_accuracy"] > 0.75 for r in runs.values()), runs
    closed_channels(p.stderr, 2 * 2)            # each worker <-> the server, both ends
    shm = tmp_path / "shm.json"
    run([sys.executable, *args, "--consistency", "bsp", "--json", str(shm)], {},
        cwd=str(tmp_path))
    assert json.loads(shm.read_text())["runs"][0]["final_accuracy"] == \
        runs["bsp"]["final_accuracy"]


def test_demo_with_dsana_over_verbs(tmp_path):
    out = tmp_path / "d.json"
    p = run([sys.executable, "-m", "rdmamw.cli", "demo", "--workers", "2", "--servers", "1",
             "--epochs", "2", "--compute-ms", "1", "--quiet", "--plot", "", "--consistency",
             "bsp", "--sched", "dsana", "--json", str(out)], VERBS, cwd=str(tmp_path))
    (r,) = json.loads(out.read_text())["runs"]
    assert r["name"] == "bsp+dsana" and r["final_accuracy"] > 0.75
    closed_channels(p.stderr, 4)


def coll_job(n: int, scenario: str, cfg: dict, env: dict) -> list[dict]:
    p = launch(n, COLL_WORKER, scenario, json.dumps(cfg), env={**UNTUNED, **env})
    return sorted(json_objects(p.stdout), key=lambda r: r["rank"])


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_collectives_over_verbs_match_numpy_and_shm(n):
    """Every algorithm, dtype and op against numpy, broadcast / allgather /
    reduce_scatter / barrier; then float sums whose bytes must equal the same job's on
    shm. Every channel is a verbs channel that carried the data."""
    res = coll_job(n, "stack", {"lengths": [1, 1001], "length": 4099}, {})
    assert [r["rank"] for r in res] == list(range(n))
    assert all(r["checks"] == (4 * 4 * 4 + 4 * 3) * 2 for r in res)
    for r in res:
        assert len(r["channels"]) == n - 1
        for c in r["channels"].values():
            assert c["provider"] == "verbs" and c["bytes"] > 0 and c["bytes_received"] > 0
            assert c["bytes_written"] >= c["bytes"], c
    shm = coll_job(n, "digests", {"length": 4099}, {"RDMAMW_PROVIDER": "shm"})
    assert all(c["provider"] == "shm" for r in shm for c in r["channels"].values())
    assert [r["digests"] for r in res] == [r["digests"] for r in shm]


def test_shuffle_example_over_verbs():
    p = launch(3, os.path.join(ROOT, "examples", "shuffle.py"), "--rows", "3000",
               "--features", "8", "--epoch", "1")
    rows = json_objects(p.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2] and all(r["ok"] for r in rows)
    assert sum(r["rows_in"] for r in rows) == 3 * 3000
    closed_channels(p.stderr, 6)


@pytest.mark.parametrize("via", ["collective", "channel"])
def test_broadcast_example_over_verbs(via):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import broadcast
    p = launch(3, os.path.join(ROOT, "examples", "broadcast.py"), "--mib", "1", "--via", via,
               "--root", "1")
    rows = json_objects(p.stdout)
    assert {r["digest"] for r in rows} == {broadcast.digest(broadcast.parameters(1, seed=1234))}
    assert len(rows) == 3
    closed_channels(p.stderr, 4)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun installed")
def test_collectives_under_mpirun_over_verbs():
    from rdmamw.bootstrap.launch import free_port
    p = run(["mpirun", "-n", "3", "-genv", "MASTER_PORT", str(free_port()), sys.executable,
             COLL_WORKER, "digests", json.dumps({"length": 1001})], {**VERBS, **UNTUNED})
    res = json_objects(p.stdout)
    assert sorted(r["rank"] for r in res) == [0, 1, 2]
    assert all(c["provider"] == "verbs" for r in res for c in r["channels"].values())
