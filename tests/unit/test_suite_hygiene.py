"""The suite itself: its own settings whatever the user tuned, conftest imported once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFTEST = os.path.join(ROOT, "tests", "conftest.py")
ORDERING = "tests/channel/test_channel_basic.py::test_batch_of_mixed_buffers_keeps_order"

PROBE = f"""
import sys
def pytest_collection_finish(session):
    names = sorted(n for n, m in list(sys.modules.items())
                   if getattr(m, "__file__", None) == {CONFTEST!r})
    print("CONFTEST-MODULES", names)
"""


def pytest_run(*args: str, env: dict, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_users_tuning_file_and_variables_do_not_change_outcomes(tmp_path):
    """A rendezvous.json tuned to `write` above 1 KiB (and RDMAMW_RNDV_* saying the
    same) made the mixed-batch ordering tests time out; the suite ignores both."""
    cfg = tmp_path / ".config" / "rdmamw"
    cfg.mkdir(parents=True)
    tuned = {"strategy": "write", "threshold": 1024}
    (cfg / "rendezvous.json").write_text(json.dumps(
        {"version": 1, "providers": {"shm": tuned, "tcp": tuned}}))
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / ".config"),
           "RDMAMW_RNDV_STRATEGY": "write", "RDMAMW_RNDV_THRESHOLD": "1K",
           "PYTHONPATH": ROOT, "RDMAMW_TEST_PROVIDERS": "shm,tcp"}
    out = pytest_run(ORDERING, "-k", "shm or tcp", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "4 passed" in out.stdout, out.stdout[-2000:]


def test_the_suite_environment_is_its_own():
    """What every test (and every rank it launches) inherits."""
    assert not any(n.startswith("RDMAMW_") and n not in
                   ("RDMAMW_TEST_PROVIDERS", "RDMAMW_PROVIDER_PLUGINS", "RDMAMW_VM",
                    "RDMAMW_VERBS_DEVICE", "RDMAMW_VERBS_PORT", "RDMAMW_VERBS_GID_INDEX")
                   for n in os.environ)
    home = os.environ["HOME"]
    assert os.path.basename(home).startswith("rdmamw-test-home-")
    assert os.environ["XDG_CONFIG_HOME"] == os.path.join(home, ".config")
    child = subprocess.run([sys.executable, "-c", "import pathlib; print(pathlib.Path.home())"],
                           capture_output=True, text=True, timeout=60)
    assert child.stdout.strip() == home


def test_conftest_is_imported_once(tmp_path):
    """Collecting the whole suite leaves one module for tests/conftest.py (test modules
    that imported it as `tests.conftest` made a second one, with its own name counter)."""
    (tmp_path / "conftest_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])}
    out = pytest_run("--collect-only", "-p", "conftest_probe", "tests", env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "CONFTEST-MODULES ['conftest']" in out.stdout, out.stdout[-2000:]


def test_ranks_still_running_when_a_timeout_fires_are_reaped(monkeypatch):
    """What run_job (test_bootstrap) does when its ranks do not finish in time: the
    timeout propagates and no rank is left running."""
    from tests.integrations import test_bootstrap
    procs = []
    real = subprocess.Popen

    def popen(*a, **k):
        procs.append(real([sys.executable, "-c", "import time; time.sleep(60)"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return procs[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(subprocess.TimeoutExpired):
        test_bootstrap.run_job(2, timeout=0.5)
    assert len(procs) == 2 and [p.poll() for p in procs] == [-9, -9]
