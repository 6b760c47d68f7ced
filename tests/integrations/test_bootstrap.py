"""rdmamw.init() under each launcher's environment, the bootstrap store, Channel.open(rank),
and the failures a user meets (missing rank, port in use). Jobs across network
namespaces are in test_multihost.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import rdmamw
from rdmamw.bootstrap import detect, store
from rdmamw.bootstrap.env import first_slurm_host
from rdmamw.bootstrap.launch import free_port
from tests.support.helpers import assert_ranks_ok, init_some_ranks, reap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "support", "bootstrap_worker.py")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "RDMAMW_TOKEN", "MASTER_ADDR", "MASTER_PORT",
               "LOCAL_WORLD_SIZE", "RDMAMW_RANK", "RDMAMW_WORLD_SIZE", "RDMAMW_MASTER_ADDR",
               "RDMAMW_MASTER_PORT", "RDMAMW_PROVIDER")


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("OMPI_", "PMI_", "SLURM_", "DMLC_"))}
    env.update(extra)
    return env


@pytest.mark.parametrize("env, expect", [
    ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"},
     (2, 4, "10.0.0.1", 1234, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (1, 2, "127.0.0.1", 29500, "openmpi")),
    ({"PMI_RANK": "0", "PMI_SIZE": "3", "MASTER_ADDR": "h0", "MASTER_PORT": "99"},
     (0, 3, "h0", 99, "mpich")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[03-04,9]",
      "SLURM_JOB_ID": "123"}, (5, 8, "gpu03", 20123, "slurm")),
    ({"DMLC_ROLE": "worker", "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3",
      "DMLC_WORKER_ID": "1", "DMLC_PS_ROOT_URI": "sched", "DMLC_PS_ROOT_PORT": "9000"},
     (4, 6, "sched", 9000, "ps-lite")),
    ({"DMLC_ROLE": "server", "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3",
      "DMLC_PS_ROOT_URI": "sched", "DMLC_PS_ROOT_PORT": "9000"},
     (None, 6, "sched", 9000, "ps-lite")),
    ({"RANK": "0", "WORLD_SIZE": "2", "RDMAMW_MASTER_ADDR": "a", "MASTER_ADDR": "b",
      "RDMAMW_MASTER_PORT": "7", "MASTER_PORT": "8"}, (0, 2, "a", 7, "torchrun")),
    # torchrun's agent keeps MASTER_PORT for its own store: ours takes the next port
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "b", "MASTER_PORT": "8",
      "TORCHELASTIC_USE_AGENT_STORE": "True"}, (1, 2, "b", 9, "torchrun")),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "b", "MASTER_PORT": "8",
      "RDMAMW_MASTER_PORT": "7", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     (1, 2, "b", 7, "torchrun")),
])
def test_launcher_environments(env, expect):
    info = detect(env)
    assert (info.rank, info.world_size, info.master_addr, info.master_port,
            info.launcher) == expect


@pytest.mark.parametrize("env, match", [
    ({}, "no launcher environment"),
    ({"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "x"}, "outside"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
    ({"PMI_RANK": "0", "PMI_SIZE": "4"}, "MASTER_ADDR"),      # multi-host, no address
    ({"DMLC_ROLE": "boss"}, "scheduler, server or worker"),
])
def test_bad_launcher_environments(env, match):
    with pytest.raises(rdmamw.RdmamwError, match=match):
        detect(env)


def test_slurm_host_lists():
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a[10-12],b3") == "a10"


def test_a_given_mapping_is_read_through_the_table_and_the_environment_is_not(monkeypatch):
    """detect(env) reads the launcher's variables from ``env`` through the settings
    table (its parsers and its errors), never from os.environ beside it."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "lots")
    info = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": " h ", "MASTER_PORT": "7"})
    assert (info.rank, info.master_addr, info.master_port) == (1, "h", 7)
    with pytest.raises(rdmamw.errors.ConfigError, match="MASTER_PORT='70000' is not an integer"):
        detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"})


def test_ps_lite_ranks_of_each_role_come_with_the_launch_info():
    """The store hands out the ranks of ``ranges`` to servers and workers without an
    id; the bootstrap takes them from the LaunchInfo, not from the environment."""
    env = {"DMLC_ROLE": "scheduler", "DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "3",
           "DMLC_PS_ROOT_URI": "sched", "DMLC_PS_ROOT_PORT": "9000"}
    assert detect(env).ranges == {"server": range(1, 3), "worker": range(3, 6)}
    assert detect({"RANK": "0", "WORLD_SIZE": "1"}).ranges == {}


