"""Helpers the test modules import (``from tests.support.helpers import ...``): channel pairs in
one process (a thread accepts), unique names, the providers under test. Fixtures live in
conftest.py, which imports these: one module, one name counter."""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
import time

import pytest

import rdmamw

_names = itertools.count()


def unique_name(tag: str = "t") -> str:
    return f"{tag}-{os.getpid()}-{next(_names)}"


def _verbs_status() -> tuple[bool, str]:
    from rdmamw.providers.verbs import probe as verbs_device
    return verbs_device.status()


VERBS_OK, VERBS_WHY = _verbs_status()
#: why device tests skip here (they run inside scripts/rxe-vm.sh: `make test`)
NO_DEVICE = f"needs an RDMA device (runs in the soft-RoCE VM): {VERBS_WHY}"

class _ListenAddresses(dict):
    """scheme -> a factory of fresh listen addresses; a provider not named here (one
    from RDMAMW_PROVIDER_PLUGINS) gets the registry's local address."""

    def __missing__(self, scheme: str):
        from rdmamw.providers import local_address, schemes
        if scheme not in schemes():
            raise KeyError(scheme)
        return lambda: local_address(scheme, unique_name())


#: providers the channel suite runs on (tests that need a device skip with a reason
#: where there is none); RDMAMW_TEST_PROVIDERS=NAME runs it on any registered provider
LISTEN_ADDRESS = _ListenAddresses({
    "shm": lambda: f"shm://{unique_name()}",
    "tcp": lambda: "tcp://127.0.0.1:0",      # ephemeral port; Listener.address is the bound one
})
if VERBS_OK:
    LISTEN_ADDRESS["verbs"] = lambda: "verbs://127.0.0.1:0"
DEVICE_PROVIDERS = {"verbs"}


def providers_under_test() -> list[str]:
    wanted = os.environ.get("RDMAMW_TEST_PROVIDERS")
    names = wanted.split(",") if wanted else [*LISTEN_ADDRESS, *DEVICE_PROVIDERS]
    return list(dict.fromkeys(p for p in names if p))


#: the rendezvous copy paths each provider has (only shm has a staged one): tests that
#: take the ``cma`` fixture run on these, not on a product that would always skip
CMA_PATHS = {"shm": ("direct", "staged")}


def provider_param(name: str, *more: str):
    """``name`` (and ``more`` values of other parameters) marked as a device test where
    it is one, skipped where there is no device."""
    if name not in DEVICE_PROVIDERS:
        return pytest.param(name, *more)
    marks = [pytest.mark.device]
    if name not in LISTEN_ADDRESS:
        marks.append(pytest.mark.skip(reason=NO_DEVICE))
    return pytest.param(name, *more, marks=marks)


def make_pair(mode: str = "batched", slots: int = 16, slot_size: int = 4096,
              peer_slots: int | None = None, peer_slot_size: int | None = None,
              spin_us: float = 50.0, provider: str = "shm", **chan):
    """(opener, acceptor, listener): the opener receives on slots x slot_size, the
    acceptor on peer_slots x peer_slot_size (default: the same); ``chan`` takes the
    rendezvous options of both."""
    lst = rdmamw.listen(LISTEN_ADDRESS[provider](), slots=peer_slots or slots,
                        slot_size=peer_slot_size or slot_size, spin_us=spin_us, **chan)
    got: dict = {}

    def accept() -> None:
        try:
            got["ch"] = lst.accept(timeout=10)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            got["err"] = e

    t = threading.Thread(target=accept)
    t.start()
    a = rdmamw.Channel.open(lst.address, mode=mode, timeout=10, slots=slots,
                            slot_size=slot_size, spin_us=spin_us, **chan)
    t.join(10)
    if "err" in got:
        raise got["err"]
    return a, got["ch"], lst


