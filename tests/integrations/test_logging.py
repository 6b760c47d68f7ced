"""RDMAMW_LOG_LEVEL / RDMAMW_LOG_FILE: what an operator sees at info level, where it
goes, and that an application's own logging set-up is respected (rdmamw/log.py).
Each case runs in a fresh interpreter, since logging is configured on import."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from rdmamw.bootstrap.launch import free_port
from tests.integrations.test_bootstrap import WORKER, clean_env
from tests.support.helpers import reap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a listener, a channel to it, one message, then a peer that dies without closing
PAIR = """
import os, sys, threading
{prelude}
import rdmamw
lst = rdmamw.listen("shm://log-{tag}-%d" % os.getpid())
pid = os.fork()
if pid == 0:
    ch = rdmamw.Channel.open(lst.address, timeout=10)
    ch.send(b"hello").wait(5)
    os._exit(0)                     # no close: the parent sees PeerLost
ch = lst.accept(timeout=10)
assert bytes(ch.recv(timeout=5)) == b"hello"
os.waitpid(pid, 0)
try:
    ch.recv(timeout=5)
except rdmamw.PeerLost:
    print("lost", flush=True)
print(os.getpid(), flush=True)
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("RDMAMW_LOG")}
    full.update(PYTHONPATH=ROOT, **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, timeout=60,
                          capture_output=True, text=True)


def pair(tag: str, prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    out = run(PAIR.format(tag=tag, prelude=prelude), **env)
    assert out.returncode == 0 and "lost" in out.stdout, out.stdout + out.stderr
    return out


def test_info_level_logs_settings_connects_accepts_and_peer_lost():
    err = pair("info", RDMAMW_LOG_LEVEL="info", RDMAMW_TOKEN="sekrit").stderr
    lines = err.splitlines()
    assert any("rdmamw settings:" in s and "RDMAMW_LOG_LEVEL" in s for s in lines), err
    assert "sekrit" not in err                                  # the token is masked
    assert sum("channel accepted on shm://log-info-" in s for s in lines) == 1, err
    assert any("rendezvous for shm:" in s for s in lines), err
    assert sum("PeerLost on the channel with shm://log-info-" in s for s in lines) == 1, err
    assert any(f"{socket.gethostname()}:" in s for s in lines), err   # host:pid prefix


def test_the_opener_logs_its_connect_once():
    code = """
import threading, rdmamw
lst = rdmamw.listen("tcp://127.0.0.1:0")
t = threading.Thread(target=lambda: lst.accept(timeout=10)); t.start()
ch = rdmamw.Channel.open(lst.address, timeout=10); t.join()
"""
    err = run(code, RDMAMW_LOG_LEVEL="INFO").stderr
    assert sum("channel opened to tcp://127.0.0.1:" in s for s in err.splitlines()) == 1, err
    assert sum("channel accepted on tcp://127.0.0.1:" in s for s in err.splitlines()) == 1, err


def test_default_level_is_quiet_about_info():
    out = pair("quiet")
    assert "channel accepted" not in out.stderr and "settings" not in out.stderr, out.stderr


def test_log_file_with_host_and_pid(tmp_path):
    pattern = str(tmp_path / "rdmamw-%h-%p.log")
    out = pair("file", RDMAMW_LOG_LEVEL="info", RDMAMW_LOG_FILE=pattern)
    pid = out.stdout.split()[-1]
    path = tmp_path / f"rdmamw-{socket.gethostname()}-{pid}.log"
    assert path.exists(), sorted(os.listdir(tmp_path))
    text = path.read_text()
    assert "channel accepted on shm://log-file-" in text and "PeerLost" in text
    assert "channel accepted" not in out.stderr          # the file, not stderr as well


def test_application_logging_is_respected_not_duplicated():
    for prelude in ("import logging; logging.basicConfig(level=logging.INFO)",
                    ""):
        code = PAIR.format(tag="app", prelude=prelude)
        if not prelude:         # configured after the import of rdmamw
            code = code.replace("ch = lst.accept",
                                "import logging; logging.basicConfig(level=logging.INFO)\n"
                                "ch = lst.accept", 1)
        out = run(code, RDMAMW_LOG_LEVEL="info")
        lines = out.stderr.splitlines()
        assert sum("channel accepted on shm://log-app-" in s for s in lines) == 1, out.stderr


def test_root_logger_untouched():
    code = ("import logging, rdmamw; r = logging.getLogger(); "
            "print(r.handlers, logging.getLevelName(r.level), "
            "logging.getLevelName(logging.getLogger('rdmamw').level))")
    out = run(code, RDMAMW_LOG_LEVEL="debug")
    assert out.stdout.split() == ["[]", "WARNING", "DEBUG"], out.stdout + out.stderr
    out = run(code)
    assert out.stdout.split() == ["[]", "WARNING", "WARNING"], out.stdout + out.stderr


def test_bad_level_is_config_error_naming_the_variable():
    out = run("import rdmamw", RDMAMW_LOG_LEVEL="loud")
    assert out.returncode != 0
    assert "rdmamw.errors.ConfigError: RDMAMW_LOG_LEVEL='loud'" in out.stderr, out.stderr


def test_unwritable_log_file_is_config_error(tmp_path):
    out = run("import rdmamw", RDMAMW_LOG_FILE=str(tmp_path / "no" / "such" / "dir" / "f.log"))
    assert out.returncode != 0 and "ConfigError: RDMAMW_LOG_FILE=" in out.stderr, out.stderr


def test_provider_choice_per_rank_is_logged():
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, WORKER, "60"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(RANK=str(r), WORLD_SIZE="2", PYTHONPATH=ROOT,
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                            RDMAMW_LOG_LEVEL="info"))
             for r in (0, 1)]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        reap(procs)
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "rank 0 -> rank 1: shm provider (same host" in errs[0], errs[0]
    assert "rank 1 -> rank 0: shm provider (same host" in errs[1], errs[1]
    assert "channel opened to rank 1 at shm://" in errs[0], errs[0]