def test_a_job_we_start_inherits_no_launchers_variables(monkeypatch):
    from rdmamw.bootstrap.launch import job_env
    outer = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MPI_LOCALNRANKS": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "3", "SLURM_STEP_ID": "1", "DMLC_ROLE": "worker",
             "RDMAMW_MASTER_PORT": "7", "LOCAL_RANK": "5", "RDMAMW_SLOTS": "8"}
    for k, v in outer.items():
        monkeypatch.setenv(k, v)
    env = job_env(1, 2, "127.0.0.1", 99, "t" * 64)
    assert not (set(outer) - {"LOCAL_RANK", "RDMAMW_SLOTS"}) & set(env)
    assert (env["LOCAL_RANK"], env["RDMAMW_SLOTS"], env["MASTER_PORT"]) == ("1", "8", "99")


def json_objects(text: str) -> list[dict]:
    """Every JSON object in ``text`` (mpirun may join the ranks' lines)."""
    dec, out, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        obj, end = dec.raw_decode(text, i)
        out.append(obj)
        i = text.find("{", end)
    return out


def run_job(n: int, timeout: float = 120, hold: bool = False, **env: str):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, WORKER, "60"] + (["--hold"] if hold else []),
                              env=clean_env(RANK=str(r), WORLD_SIZE=str(n),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT)
             for r in range(n)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        reap(procs)
    assert_ranks_ok(procs, outs)
    return [json.loads(out.splitlines()[0]) for out, _ in outs]


def test_torchrun_style_job_on_one_host_uses_shm():
    res = run_job(3)
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(set(r["providers"].values()) == {"shm"} for r in res)
    assert {r["launcher"] for r in res} == {"torchrun"}


