"""rdmamw_batch_completion_seconds (rdmamw/engine/_messages.pyx, rdmamw.metrics): while
metrics record, each batch whose completion the program learns (its handle's first
done() that says yes, or its wait()) is observed once, from its post; off, none is."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rdmamw.metrics import readings
from tests.support.helpers import make_pair


@pytest.fixture
def pair():
    a, b, lst = make_pair(slots=16, slot_size=4096)
    yield a, b
    a.close(), b.close(), lst.close()


@pytest.fixture
def recording():
    readings.enable()
    yield
    readings.disable()


def now() -> readings.Times:
    return readings.batch_times()


def drain(b, n: int) -> None:
    for _ in range(n):
        with b.recv(timeout=10):
            pass


def test_each_batch_learned_complete_is_observed_once(pair, recording):
    a, b = pair
    before = now()
    handles = [a.send_batch([b"12345678"] * 8) for _ in range(10)]
    for h in handles[:5]:
        h.wait(10)
    for h in handles[5:]:
        while not h.done():
            pass
    for h in handles:       # asked again: the same completion
        h.wait(10)
        assert h.done()
    drain(b, 80)
    after = now()
    assert after.count - before.count == 10
    assert sum(after.counts) == after.count
    assert after.sum > before.sum
    got = [n - m for (_, n), (_, m) in zip(after.cumulative(), before.cumulative(),
                                           strict=True)]
    assert got[-1] == 10 and got == sorted(got)      # cumulative, all under +Inf


def test_a_batch_done_late_is_timed_from_its_post(pair, recording):
    """A rendezvous message is done once the receiver took it: taken 0.3 s after its
    post, its batch is observed above 0.25 s and at most 0.5 s + the test's slack."""
    a, b = pair
    before = now()
    h = a.send_batch([np.ones(64 << 10, dtype=np.uint8)])      # above the 4 KiB slots
    time.sleep(0.3)
    assert not h.done()
    with b.recv(timeout=10) as m:
        assert len(m) == 64 << 10
    h.wait(10)
    after = now()
    le = dict(after.cumulative())
    was = dict(before.cumulative())
    assert after.count - before.count == 1
    assert le[0.25] - was[0.25] == 0
    assert le[1.0] - was[1.0] == 1
    assert 0.3 <= after.sum - before.sum < 1.0


def test_off_no_batch_is_observed(pair):
    readings.disable()
    a, b = pair
    before = now()
    for _ in range(5):
        a.send_batch([b"x"] * 4).wait(10)
    drain(b, 20)
    assert now().count == before.count


def test_a_scrape_and_the_snapshot_show_it(recording):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from rdmamw.metrics.exporter import RdmamwCollector
    reg = CollectorRegistry(auto_describe=False)
    reg.register(RdmamwCollector())
    text = generate_latest(reg).decode()
    snap = readings.snapshot()["batch_completion"]
    count = [ln for ln in text.splitlines()
             if ln.startswith("rdmamw_batch_completion_seconds_count")]
    assert count == [f'rdmamw_batch_completion_seconds_count{{rank=""}} '
                     f'{float(snap["count"])}']
    assert 'rdmamw_batch_completion_seconds_bucket{le="5e-07",rank=""}' in text
