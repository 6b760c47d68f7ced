"""A worker that never reads its replies cannot stall the parameter server (issue 29):
a reply that cannot be delivered within ``RDMAMW_PS_REPLY_TIMEOUT`` drops that worker
(its channel closed, logged once, counted in ``stats()["dropped_workers"]``) and the server
serves the others on."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import rdmamw
from rdmamw import config
from rdmamw.ps import KVWorker, wire
from rdmamw.ps.server import KVServer
from tests.support.helpers import make_pair, wait_for


def test_a_worker_that_never_reads_its_replies_is_dropped_and_the_others_served(
        caplog, monkeypatch):
    monkeypatch.setenv("RDMAMW_PS_REPLY_TIMEOUT", "0.5")
    pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(2)]
    srv = KVServer({w: p[1] for w, p in enumerate(pairs)}, consistency="asp")
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(stats=srv.serve()), daemon=True)
    try:
        with caplog.at_level(logging.WARNING, "rdmamw.ps"):
            t.start()
            honest = KVWorker([pairs[1][0]], timeout=5)
            honest.init(["w"], [np.arange(10, dtype=np.float32)])
            hostile = pairs[0][0]
            bad = wire.pack("nope", id=1)
            err: Exception | None = None
            t0 = time.monotonic()
            for _ in range(200):        # each one earns an ERR reply it never reads
                try:
                    hostile.send_batch([bad] * 4, timeout=5)
                except rdmamw.RdmamwError as e:
                    err = e
                    break
            wait_for(lambda: 0 in srv.lost, "the hostile worker is dropped", 5)
            for _ in range(3):          # the honest one is served within a bound
                s = time.monotonic()
                honest.push(["w"], [np.ones(10, np.float32)])
                got = honest.pull(["w"])
                assert got[0].shape == (10,) and time.monotonic() - s < 3
            if err is None:             # the server has closed its channel by now
                with pytest.raises(rdmamw.RdmamwError) as e:
                    for _ in range(100):
                        hostile.send_batch([bad] * 4, timeout=5)
                err = e.value
            assert isinstance(err, (rdmamw.ChannelClosed, rdmamw.PeerLost)), err
            assert time.monotonic() - t0 < 10
            honest.close()
            t.join(10)
        assert not t.is_alive()
        assert out["stats"]["dropped_workers"] == 1 and out["stats"]["lost"] == [0]
        said = [r for r in caplog.records if "RDMAMW_PS_REPLY_TIMEOUT" in r.getMessage()]
        assert len(said) == 1 and "worker 0" in said[0].getMessage()
    finally:
        for a, b, lst in pairs:
            a.close(), b.close(), lst.close()


def test_the_reply_timeout_is_a_declared_setting(monkeypatch):
    assert KVServer({}, consistency="asp").reply_timeout == 10.0
    monkeypatch.setenv("RDMAMW_PS_REPLY_TIMEOUT", "250ms")
    assert KVServer({}, consistency="asp").reply_timeout == 0.25
    s = config.setting("RDMAMW_PS_REPLY_TIMEOUT")
    assert 0 < s.minimum and s.maximum <= 1e6
