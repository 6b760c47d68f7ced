"""A job has an identity (issue 29, findings 2, 5, 6, 7): a rank of another job at our
MASTER_PORT is refused with a typed error that says so and our job goes on; a wrong
token is named as such on the joining rank; channels by rank prove the job as well as
the token; a bad address is a typed error; a peer cannot pile up unrequested channels."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

import rdmamw
from rdmamw import auth
from rdmamw.bootstrap import World, connect_rank, detect, kvstore
from rdmamw.bootstrap.launch import free_port
from tests.integrations.test_bootstrap import ROOT, clean_env
from tests.support.helpers import reap

PROBE = """
import json, sys, rdmamw
try:
    rdmamw.init(timeout=float(sys.argv[1]))
    print(json.dumps({"ok": True}))
except rdmamw.RdmamwError as e:
    print(json.dumps({"type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
                      "msg": str(e)}))
"""


def probe(env: dict, timeout: float = 8) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, str(timeout)], cwd=ROOT, text=True,
                       capture_output=True, env=clean_env(**env), timeout=120)
    assert r.stdout, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


# ---- finding 2: a second job on the same MASTER_PORT ---------------------------------

@pytest.mark.parametrize("other", [{"TORCHELASTIC_RUN_ID": "job-B"},      # another job
                                   {"WORLD_SIZE": "3"}])                  # another size
def test_a_rank_of_another_job_is_refused_and_the_job_goes_on(other):
    port = str(free_port())
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               TORCHELASTIC_RUN_ID="job-A")
    r0 = subprocess.Popen([sys.executable, "-c", PROBE, "20"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=clean_env(RANK="0", **env))
    try:
        stranger = probe({**env, "RANK": "1", **other})
        ours = probe({**env, "RANK": "1"}, timeout=20)
        out0, err0 = r0.communicate(timeout=120)
    finally:
        reap([r0])
    assert "PeerRefused" in stranger.get("mro", []), stranger
    assert "another job" in stranger["msg"], stranger
    assert ours == {"ok": True} and json.loads(out0.splitlines()[-1]) == {"ok": True}, \
        (ours, out0, err0[-3000:])


@pytest.mark.parametrize("env, want", [
    ({"TORCHELASTIC_RUN_ID": "abc"}, "torchrun:abc"),
    ({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}, "slurm:77.3"),
    ({"SLURM_JOB_ID": "77"}, "slurm:77"),
    ({"PMIX_NAMESPACE": "prterun-h-1@1"}, "pmix:prterun-h-1@1"),
    ({"OMPI_MCA_ess_base_jobid": "4242"}, "openmpi:4242"),
    ({"RDMAMW_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "abc"}, "rdmamw:mine"),
    ({}, None),
])
def test_the_job_id_comes_from_the_launcher(env, want):
    info = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", **env})
    assert info.job_id == want


# ---- finding 5: a wrong token is named on the joining rank ----------------------------

def test_a_wrong_token_is_named_on_the_joining_rank():
    port = str(free_port())
    env = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    r0 = subprocess.Popen([sys.executable, "-c", PROBE, "4"], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=clean_env(RANK="0", RDMAMW_TOKEN="right", **env))
    try:
        got = probe({**env, "RANK": "1", "RDMAMW_TOKEN": "wrong"}, timeout=4)
    finally:
        reap([r0])
    assert "AuthError" in got.get("mro", []), got
    assert "token" in got["msg"] and "hung up" not in got["msg"], got


# ---- channels by rank prove the job ---------------------------------------------------

class DictKV:
    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, key, value):
        self.d[key] = value

    def get(self, key):
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)


def two_ranks(monkeypatch, provider: str = "tcp") -> list[World]:
    monkeypatch.setenv("RDMAMW_PROVIDER", provider)
    kv, worlds = DictKV(), {}
    ts = [threading.Thread(target=lambda r=r: worlds.__setitem__(
        r, kvstore.join(kv, r, 2, 10, "127.0.0.1"))) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return [worlds[0], worlds[1]]


def pair(w0: World, w1: World, opener: World | None = None):
    got: dict = {}

    def accept():
        try:
            got["a"] = connect_rank(1, mode="batched", timeout=2, slots=4, slot_size=4096,
                                    in_world=w0)
        except BaseException as e:  # noqa: BLE001
            got["a"] = e
    t = threading.Thread(target=accept)
    t.start()
    try:
        b = connect_rank(0, mode="batched", timeout=4, slots=4, slot_size=4096,
                         in_world=opener or w1)
    except BaseException as e:  # noqa: BLE001
        b = e
    t.join(10)
    return got.get("a"), b


def test_a_channel_by_rank_from_another_job_is_refused(monkeypatch):
    w0, w1 = two_ranks(monkeypatch)
    try:
        # a rank of a restarted job with the same table (ports reused): same token,
        # another job id
        old = World(1, 2, "store", "another-job", w1.peers)
        a, b = pair(w0, w1, opener=old)
        assert isinstance(b, auth.AuthError), b
        assert isinstance(a, rdmamw.Timeout), a          # rank 0 never took it
        a, b = pair(w0, w1)                              # our own rank 1 still gets in
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
        a.transport.close(), b.transport.close()
    finally:
        w0.close(), w1.close()


def test_a_store_rejoin_waits_for_the_drop_and_channels_meet_the_new_process(monkeypatch):
    """A World met through a store (a torch group's) takes a lost rank's new process as
    rank 0's bootstrap store does: while rank 1 is a member, a second process of it
    waits and times out ("still a member"); once a shrink dropped it (depart), the new
    process takes generation 1; the member's refresh takes its descriptor and a channel
    by rank meets the new process, never the old one; the next replacement is 2."""
    w0, w1 = two_ranks(monkeypatch)
    kv, news = w0._kv, []
    try:
        with pytest.raises(rdmamw.Timeout, match="rank 1 is still a member"):
            kvstore.rejoin(kv, 1, 2, 0.3, "127.0.0.1")
        w0.depart({1})
        news.append(kvstore.rejoin(kv, 1, 2, 5, "127.0.0.1"))
        new = news[0]
        assert (new.gen(1), new.gen(0), new.job) == (1, 0, w0.job)
        w0.refresh({1}, time.monotonic() + 5)
        assert w0.peers[1] == new.peers[1] and w0.gen(1) == 1
        a, b = pair(w0, new)
        assert not isinstance(a, BaseException) and not isinstance(b, BaseException), (a, b)
        a.transport.close(), b.transport.close()
        a, b = pair(w0, w1, opener=w1)                   # the old process: not taken
        assert isinstance(a, rdmamw.Timeout), a
        if not isinstance(b, BaseException):
            b.transport.close()
        w0.depart({1})
        news.append(kvstore.rejoin(kv, 1, 2, 5, "127.0.0.1"))
        assert news[1].gen(1) == 2
    finally:
        for w in (w0, w1, *news):
            w.close()


# ---- finding 6: a bad address is a typed error -----------------------------------------

@pytest.mark.parametrize("addr", ["tcp://garbage", "tcp://127.0.0.1:99999", "tcp://:x"])
def test_a_bad_tcp_address_is_a_typed_error(addr):
    with pytest.raises(rdmamw.RdmamwError):
        rdmamw.Channel.open(addr, timeout=1)


def test_a_bad_address_in_a_peers_descriptor_is_a_typed_error(monkeypatch):
    w0, w1 = two_ranks(monkeypatch)
    try:
        peers = {0: {**w0.peers[0], "tcp": "tcp://garbage"}, 1: w1.peers[1]}
        bad = World(1, 2, "store", w1.job, peers)
        with pytest.raises(rdmamw.ProtocolError):
            connect_rank(0, mode="batched", timeout=1, slots=4, slot_size=4096, in_world=bad)
    finally:
        w0.close(), w1.close()


# ---- finding 7: unrequested channels are capped -----------------------------------------

def test_unrequested_channels_from_one_peer_are_capped(monkeypatch):
    from rdmamw.bootstrap import STASH_PER_PEER
    w0, w1 = two_ranks(monkeypatch)
    extra = STASH_PER_PEER + 4
    opened: list = []
    got: dict = {}

    def rank0():                        # waits for a rank that never comes, stashing
        try:
            w0.accept("tcp", 5, timeout=1.5)
        except BaseException as e:  # noqa: BLE001
            got["err"] = e
    t = threading.Thread(target=rank0)
    t.start()
    try:
        for _ in range(extra):          # rank 1 opens, rank 0 never asks for them
            opened.append(connect_rank(0, mode="batched", timeout=4, slots=4,
                                       slot_size=4096, in_world=w1))
        t.join(30)
        assert isinstance(got.get("err"), rdmamw.Timeout), got
        assert len(w0._stash[("tcp", 1)]) == STASH_PER_PEER
    finally:
        t.join(30)
        for c in opened:
            c.transport.close()
        w0.close(), w1.close()