class PSInProcess:
    """A KVServer serving on a thread and ``workers`` KVWorkers (one server channel
    each) in this process over shm channel pairs: a test drives the workers from its
    own threads in the order it wants, watching the server's state. ``server``: the
    KVServer's keyword arguments."""

    def __init__(self, workers: int, **server) -> None:
        from rdmamw.ps.server import KVServer
        from rdmamw.ps.worker import KVWorker
        self.pairs = [make_pair(slots=16, slot_size=1 << 16) for _ in range(workers)]
        self.server = KVServer({i: p[1] for i, p in enumerate(self.pairs)}, **server)
        self.workers = [KVWorker([p[0]], timeout=30) for p in self.pairs]
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def held(self, w: int) -> bool:
        """The server holds a read of worker ``w``: a start read (until every worker
        asks) or one its consistency model does not allow yet."""
        h = self.server.reads.get(w)
        return h is not None and (bool(h.get("start")) or not self.server.policy.can_read(w))

    def run(self, target) -> dict[int, str]:
        """``target(w)`` for every worker ``w``, each on a thread, which says done at the
        end: per worker "ok" or the error it raised ("Type: text")."""
        got: dict[int, str] = {}

        def one(w: int) -> None:
            try:
                target(w)
                got[w] = "ok"
            except Exception as e:      # noqa: BLE001 - handed to the test
                got[w] = f"{type(e).__name__}: {e}"
            finally:
                self.workers[w].done()

        threads = [threading.Thread(target=one, args=(w,), daemon=True)
                   for w in range(len(self.workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return got

    def close(self) -> None:
        for a, b, lst in self.pairs:
            a.close()
            b.close()
            lst.close()
        self.thread.join(10)


#: how far a test's wall-clock bound stretches where the machine is slower than the one
#: the bound was measured on: 1 on the host, 2 in the soft-RoCE VM (the device half),
#: whose emulated CPU ran the device tests 1.8x slower on a CI machine than here
#: (2,863 s against ~1,600 s, 2026-12-07) and where a killed process's teardown once
#: took 2.95 s; RDMAMW_TEST_SLOWER sets it
SLOWER = float(os.environ.get("RDMAMW_TEST_SLOWER")
               or (2.0 if os.environ.get("RXEVM_GUEST") == "1" else 1.0))


def within(seconds: float) -> float:
    """A wall-clock bound of ``seconds`` (measured on the host) on this machine."""
    return seconds * SLOWER


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    """Poll ``cond()`` until true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def send_until_peer_lost(ch, since: float, batch: int = 8, rounds: int = 10_000,
                         timeout: float | None = None) -> None:
    """Send batches on ``ch`` until it raises PeerLost (the ring fills, then the dead
    peer must be noticed); that must come within 2 s of ``since`` (monotonic;
    stretched in the VM, :func:`within`)."""
    with pytest.raises(rdmamw.PeerLost):
        for _ in range(rounds):
            ch.send_batch([b"x" * 100] * batch, timeout=timeout)
    assert time.monotonic() - since < within(2.0)


def init_some_ranks(world_size: int, ranks, timeout: float) -> list[tuple[int, str]]:
    """Start ``ranks`` of a job of ``world_size`` ranks on this host, each calling
    ``rdmamw.init(timeout=timeout)`` (the other ranks never come); the (exit code,
    stderr) of each, in order, once all have ended."""
    import subprocess
    import sys

    from rdmamw.bootstrap.launch import free_port
    from tests.integrations.test_bootstrap import ROOT, clean_env

    port = str(free_port())
    code = f"import rdmamw; rdmamw.init(timeout={timeout!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                              stderr=subprocess.PIPE,
                              env=clean_env(RANK=str(r), WORLD_SIZE=str(world_size),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in ranks]
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        reap(procs)
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def reap(procs) -> None:
    """Kill and wait for every process in ``procs`` still running (in a ``finally``:
    when a timeout fired or an assertion failed, no rank outlives its test)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.communicate(timeout=30)
        except (ValueError, OSError):     # its pipes were closed already: just wait
            p.wait(timeout=30)


def assert_ranks_ok(procs, outs, tail: int = 3000) -> None:
    """Every rank exited 0; else fail with what each failed rank printed, not only the
    first's: a rank that raised first makes its peers fail with ChannelClosed."""
    bad = [f"rank {r} exited {p.returncode}:\n{err[-tail:]}"
           for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)) if p.returncode]
    assert not bad, "\n\n".join(bad)


def free_ports(n: int) -> int:
    """A base port with ``n`` free ports from it on."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (``kill`` returns
    before a busy thread on another CPU reaches its stop: a request sent at once may
    still be served)."""
    import signal
    os.kill(pid, signal.SIGSTOP)
    end = time.monotonic() + timeout
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rpartition(")")[2].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in "Tt" for s in states):
            return
        if time.monotonic() > end:
            raise AssertionError(f"process {pid} did not stop in {timeout} s: {states}")
        time.sleep(0.001)
