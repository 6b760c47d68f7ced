"""Hostile soak: a job's servers keep serving their honest members, and leak nothing,
under a steady stream of hostile clients.

The servers run in this process: a tcp channel listener whose accepted channels echo
what they get, rank 0's bootstrap store (a round of a 3-rank job after another, on
one port), and a parameter server (an epoch of a few seconds after another, on its own
tcp listener, serving an honest worker and a token-holding one that sends malformed
requests). Honest members keep opening channels and exchanging checked messages,
joining the store and pushing and pulling. A hostile process (``--hostile``) hammers
the three ports meanwhile, each kind of attack in a thread of its own:

* ``wrong_token``: the token exchange with another key;
* ``slow``: connections that take the challenge and then trickle a byte of their proof
  now and then, never finishing it (20 held open per port);
* ``oversized``: the right token, then a hello frame announcing 1 GiB;
* ``malformed``: the right token, then a frame of garbage, of a msgpack list, of a map
  of wrong types, or a join of another job or of a rank outside the world (the store);
* ``flood``: connections opened and closed as fast as the loop goes (one source);
* ``side_garbage``: a real channel to the echo listener, then garbage written into its
  tcp stream (the echo server must drop that channel and serve on).

It fails (exit status 1, every failure listed) if an honest channel open, store join
or parameter-server pull takes longer than ``--open-bound`` s or fails, a server thread
dies (an echo handler, the store's rounds or the parameter server's serve() raising,
a listener's accept loop gone), or the process's fds, threads or memory grow: they are
measured quiet (honest traffic paused between operations, the hostile process stopped
and its connections past the proof deadline) after a warm-up without the hostile
process and at the end.

    python tests/soak/hostile_soak.py --seconds 10
    nice python tests/soak/hostile_soak.py --seconds 1800 --json hostile-soak.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np

import rdmamw
from rdmamw import auth
from rdmamw.bootstrap import store
from rdmamw.errors import ChannelClosed, PeerLost, ProtocolError, RdmamwError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import accept_each, counts_only, emit, grown, resources  # noqa: E402 - the soak's own checks

JOB = "rdmamw:hostile-soak"
RANKS = 3                       # of each store round
SIZES = (0, 1, 100, 4000, 60000, 300000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the hostile process ---------------------------------------------------------------

def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return s


def _pace(stop: threading.Event, seconds: float) -> bool:
    """Wait ``seconds``; True while the attack goes on."""
    return not stop.wait(seconds)


def hostile_main(a: argparse.Namespace) -> int:
    ports = [int(p) for p in a.hostile.split(",")]
    echo_port = ports[0]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def count(kind: str) -> None:
        with lock:
            counts[kind] = counts.get(kind, 0) + 1

    def attack(kind: str, once) -> None:
        rng = random.Random(kind)
        while not stop.is_set():
            port = rng.choice(ports)
            try:
                once(port, rng)
                count(kind)
            except (OSError, RdmamwError, ValueError) as e:
                count(kind)             # refused, dropped, reset: what it is meant to be
                count(f"{kind}: {type(e).__name__}")

    def wrong_token(port, rng):
        with _connect(port) as s:
            auth.open_side(s, b"not the token of this job")
        _pace(stop, 0.01)

    def oversized(port, rng):
        with _connect(port) as s:
            auth.open_side(s)
            s.sendall(struct.pack("<I", 1 << 30) + os.urandom(64))
            s.settimeout(2)
            s.recv(64)
        _pace(stop, 0.02)

    def malformed(port, rng):
        frames = [os.urandom(rng.randint(1, 200)), msgpack.packb([1, 2, 3]),
                  msgpack.packb({"version": "x", "slots": -1, "slot_size": [1], "mode": 5}),
                  msgpack.packb({"rank": 1, "desc": {"host": "h"}, "launcher_job": "other",
                                 "world_size": RANKS}),
                  msgpack.packb({"rank": 1 << 40, "desc": {}, "launcher_job": JOB,
                                 "world_size": RANKS}),
                  msgpack.packb({"rank": "one", "desc": [], "world_size": -5})]
        body = rng.choice(frames)
        with _connect(port) as s:
            auth.open_side(s)
            s.sendall(struct.pack("<I", len(body)) + body)
            s.settimeout(2)
            s.recv(4096)
        _pace(stop, 0.02)

    def flood(port, rng):
        for _ in range(20):
            _connect(port).close()
            count("flood connections")
        _pace(stop, 0.05)

    def side_garbage(port, rng):
        with rdmamw.Channel.open(f"tcp://127.0.0.1:{echo_port}", timeout=10) as ch:
            ch.send(b"hello")
            ch.recv(timeout=10).release()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                        continue
                    s = socket.socket(fileno=os.dup(int(fd)))
                except OSError:
                    continue
                with s:
                    try:
                        if s.type == socket.SOCK_STREAM and s.getpeername()[1] == echo_port:
                            s.send(os.urandom(rng.randint(1, 64)))
                    except (OSError, IndexError, TypeError):
                        pass
            try:
                ch.send(b"after the garbage")
                ch.recv(timeout=2).release()
            except RdmamwError:
                pass
        _pace(stop, 0.2)

    def slow() -> None:
        held: list[tuple[socket.socket, int]] = []
        while not stop.is_set():
            for port in ports:
                while sum(1 for _, p in held if p == port) < 20 and not stop.is_set():
                    try:
                        s = _connect(port)
                        s.settimeout(2)
                        s.recv(auth.HELLO_BYTES)
                        held.append((s, port))
                        count("slow")
                    except OSError:
                        break
            for s, port in list(held):
                try:
                    s.send(b"R")        # a byte of a proof that never completes
                except OSError:
                    s.close()
                    held.remove((s, port))
            _pace(stop, 0.5)
        for s, _ in held:
            s.close()

    kinds = {"wrong_token": wrong_token, "oversized": oversized, "malformed": malformed,
             "flood": flood, "side_garbage": side_garbage}
    threads = [threading.Thread(target=attack, args=(k, f), daemon=True)
               for k, f in kinds.items()]
    threads.append(threading.Thread(target=slow, daemon=True))
    for t in threads:
        t.start()
    parent = os.getppid()
    while not stop.wait(0.5):
        if os.getppid() != parent:      # the soak is gone: so are we
            stop.set()
    for t in threads:
        t.join(15)
    print(json.dumps(counts), flush=True)
    return 0


# ---- the servers and their honest members ---------------------------------------------

class Gate:
    """Lets the activities be paused between two operations, so that resources are
    measured with nothing of theirs open."""

    def __init__(self, n: int) -> None:
        self.n, self.idle, self.paused = n, 0, False
        self.cond = threading.Condition()

    def point(self, stop: threading.Event) -> None:
        with self.cond:
            if not self.paused:
                return
            self.idle += 1
            self.cond.notify_all()
            while self.paused and not stop.is_set():
                self.cond.wait(0.5)
            self.idle -= 1

    def pause(self, timeout: float) -> bool:
        with self.cond:
            self.paused = True
            return self.cond.wait_for(lambda: self.idle >= self.n, timeout)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()


class Counted(logging.Handler):
    """Counts the warnings the servers log (one per dropped hostile connection) instead
    of printing them: the summary says how many."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.n[record.name] = self.n.get(record.name, 0) + 1


