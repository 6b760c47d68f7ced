"""One metrics endpoint for every rank of a host (RDMAMW_METRICS_HOST_PORT,
rdmamw/metrics/host.py): a 3-rank shm job (tests/support/metrics_worker.py) scraped at
the one port gives every rank's per-peer counters equal to the ranks' own
``stats()``; the rank serving it killed, another takes over within a bound and the
dead rank's series are gone; a rank stopped (SIGSTOP) neither holds the scrape past a
bound nor hides the others' series, and is reported down."""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("prometheus_client")
from rdmamw.metrics.gather import RANK_TIMEOUT  # noqa: E402
from rdmamw.metrics.host import TAKEOVER  # noqa: E402
from tests.integrations.test_metrics_job import (  # noqa: E402
    Job,
    counters,
    expected,
    per_peer,
    scrape,
)

SERVED_BY = ("rdmamw_host_endpoint_pid", frozenset())


@pytest.fixture
def job3():
    j = Job(3, host=True)
    yield j
    for p in j.procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    j.kill()


def ranks_up(samples: dict) -> dict[str, float]:
    return {dict(ls)["rank"]: v for (name, ls), v in samples.items()
            if name == "rdmamw_host_rank_up"}


def ranks_seen(samples: dict) -> set[str]:
    return {dict(ls)["rank"] for (name, ls), _ in samples.items()
            if "rank" in dict(ls) and name != "rdmamw_host_rank_up"}


def peers_of(samples: dict, ranks: list[int]) -> dict:
    got: dict = {}
    for r in ranks:
        got.update(per_peer(samples, r))
    return got


def want_of(job: Job, ranks: list[int]) -> dict:
    return {k: v for k, v in expected(job).items() if int(k[1]) in ranks}


def test_one_endpoint_serves_every_rank_of_the_host(job3):
    samples = scrape(job3.host)
    assert peers_of(samples, [0, 1, 2]) == expected(job3)
    assert ranks_up(samples) == {"0": 1, "1": 1, "2": 1}
    assert samples[SERVED_BY] in {p.pid for p in job3.procs}
    assert counters(job3.finish()) == counters(job3.reports)    # (it was idle)


def test_the_serving_rank_dies_another_takes_over_without_its_series(job3):
    served_by = int(scrape(job3.host)[SERVED_BY])
    dead = next(r for r, p in enumerate(job3.procs) if p.pid == served_by)
    job3.procs[dead].kill()
    job3.procs[dead].wait()
    killed = time.monotonic()
    while True:
        try:
            samples = scrape(job3.host)
            break
        except OSError:
            assert time.monotonic() - killed < 2 + 4 * TAKEOVER, "nobody took over"
            time.sleep(0.05)
    alive = [r for r in range(3) if r != dead]
    assert int(samples[SERVED_BY]) in {job3.procs[r].pid for r in alive}
    assert ranks_up(samples) == {str(r): 1 for r in alive}
    assert ranks_seen(samples) == {str(r) for r in alive}       # the dead one's: gone
    assert peers_of(samples, alive) == want_of(job3, alive)


def test_a_stopped_rank_holds_no_scrape_and_is_reported_down(job3):
    served_by = int(scrape(job3.host)[SERVED_BY])
    stopped = next(r for r, p in enumerate(job3.procs) if p.pid != served_by)
    os.kill(job3.procs[stopped].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        samples = scrape(job3.host)
        took = time.monotonic() - t0
    finally:
        os.kill(job3.procs[stopped].pid, signal.SIGCONT)
    others = [r for r in range(3) if r != stopped]
    assert took < RANK_TIMEOUT + 1.0
    assert ranks_up(samples) == {**{str(r): 1 for r in others}, str(stopped): 0}
    assert ranks_seen(samples) == {str(r) for r in others}
    assert peers_of(samples, others) == want_of(job3, others)
    # running again, it is back in the next scrape
    samples = scrape(job3.host)
    assert peers_of(samples, [0, 1, 2]) == expected(job3)
    assert ranks_up(samples) == {"0": 1, "1": 1, "2": 1}
    assert counters(job3.finish()) == counters(job3.reports)
