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

from tests.integrations.test_bootstrap import ROOT, clean_env, json_objects
from tests.support.helpers import NO_DEVICE, VERBS_OK

pytestmark = [pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE),
              pytest.mark.timeout(400)]        # jobs of several ranks under TCG
VERBS = {"RDMAMW_PROVIDER": "verbs", "RDMAMW_LOG_LEVEL": "info"}
COLL_WORKER = os.path.join(ROOT, "tests", "support", "coll_worker.py")
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


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> str:
    """The demo's data split: the one scripts/test-device.sh saved on the host
    (DEVICE_TEST_DIGITS; sklearn takes minutes to import under TCG), else made here."""
    saved = os.environ.get("DEVICE_TEST_DIGITS", "")
    if saved and os.path.exists(saved):
        return saved
    pytest.importorskip("sklearn")
    from rdmamw.apps.demo import mlp
    path = str(tmp_path_factory.mktemp("demo") / "digits.npz")
    mlp.load(seed=0).save(path)
    return path


def demo_job(digits: str, out, env: dict, *args: str) -> subprocess.CompletedProcess:
    """`rdmamw demo` as its ranks run under a launcher (here the project's): 2 workers,
    1 server, 2 epochs; figures in ``out``."""
    return launch(3, "-m", "rdmamw.apps.demo.demo", "--workers", "2", "--servers", "1",
                  "--epochs", "2", "--compute-ms", "0", "--quiet", "--plot", "", "--data",
                  digits, "--json", str(out), *args, env=env)


@pytest.mark.timeout(900)
def test_demo_every_consistency_model_and_dsana_over_verbs(tmp_path, digits):
    """Two models, each with and without DSANA, in one job: each far above chance; BSP
    reaches exactly the accuracy it reaches over shm (its result does not depend on
    timing). Two models here (every job takes minutes under TCG); on the host every
    model runs in tests/integrations/test_ps.py and the demo in
    tests/integrations/test_ps_demo.py."""
    out = tmp_path / "verbs.json"
    p = demo_job(digits, out, {}, "--consistency", "bsp,alsp", "--sched", "none,dsana")
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == ["alsp", "alsp+dsana", "bsp", "bsp+dsana"]
    assert all(r["final_accuracy"] > 0.75 for r in runs.values()), runs
    closed_channels(p.stderr, 2 * 2)            # each worker <-> the server, both ends
    demo_job(digits, tmp_path / "shm.json", {"RDMAMW_PROVIDER": "shm"}, "--consistency", "bsp")
    (shm,) = json.loads((tmp_path / "shm.json").read_text())["runs"]
    assert shm["final_accuracy"] == runs["bsp"]["final_accuracy"]


def coll_job(n: int, scenario: str, cfg: dict, env: dict) -> list[dict]:
    p = launch(n, COLL_WORKER, scenario, json.dumps(cfg), env={**UNTUNED, **env})
    return sorted(json_objects(p.stdout), key=lambda r: r["rank"])


# 3 (rhd's odd case, compared with shm) and 4 in `make test`: ~2 min each under TCG
@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), 3, 4,
                               pytest.param(5, marks=pytest.mark.slow)])
def test_collectives_over_verbs(n):
    """Every allreduce algorithm (exact against numpy on int64), broadcast, allgather,
    reduce_scatter and barrier; every channel a verbs channel that carried the data.
    The full matrix of algorithms x dtypes x ops runs on the host (test_collectives).
    For 3 ranks (rhd's odd case) the float32 sums, whose bytes depend on the order of
    additions, must equal the same job's on shm."""
    res = coll_job(n, "stack", {"length": 1001}, {})
    assert [r["rank"] for r in res] == list(range(n))
    assert all(r["checks"] == 7 for r in res)
    assert len({json.dumps(r["digests"]) for r in res}) == 1       # all ranks agree
    for r in res:       # some pairs carry data one way only (e.g. rhd's odd rank)
        assert len(r["channels"]) == n - 1
        for c in r["channels"].values():
            assert c["provider"] == "verbs" and c["bytes"] + c["bytes_received"] > 0, c
            assert c["bytes_written"] >= c["bytes"], c
        assert sum(c["bytes"] for c in r["channels"].values()) > 1001 * 8
    if n == 3:
        shm = coll_job(n, "digests", {"length": 1001}, {"RDMAMW_PROVIDER": "shm"})
        assert all(c["provider"] == "shm" for r in shm for c in r["channels"].values())
        assert [r["digests"] for r in res] == [r["digests"] for r in shm]


def test_shuffle_example_over_verbs():
    p = launch(3, os.path.join(ROOT, "examples", "shuffle.py"), "--rows", "3000",
               "--features", "8", "--epoch", "1")
    rows = json_objects(p.stdout)
    assert sorted(r["rank"] for r in rows) == [0, 1, 2] and all(r["ok"] for r in rows)
    assert sum(r["rows_in"] for r in rows) == 3 * 3000
    closed_channels(p.stderr, 6)


@pytest.mark.slow      # the broadcast collective runs over verbs in test_collectives_over_verbs
def test_broadcast_example_over_verbs():
    """The plain-channel variant (the collective one is broadcast above)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import broadcast
    p = launch(3, os.path.join(ROOT, "examples", "broadcast.py"), "--mib", "1", "--via", "channel",
               "--root", "1")
    rows = json_objects(p.stdout)
    assert {r["digest"] for r in rows} == {broadcast.digest(broadcast.parameters(1, seed=1234))}
    assert len(rows) == 3
    closed_channels(p.stderr, 4)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun installed")
def test_job_under_mpirun_over_verbs():
    from rdmamw.bootstrap.launch import free_port
    p = run(["mpirun", "-n", "2", "-genv", "MASTER_PORT", str(free_port()), sys.executable,
             os.path.join(ROOT, "tests", "support", "bootstrap_worker.py"), "60"], VERBS)
    res = json_objects(p.stdout)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert {r["launcher"] for r in res} == {"mpich"}
    assert [r["channel_provider"] for r in sorted(res, key=lambda r: r["rank"])] == \
        [{"1": "verbs"}, {"0": "verbs"}]