class Soak:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.logged = Counted()
        root = logging.getLogger("rdmamw")
        root.addHandler(self.logged)
        root.propagate = False
        self.stop = threading.Event()
        self.failures: list[str] = []
        self.lock = threading.Lock()
        # latencies by whole milliseconds: a bounded record however long the run
        self.lat: dict[str, dict[int, int]] = {"open": {}, "join": {}, "pull": {}}
        self.done = {"exchanges": 0, "messages": 0, "rounds": 0, "epochs": 0,
                     "echo_dropped": 0, "ps_hostile_frames": 0}
        self.gate = Gate(3)
        self.echo = rdmamw.listen("tcp://127.0.0.1:0")
        self.ps = rdmamw.listen("tcp://127.0.0.1:0")
        self.store_port = _free_port()
        self.threads: dict[str, threading.Thread] = {}

    def fail(self, why: str) -> None:
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(why)

    def took(self, what: str, seconds: float) -> None:
        ms = min(int(seconds * 1000) + 1, 600_000)
        with self.lock:
            self.lat[what][ms] = self.lat[what].get(ms, 0) + 1
        if seconds > self.a.open_bound:
            self.fail(f"an honest {what} took {seconds:.2f} s (bound {self.a.open_bound} s)")

    def guarded(self, name: str, body) -> None:
        """Run a server or member loop; its death is a failure."""
        def run() -> None:
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - every death is listed
                self.fail(f"{name} died: {type(e).__name__}: {e}")
        t = threading.Thread(target=run, name=f"soak-{name}", daemon=True)
        self.threads[name] = t
        t.start()

    # -- the echo listener and its honest member
    def echo_accept(self) -> None:
        accept_each(self.echo, self.stop, self.echo_serve)

    def echo_serve(self, ch) -> None:
        try:
            while True:
                with ch.recv(timeout=None) as m:
                    ch.send(bytes(m)).wait(10)
        except (ChannelClosed, PeerLost, ProtocolError, rdmamw.Timeout):
            with self.lock:
                self.done["echo_dropped"] += 1
        except BaseException as e:  # noqa: BLE001
            self.fail(f"an echo handler died: {type(e).__name__}: {e}")
        finally:
            ch.close()

    def echo_member(self) -> None:
        rng = random.Random(1)
        while not self.stop.is_set():
            self.gate.point(self.stop)
            t0 = time.monotonic()
            ch = rdmamw.Channel.open(self.echo.address, timeout=30)
            self.took("open", time.monotonic() - t0)
            with ch:
                for _ in range(8):
                    body = os.urandom(rng.choice(SIZES))
                    ch.send(body).wait(10)
                    with ch.recv(timeout=10) as m:
                        if bytes(m) != body:
                            self.fail(f"an echo of {len(body)} bytes came back different")
            with self.lock:
                self.done["exchanges"] += 1
                self.done["messages"] += 16
            self.stop.wait(0.05)

    # -- the bootstrap store: rounds of a 3-rank job on one port
    def store_rounds(self) -> None:
        while not self.stop.is_set():
            self.gate.point(self.stop)
            sock = None
            for _ in range(100):        # the port may still be held a moment
                try:
                    sock = store.listen("127.0.0.1", self.store_port)
                    break
                except RdmamwError:
                    time.sleep(0.05)
            if sock is None:
                raise RuntimeError(f"store port {self.store_port} stayed taken")
            got: dict[int, object] = {}
            t0 = time.monotonic()

            def rank(r: int, got: dict = got) -> None:
                try:
                    got[r] = store.join("127.0.0.1", self.store_port, r, None,
                                        lambda ip: {"host": f"h{r}"}, RANKS, 30,
                                        launcher_job=JOB)
                except BaseException as e:  # noqa: BLE001 - listed below
                    got[r] = e
            joiners = [threading.Thread(target=rank, args=(r,)) for r in range(1, RANKS)]
            for j in joiners:
                j.start()
            table, _ = store.serve(sock, RANKS, {"host": "h0"}, 30, launcher_job=JOB)
            for j in joiners:
                j.join(30)
            self.took("join", time.monotonic() - t0)
            bad = {r: v for r, v in got.items() if isinstance(v, BaseException)}
            if bad or sorted(table) != list(range(RANKS)):
                self.fail(f"store round: {bad or sorted(table)}")
            with self.lock:
                self.done["rounds"] += 1
            self.stop.wait(0.1)

    # -- the parameter server: epochs of an honest and a hostile worker
    def ps_epochs(self) -> None:
        from rdmamw.ps import KVServer, KVWorker

        bad = [b"\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": 3}),
               msgpack.packb({"op": "pull", "id": 1, "keys": [[1, 2]]}),
               msgpack.packb({"op": "clock", "c": 1, "base": "0"}),
               msgpack.packb({"op": "grad", "k": "w", "o": -3, "dt": "<f4"})]
        rng = random.Random(2)
        value = np.arange(1000, dtype=np.float32)
        while not self.stop.is_set():
            self.gate.point(self.stop)
            honest, s_honest = self.pair()
            hostile, s_hostile = self.pair()
            srv = KVServer({0: s_honest, 1: s_hostile}, consistency="asp")
            out: dict = {}

            def serve(srv: KVServer = srv, out: dict = out) -> None:
                try:
                    out["stats"] = srv.serve()
                except BaseException as e:  # noqa: BLE001
                    out["error"] = e
            st = threading.Thread(target=serve, name="soak-ps-serve", daemon=True)
            st.start()
            drain = threading.Thread(target=self.drain, args=(hostile,), daemon=True)
            drain.start()               # its ERR replies (unread, they would fill its
            worker = KVWorker([honest], timeout=30)     # ring and stall the server)
            worker.init(["w"], [value])
            end = time.monotonic() + self.a.epoch
            sent = 0
            while time.monotonic() < end and not self.stop.is_set():
                try:
                    hostile.send(rng.choice(bad)).wait(5)
                    sent += 1
                except RdmamwError:
                    pass                # the server dropped it: fine
                t0 = time.monotonic()
                worker.push(["w"], [np.ones(1000, dtype=np.float32)])
                worker.pull(["w"])
                self.took("pull", time.monotonic() - t0)
                self.stop.wait(0.01)
            hostile.close()
            worker.close()
            st.join(30)
            drain.join(10)
            srv.close()
            s_honest.close(), s_hostile.close(), honest.close()
            if st.is_alive() or "error" in out:
                raise RuntimeError(f"the parameter server's serve() "
                                   f"{'hung' if st.is_alive() else 'raised'}: "
                                   f"{out.get('error')!r}")
            with self.lock:
                self.done["epochs"] += 1
                self.done["ps_hostile_frames"] += sent

    @staticmethod
    def drain(ch) -> None:
        try:
            while True:
                ch.recv(timeout=None).release()
        except RdmamwError:
            pass

    def pair(self):
        """(an opener's channel, the parameter server's) through the ps listener."""
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(ch=self.ps.accept(timeout=30)))
        t.start()
        try:
            ch = rdmamw.Channel.open(self.ps.address, timeout=30)
        finally:
            t.join(35)
        if "ch" not in got:
            raise RuntimeError("the parameter server's listener accepted nothing")
        return ch, got["ch"]

    # -- the run
    def quiet(self) -> dict:
        """Resources with every activity paused between operations."""
        if self.alive():
            return resources()
        if not self.gate.pause(60):
            self.fail("the honest members did not pause within 60 s")
        time.sleep(0.5)
        gc.collect()
        res = resources()
        self.gate.resume()
        return res

    def alive(self) -> list[str]:
        dead = [n for n, t in self.threads.items() if not t.is_alive()]
        loops = {t.name for t in threading.enumerate() if t.name.startswith("rdmamw-listen")}
        for lst in (self.echo, self.ps):
            if f"rdmamw-listen {lst.address}" not in loops:
                dead.append(f"the accept loop of {lst.address}")
        return dead

    def run(self) -> dict:
        a = self.a
        self.guarded("echo accept", self.echo_accept)
        self.guarded("echo member", self.echo_member)
        self.guarded("store rounds", self.store_rounds)
        self.guarded("ps epochs", self.ps_epochs)
        time.sleep(min(10.0, max(3.0, a.seconds / 10)))      # warm-up without the hostile
        base = self.quiet()
        ports = f"{self.echo.address.rpartition(':')[2]},{self.ps.address.rpartition(':')[2]}," \
                f"{self.store_port}"
        hostile = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--hostile",
                                    ports], stdout=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        samples = []
        while time.monotonic() - t0 < a.seconds and not self.failures:
            self.stop.wait(1.0)
            if hostile.poll() is not None:
                self.fail(f"the hostile process exited with {hostile.returncode}")
                break
            if (dead := self.alive()):
                self.fail(f"server threads gone: {dead}")
                break
            if len(samples) < (time.monotonic() - t0) / 10:
                samples.append(counts_only(resources()))
        elapsed = time.monotonic() - t0
        hostile.send_signal(signal.SIGTERM)
        try:
            attacks = json.loads(hostile.communicate(timeout=60)[0] or "{}")
        except (subprocess.TimeoutExpired, ValueError):
            hostile.kill()
            hostile.wait()
            attacks = {}
            self.fail("the hostile process did not report")
        time.sleep(4.5)                 # its last connections pass the proof deadline
        end = self.quiet()
        self.stop.set()
        for t in self.threads.values():
            t.join(60)
        if not self.failures:
            self.check_flat(base, end)
        self.echo.close(), self.ps.close()
        lat = {k: _quantiles(v) for k, v in self.lat.items()}
        return {"seconds": round(elapsed, 1), "honest": dict(self.done), "latency_s": lat,
                "attacks": attacks,
                "attacks_total": sum(n for k, n in attacks.items() if ":" not in k),
                "warnings_logged": self.logged.n,
                "quiet_after_warmup": counts_only(base), "quiet_at_end": counts_only(end),
                "under_attack": samples,
                "fds_changed": grown(base["fd_kinds"], end.get("fd_kinds", {})),
                "failures": self.failures}

    def check_flat(self, base: dict, end: dict) -> None:
        for key, slack in (("fds", 4), ("threads", 2), ("maps", 16)):
            if end[key] > base[key] + slack:
                kinds = {"maps": "map_kinds", "fds": "fd_kinds"}.get(key)
                what = f" (changed: {grown(base[kinds], end[kinds])})" if kinds else ""
                self.fail(f"{key}: {base[key]} after warm-up, {end[key]} at the end{what}")
        if end["rss_mib"] > base["rss_mib"] + self.a.rss_slack_mib:
            self.fail(f"RSS: {base['rss_mib']:.0f} MiB after warm-up, "
                      f"{end['rss_mib']:.0f} MiB at the end")


