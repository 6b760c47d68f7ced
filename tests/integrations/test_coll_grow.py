"""A lost rank's replacement re-joins the running job and the members take it back
(rdmamw/bootstrap/rejoin.py, rdmamw/collectives/grow.py): 4 ranks loop an allreduce,
rank 2 is killed, the survivors shrink and go on; a new process started with rank 2's
launcher environment re-joins; everyone grows back to 4 and the next allreduce is
right. A stranger (another job, another token) cannot take a rank's place, nor a
second process while the rank's own is a live member."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

import numpy as np
import pytest

from rdmamw.bootstrap.launch import free_port, job_env
from tests.integrations.test_bootstrap import ROOT
from tests.integrations.test_job_identity import PROBE
from tests.support.helpers import NO_DEVICE, VERBS_OK, reap

WORKER = os.path.join(ROOT, "tests", "support", "grow_worker.py")
VICTIM, N = 2, 4
#: shm and tcp here; verbs in the soft-RoCE VM (the device half of make test)
PROVIDERS = ["shm", "tcp", pytest.param("verbs", marks=[
    pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)])]


def start(rank: int, port: int, token: str, provider: str, mode: str, logs: str,
          **extra: str) -> subprocess.Popen:
    """Rank ``rank`` of the job (a ``member``, or the ``replacement``); its stderr
    goes to a file in ``logs``."""
    env = {"RDMAMW_PROVIDER": provider} if provider != "shm" else {}
    with open(os.path.join(logs, f"rank{rank}-{mode}.log"), "w") as err:
        # (the members' grow waits for the probes and the replacement's start: slow
        # under the VM's TCG)
        wait = "240" if provider == "verbs" else "30"
        return subprocess.Popen([sys.executable, WORKER, "20", mode, wait], cwd=ROOT,
                                text=True,
                                env=job_env(rank, N, "127.0.0.1", port, token,
                                            {**env, **extra}),
                                stdout=subprocess.PIPE, stderr=err)


def probe(rank: int, port: int, token: str, timeout: float, **extra: str) -> dict:
    """``rdmamw.init()`` of a process with rank ``rank``'s environment (and ``extra``)."""
    r = subprocess.run([sys.executable, "-c", PROBE, str(timeout)], cwd=ROOT, text=True,
                       capture_output=True, timeout=120,
                       env=job_env(rank, N, "127.0.0.1", port, token, extra))
    assert r.stdout, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.timeout(400)      # under the VM's TCG a Python start costs 10-20 s
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_replacement_rank_rejoins_and_the_job_is_whole_again(provider, tmp_path):
    port, token, logs = free_port(), secrets.token_hex(32), str(tmp_path)
    job = {"RDMAMW_JOB_ID": "grow-test"}
    procs = [start(r, port, token, provider, "member", logs, **job) for r in range(N)]
    try:
        for p in procs:
            assert json.loads(p.stdout.readline())["ready"]
        # while rank 2 is a live member, nobody takes its place
        busy = probe(VICTIM, port, token, 2.0, **job)
        assert "still a member" in busy.get("msg", ""), busy
        os.kill(procs[VICTIM].pid, signal.SIGKILL)
        survivors = [p for r, p in enumerate(procs) if r != VICTIM]
        shrunk = [json.loads(p.stdout.readline()) for p in survivors]
        for s in shrunk:
            assert (s["named"], s["shrunk"]) == (VICTIM, [0, 1, 3]), s
            assert (s["sum"], s["same"]) == (7.0, True), s
        # strangers cannot take the free place: another job's id, another token
        other = probe(VICTIM, port, token, 2.0, RDMAMW_JOB_ID="another")
        assert "another job" in other.get("msg", ""), other
        wrong = probe(VICTIM, port, "x" * 64, 2.0, **job)
        assert "AuthError" in wrong.get("mro", []), wrong
        procs.append(start(VICTIM, port, token, provider, "replacement", logs, **job))
        out = [json.loads(p.stdout.readline()) for p in [*survivors, procs[-1]]]
    finally:
        reap(procs)
    want = (np.arange(3000, dtype=np.float64) * 10).tolist()      # (1 + 2 + 3 + 4)
    assert sorted(o["rank"] for o in out) == [0, 1, 2, 3]
    for o in out:
        assert (o["members"], o["new_rank"]) == ([0, 1, 2, 3], o["rank"]), o["rank"]
        assert o["result"] == want, o["rank"]