def test_torchrun_agent_store_keeps_master_port():
    """Under torchrun the agent's TCPStore listens on MASTER_PORT (here: a socket we
    hold); init() must not collide with it."""
    agent = socket.socket()
    agent.bind(("127.0.0.1", 0))
    agent.listen()
    try:
        port = str(agent.getsockname()[1])
        procs = [subprocess.Popen([sys.executable, WORKER, "60"], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=clean_env(RANK=str(r), WORLD_SIZE="2",
                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                                TORCHELASTIC_USE_AGENT_STORE="True"))
                 for r in range(2)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:
            reap(procs)
        assert_ranks_ok(procs, outs)
        assert [json.loads(o.splitlines()[0])["rank"] for o, _ in outs] == [0, 1]
    finally:
        agent.close()


def test_under_real_torchrun():
    """The job under torchrun itself (its agent holds MASTER_PORT)."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed (scripts/setup_test_deps.sh installs torch)")
    p = subprocess.run([torchrun, "--nnodes", "1", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                        WORKER, "60"], cwd=ROOT, env=clean_env(), text=True,
                       capture_output=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json_objects(p.stdout)
    assert sorted(r["rank"] for r in res) == [0, 1]
    assert {r["launcher"] for r in res} == {"torchrun"}


def test_provider_can_be_forced_to_tcp():
    res = run_job(3, RDMAMW_PROVIDER="tcp")
    assert all(set(r["providers"].values()) == {"tcp"} for r in res)


def test_missing_rank_times_out_naming_it():
    for code, err in init_some_ranks(4, (0, 2), 1.5):
        assert code != 0
        assert "Timeout" in err and "[1, 3]" in err, err


def test_rank_zero_port_in_use_is_a_clear_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    code = "import rdmamw; rdmamw.init(timeout=1)"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                       capture_output=True, timeout=60,
                       env=clean_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(s.getsockname()[1])))
    s.close()
    assert p.returncode != 0 and "bootstrap port" in p.stderr and "already in use" in p.stderr


def test_open_by_rank_needs_init():
    rdmamw.finalize()
    with pytest.raises(rdmamw.RdmamwError, match="init"):
        rdmamw.Channel.open(1, timeout=0.1)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (MPICH) installed")
def test_job_started_by_mpirun():
    out = subprocess.run(
        ["mpirun", "-n", "2", "-genv", "MASTER_PORT", str(free_port()),
         sys.executable, WORKER, "60"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = sorted(json_objects(out.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1]
    assert {r["launcher"] for r in res} == {"mpich"}


def test_ps_lite_roles_get_ranks_from_the_store():
    port = str(free_port())
    base = dict(DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="2", DMLC_PS_ROOT_URI="127.0.0.1",
                DMLC_PS_ROOT_PORT=port)
    roles = ["scheduler", "worker", "server", "worker"]       # no ids: the store assigns
    procs = [subprocess.Popen([sys.executable, WORKER, "60"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=clean_env(DMLC_ROLE=role, **base)) for role in roles]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        reap(procs)
    assert_ranks_ok(procs, outs)
    ranks = [json_objects(out)[0]["rank"] for out, _ in outs]
    assert ranks[0] == 0 and ranks[2] == 1 and sorted(ranks[1::2]) == [2, 3]


def test_garbage_at_the_store_is_dropped_and_the_job_goes_on():
    port = str(free_port())
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    r0 = subprocess.Popen([sys.executable, WORKER, "60"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=clean_env(RANK="0", **env))
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", int(port)), timeout=5) as s:
                    s.sendall(b"\x00garbage that is no proof of the token" * 3)
                    s.recv(100)
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        r1 = subprocess.run([sys.executable, WORKER, "60"], cwd=ROOT, text=True,
                            capture_output=True, env=clean_env(RANK="1", **env), timeout=120)
        out0, err0 = r0.communicate(timeout=120)
    finally:
        reap([r0])
    assert r0.returncode == 0 and r1.returncode == 0, (err0, r1.stderr)
    assert "dropped connection" in err0


def test_local_launcher_shares_a_fresh_token():
    out = subprocess.run([sys.executable, "-m", "rdmamw.bootstrap.launch", "-n", "3", "--",
                          sys.executable, WORKER, "60"], cwd=ROOT, env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = sorted(json_objects(out.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in res] == [0, 1, 2]
    assert all(r["token_from_env"] for r in res)


def test_local_launcher_exits_with_the_first_failing_ranks_code():
    """A rank that fails makes the job fail with its code (the others are stopped);
    a job whose ranks all succeed exits 0."""
    from rdmamw.bootstrap import launch
    fail = "import os, sys, time; r = os.environ['RANK']; time.sleep(30 if r == '0' else 0); " \
           "sys.exit(3 if r == '1' else 0)"
    t0 = time.monotonic()
    assert launch.run([sys.executable, "-c", fail], 2) == 3
    assert time.monotonic() - t0 < 25                 # rank 0 was stopped, not awaited
    assert launch.run([sys.executable, "-c", "pass"], 2) == 0


def test_max_lost_lets_the_others_run_on_and_a_failure_beyond_it_stops_them(capfd):
    """--max-lost K: up to K failed ranks are reported and the others run to their end
    (exit 0 when they succeed); the failure after those stops the job as without it."""
    from rdmamw.bootstrap import launch
    # rank 1 dies at once, rank 2 fails after 1 s; rank 0 writes a file when it ends
    code = "import os, signal, sys, time; r = os.environ['RANK']; " \
           "r == '1' and os.kill(os.getpid(), signal.SIGKILL); " \
           "time.sleep(1); r == '2' and sys.exit(5); time.sleep(4); " \
           "open(sys.argv[1] + r, 'w').close()"
    with tempfile.TemporaryDirectory() as d:
        done = os.path.join(d, "done")
        assert launch.run([sys.executable, "-c", code, done], 3, max_lost=2) == 0
        assert sorted(os.listdir(d)) == ["done0"]       # rank 0 ran to its end
        err = capfd.readouterr().err
        assert "rank 1 failed (killed by SIGKILL); the other 2 go on (1 of --max-lost 2)" \
            in err and "rank 2 failed (exit status 5); the other 1 go on (2 of" in err
        t0 = time.monotonic()
        assert launch.run([sys.executable, "-c", code, done + "x"], 3, max_lost=1) == 5
        assert time.monotonic() - t0 < 4.0             # rank 0 was stopped, not awaited
        assert sorted(os.listdir(d)) == ["done0"]
    with pytest.raises(SystemExit) as e:
        launch.main(["-n", "2", "--max-lost", "2", "--", "true"])
    assert e.value.code == 2
    assert "--max-lost must be 0 .. 1, not 2" in capfd.readouterr().err


def test_the_launcher_says_what_it_needs(capsys):
    from rdmamw.bootstrap import launch
    with pytest.raises(SystemExit) as e:
        launch.main(["--", "true"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "the following arguments are required: -n/--nproc" in err
    assert err.startswith("usage: python -m rdmamw.bootstrap.launch")


def test_rank_zero_refuses_a_rank_outside_the_world_and_goes_on():
    """The refused joiner is told why (``ok: False``), rank 0 keeps serving."""
    import threading

    from rdmamw.bootstrap import store
    sock = store.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=store.serve(sock, 2, {"me": 0}, 30)))
    t.start()
    try:
        with pytest.raises(rdmamw.RdmamwError,
                           match=r"rank 0 refused us: rank 5 is outside the world of 2"):
            store.join("127.0.0.1", port, 5, None, lambda ip: {"me": 5}, 2, 30)
        table, job, rank = store.join("127.0.0.1", port, 1, None, lambda ip: {"me": 1}, 2, 30)
    finally:
        t.join(60)
    assert (table, rank) == ({0: {"me": 0}, 1: {"me": 1, "rank": 1}}, 1)
    assert got["r"] == (table, job)


@pytest.mark.parametrize("table", [[{"me": 0}], [{"me": 0}, "not a descriptor"]])
def test_a_table_that_does_not_fit_the_world_is_refused(table):
    """A rank 0 that answers a table of the wrong length, or with a non-descriptor in
    it, is a ProtocolError, not a job with ranks missing."""
    import threading

    from rdmamw import auth
    from rdmamw.bootstrap import store
    from rdmamw.transport.wire import recv_frame, send_frame
    sock = store.listen("127.0.0.1", 0)

    def fake_rank0():
        conn, _ = sock.accept()
        with conn:
            auth.accept_side(conn)
            recv_frame(conn, store.JOIN_LIMIT)
            send_frame(conn, {"ok": True, "table": table, "job": "j", "rank": 1})

    t = threading.Thread(target=fake_rank0)
    t.start()
    try:
        with pytest.raises(rdmamw.ProtocolError,
                           match=f"bootstrap table of {len(table)} entries for 2 ranks"):
            store.join("127.0.0.1", sock.getsockname()[1], 1, None, lambda ip: {}, 2, 30)
    finally:
        t.join(60)
        sock.close()


def join_a_store_of_two(make_desc):
    """Rank 0's store (a thread; its descriptor {"me": 0}) and rank 1's join with
    ``make_desc``: (what the store returned, what the join returned)."""
    srv = store.listen("127.0.0.1", 0)
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(r=store.serve(srv, 2, {"me": 0}, 10)))
    t.start()
    try:
        joined = store.join("127.0.0.1", srv.getsockname()[1], 1, None, make_desc, 2, 10)
    finally:
        t.join(15)
    return got["r"], joined


def test_a_rank_slow_to_make_its_descriptor_still_joins(monkeypatch):
    """A rank's listeners (its descriptor) can take seconds on a loaded host: they are
    made before it connects, so the store's bound on one connection's handshake
    (RDMAMW_HANDSHAKE_TIMEOUT) does not cut a join that is within its deadline."""
    monkeypatch.setenv("RDMAMW_HANDSHAKE_TIMEOUT", "0.3")
    made = []

    def slow_desc(ip: str) -> dict:
        made.append(ip)
        time.sleep(1.0)
        return {"ip": ip}

    served, (table, job, rank) = join_a_store_of_two(slow_desc)
    assert (table, job, rank) == (served[0], served[1], 1)
    assert table == {0: {"me": 0}, 1: {"ip": "127.0.0.1", "rank": 1}}
    assert made == ["127.0.0.1"]      # made once, from the address the join left from


def test_a_descriptor_made_for_another_address_is_made_again(monkeypatch):
    """The route said one local address and the connection left from another: the
    descriptor sent is the one made for the connection's address."""
    monkeypatch.setattr(store, "_route_ip", lambda host, port, source: "10.9.9.9")
    made = []
    _, (table, _, _) = join_a_store_of_two(lambda ip: made.append(ip) or {"ip": ip})
    assert made == ["10.9.9.9", "127.0.0.1"]
    assert table[1] == {"ip": "127.0.0.1", "rank": 1}