def _quantiles(hist: dict[int, int]) -> dict:
    """Count, median, p99 and max (s, rounded up to the millisecond) of a histogram of
    whole milliseconds."""
    n = sum(hist.values())
    out: dict = {"n": n, "median": None, "p99": None, "max": None}
    seen = 0
    for ms in sorted(hist):
        seen += hist[ms]
        for q, key in ((0.5, "median"), (0.99, "p99")):
            if out[key] is None and seen >= q * n:
                out[key] = ms / 1000
        out["max"] = ms / 1000
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60, help="s under attack")
    ap.add_argument("--open-bound", type=float, default=2.0,
                    help="s an honest open, join or pull may take")
    ap.add_argument("--epoch", type=float, default=3.0, help="s of a parameter-server epoch")
    ap.add_argument("--rss-slack-mib", type=float, default=32)
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--hostile", help=argparse.SUPPRESS)     # the hostile process: ports
    a = ap.parse_args(argv)
    if a.hostile:
        return hostile_main(a)
    summary = Soak(a).run()
    emit(summary, a.json)
    h, lat = summary["honest"], summary["latency_s"]
    print(f"hostile soak: {summary['attacks_total']} hostile attempts in "
          f"{summary['seconds']} s; honest: {h['exchanges']} channels ({h['messages']} "
          f"messages), {h['rounds']} store rounds, {h['epochs']} ps epochs; slowest open "
          f"{lat['open']['max']} s, join {lat['join']['max']} s, pull {lat['pull']['max']} s; "
          f"{len(summary['failures'])} failures")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
