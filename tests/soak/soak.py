"""Soak: a randomized, long workload that checks rdmamw loses, duplicates and reorders
nothing, hangs nowhere and leaks nothing, with peers killed, restarted and forking.

One hub process listens; ``--peers`` peer processes open channels to it. Each peer runs
``--threads`` sending threads: batches of 1-16 messages whose sizes straddle the eager /
rendezvous threshold (8 B up to 4x the eager limit), every handle waited with a
deadline. Each message carries (thread, sequence) and bytes the hub checks whole
against the same seeded pool. The hub holds some messages and releases them out of
order, and streams small numbered messages back, which the peer checks. Every
``--kill-every`` seconds a random peer is SIGKILLed: the hub must see ``PeerLost``
within ``--lost-within`` seconds, everything that arrived must be a gap-free prefix per
thread, and a new peer takes its place. Every ``--fork-every`` seconds a peer forks a
child that exits normally, closes its inherited channel, or tries to send on it (which
must raise): the parent's stream goes on unharmed. At the end every peer sends its
per-thread counts, which must match what arrived; the hub's fds, threads, mappings and
RSS after the run are compared with the figures after warm-up.

    python tests/soak/soak.py --provider shm --seconds 60
    python tests/soak/soak.py --provider tcp --seconds 1800 --json soak-tcp.json

Exit status 0: every check held; 1: a check failed (listed); the summary is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np

import rdmamw
from rdmamw.errors import ChannelClosed, PeerLost, RdmamwError

HDR = struct.Struct("<IIQ")          # kind, thread, seq
DATA, END, HELLO, TICK, FORKED = 1, 2, 3, 4, 5
POOL_BYTES = 8 << 20
ADDRESS = {"shm": lambda: f"shm://rdmamw-soak-{os.getpid()}",
           "tcp": lambda: "tcp://127.0.0.1:0",
           "verbs": lambda: "verbs://127.0.0.1:0"}


def pool(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, POOL_BYTES, dtype=np.uint8)


def body_at(p: np.ndarray, thread: int, seq: int, n: int) -> memoryview:
    off = (seq * 7919 + thread * 104729) % (POOL_BYTES - n)
    return memoryview(p[off:off + n])


def map_kinds() -> dict[str, int]:
    """How many mappings of each kind (the file, or the bracketed name, or "anon"):
    what a failed "maps" check prints, so a leak says what it leaks."""
    kinds: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else "anon"
            kinds[name] = kinds.get(name, 0) + 1
    return kinds


def fd_kinds() -> dict[str, int]:
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        name = target.split(":", 1)[0] if ":" in target else target
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def resources() -> dict:
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f)
    kinds = map_kinds()
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": int(st["Threads"]),
            "maps": sum(kinds.values()), "rss_mib": int(st["VmRSS"].split()[0]) / 1024,
            "map_kinds": kinds, "fd_kinds": fd_kinds()}


def counts_only(res: dict | None) -> dict | None:
    return res and {k: v for k, v in res.items() if not k.endswith("_kinds")}


def grown(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(before) | set(after))
            if after.get(k, 0) != before.get(k, 0)}


def emit(summary: dict, path: str | None) -> None:
    """Print the summary, and write it to ``path`` too when given."""
    print(json.dumps(summary, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)


def accept_each(lst, stop: threading.Event, serve) -> None:
    """Accept on ``lst`` until ``stop``, each channel served by ``serve(ch)`` in a
    thread of its own."""
    while not stop.is_set():
        try:
            ch = lst.accept(timeout=0.5)
        except rdmamw.Timeout:
            continue
        threading.Thread(target=serve, args=(ch,), daemon=True).start()


# ---- the peer process ------------------------------------------------------------------

def peer_main(a: argparse.Namespace) -> int:
    rng = random.Random(a.seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())    # the hub's "finish now"
    p = pool(a.pool_seed)
    ch = rdmamw.Channel.open(a.peer, timeout=30)
    limit = ch.eager_limit
    big = min(4 * limit, a.max_size)
    ch.send(HDR.pack(HELLO, a.incarnation, a.id) + msgpack.packb({"pid": os.getpid()})).wait(30)
    counts = [0] * a.threads
    errors: list[str] = []
    ticks = {"n": 0}

    def sender(t: int) -> None:
        r = random.Random(a.seed * 1000 + t)
        try:
            while not stop.is_set():
                batch = []
                for _ in range(r.randint(1, 16)):
                    x = r.random()
                    n = r.randint(0, 496) if x < .6 else (
                        r.randint(497, limit - HDR.size) if x < .85 else r.randint(limit + 1, big))
                    seq = counts[t]
                    counts[t] += 1
                    batch.append(HDR.pack(DATA, t, seq) + bytes(body_at(p, t, seq, n)))
                ch.send_batch(batch, timeout=30).wait(30)
            ch.send(HDR.pack(END, t, counts[t])).wait(30)
        except BaseException as e:      # noqa: BLE001 (reported to the hub and the exit code)
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    def receiver() -> None:         # the hub's ticks: numbered, in order, once each
        try:
            while True:
                for m in ch.recv_batch(timeout=None):
                    _k, _t, seq = HDR.unpack_from(m)
                    if seq != ticks["n"]:
                        errors.append(f"tick {seq} arrived, expected {ticks['n']}")
                    ticks["n"] = seq + 1
                    m.release()
        except (ChannelClosed, PeerLost):
            pass
        except BaseException as e:      # noqa: BLE001
            errors.append(f"receiver: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=sender, args=(t,)) for t in range(a.threads)]
    rx = threading.Thread(target=receiver, daemon=True)
    for t in (*threads, rx):
        t.start()
    forks = fork_failures = 0
    next_fork = time.monotonic() + rng.uniform(0.5, 2) * a.fork_every if a.fork_every else None
    while not stop.is_set() and not errors:
        time.sleep(0.05)
        if next_fork is not None and time.monotonic() >= next_fork:
            forks += 1
            failed = fork_child(ch, rng.choice(("exit", "close", "send")))
            fork_failures += failed
            ch.send(HDR.pack(FORKED, failed, forks))     # counted by the hub as they come
            next_fork = time.monotonic() + a.fork_every
    stop.set()
    for t in threads:
        t.join(60)
    report = {"counts": counts, "forks": forks, "fork_failures": fork_failures,
              "errors": errors, "ticks": ticks["n"], "res": resources()}
    try:
        ch.send(HDR.pack(END, 1 << 31, 0) + msgpack.packb(report)).wait(30)
        ch.close()
    except RdmamwError as e:
        errors.append(f"final report: {e}")
    return 1 if errors or fork_failures else 0


def fork_child(ch, action: str) -> int:
    """Fork; the child does ``action`` with the inherited channel and exits. 1 if the
    child misbehaved (a send that did not raise, a crash)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if action == "close":
                ch.close()
            elif action == "send":
                try:
                    ch.send(b"from a child")
                    code = 7            # must not be possible
                except RdmamwError:
                    pass
        except BaseException:           # noqa: BLE001
            code = 8
        if action == "exit" and code == 0:
            sys.exit(0)                 # a normal exit: atexit, GC, finalizers run
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return 0 if os.waitstatus_to_exitcode(status) == 0 else 1


# ---- the hub -------------------------------------------------------------------------

def send_tick(ch, n: int) -> bool:
    """Send tick ``n`` to a peer; False once the peer closed or went. A send raises
    ChannelClosed as soon as the peer's close word is seen, while the rest of the batch
    the hub is checking (the peer's final report, say) was received but not yet looked
    at: that exception must not end the receive (it did: "no final report"). The
    receive itself raises it once everything the peer sent has been delivered."""
    try:
        ch.send(HDR.pack(TICK, 0, n))
    except (ChannelClosed, PeerLost):
        return False
    return True


@dataclass
class Peer:
    id: int
    incarnation: int
    proc: subprocess.Popen
    killed_at: float | None = None
    lost_after: float | None = None
    next_seq: dict = field(default_factory=dict)
    ended: dict = field(default_factory=dict)
    report: dict | None = None
    forks: int = 0
    messages: int = 0
    bytes: int = 0
    connected: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class Hub:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rng = random.Random(a.seed)
        self.pool = pool(a.pool_seed)
        self.lst = rdmamw.listen(ADDRESS[a.provider]())
        self.failures: list[str] = []
        self.peers: dict[tuple[int, int], Peer] = {}
        self.lock = threading.Lock()
        self.kills = self.restarts = 0
        self.lost_latency: list[float] = []
        self.stop = threading.Event()
        self.accepted: queue.Queue = queue.Queue()

    def fail(self, why: str) -> None:
        with self.lock:
            self.failures.append(why)

    def spawn(self, pid: int, incarnation: int) -> None:
        a = self.a
        cmd = [sys.executable, os.path.abspath(__file__), "--peer", self.lst.address,
               "--id", str(pid), "--incarnation", str(incarnation),
               "--seed", str(a.seed * 7777 + pid * 131 + incarnation), "--pool-seed",
               str(a.pool_seed), "--threads", str(a.threads), "--fork-every",
               str(a.fork_every), "--max-size", str(a.max_size)]
        proc = subprocess.Popen(cmd)
        with self.lock:
            self.peers[(pid, incarnation)] = Peer(pid, incarnation, proc)

    def accept_loop(self) -> None:
        accept_each(self.lst, self.stop, self.serve)

    def serve(self, ch) -> None:
        peer = None
        held: list = []
        tick = 0
        try:
            m = ch.recv(timeout=30)
            kind, inc, pid = HDR.unpack_from(m)
            m.release()
            if kind != HELLO:
                raise AssertionError(f"first message of kind {kind}")
            with self.lock:
                peer = self.peers[(pid, inc)]
            peer.connected.set()
            while True:
                for m in ch.recv_batch(timeout=None):
                    self.check(peer, m)
                    held.append(m)
                    if tick < 1 << 62 and self.rng.random() < 0.05:
                        tick = tick + 1 if send_tick(ch, tick) else 1 << 62
                while len(held) > 6 or (held and self.rng.random() < 0.3):
                    held.pop(self.rng.randrange(len(held))).release()
        except (ChannelClosed, PeerLost) as e:
            if peer is not None:
                if isinstance(e, PeerLost) and peer.killed_at is not None:
                    peer.lost_after = time.monotonic() - peer.killed_at
                elif isinstance(e, PeerLost):
                    self.fail(f"peer {peer.id}.{peer.incarnation}: PeerLost though alive: {e}")
        except BaseException as e:      # noqa: BLE001 (every failure is listed)
            who = f"{peer.id}.{peer.incarnation}" if peer else "?"
            self.fail(f"peer {who}: {type(e).__name__}: {e}")
        finally:
            for m in held:
                m.release()
            held.clear()
            ch.close()
            if peer is not None:
                peer.done.set()

    def check(self, peer: Peer, m) -> None:
        kind, t, seq = HDR.unpack_from(m)
        if kind == END and t == 1 << 31:
            peer.report = msgpack.unpackb(bytes(memoryview(m)[HDR.size:]))
            return
        if kind == FORKED:
            peer.forks += 1
            if t:
                self.fail(f"peer {peer.id}.{peer.incarnation}: fork child {seq} misbehaved")
            return
        if kind == END:
            peer.ended[t] = seq
            if peer.next_seq.get(t, 0) != seq:
                self.fail(f"peer {peer.id}.{peer.incarnation} thread {t}: sent {seq}, "
                          f"{peer.next_seq.get(t, 0)} arrived")
            return
        if kind != DATA:
            raise AssertionError(f"message of kind {kind}")
        want = peer.next_seq.get(t, 0)
        if seq != want:
            self.fail(f"peer {peer.id}.{peer.incarnation} thread {t}: seq {seq} arrived, "
                      f"expected {want} ({'duplicate' if seq < want else 'gap'})")
        peer.next_seq[t] = seq + 1
        n = len(m) - HDR.size
        if memoryview(m)[HDR.size:] != body_at(self.pool, t, seq, n):
            self.fail(f"peer {peer.id}.{peer.incarnation} thread {t} seq {seq}: "
                      f"{n} bytes differ")
        peer.messages += 1
        peer.bytes += len(m)

    def run(self) -> dict:
        a = self.a
        self.acc = threading.Thread(target=self.accept_loop, daemon=True)
        self.acc.start()
        for pid in range(a.peers):
            self.spawn(pid, 0)
        t0 = time.monotonic()
        warm = t0 + min(10.0, a.seconds / 5)
        base = None
        next_kill = t0 + a.kill_every if a.kill_every else None
        while time.monotonic() - t0 < a.seconds and not self.failures:
            time.sleep(0.1)
            if base is None and time.monotonic() >= warm and self.settled():
                gc.collect()
                base = resources()
            if next_kill is not None and time.monotonic() >= next_kill:
                self.kill_one()
                next_kill = time.monotonic() + a.kill_every
            self.reap_dead()
        return self.finish(base, time.monotonic() - t0)

    def settled(self) -> bool:
        """A peer connected and sending: what a process opens once (a device, its CQs
        and threads) is open, so the end is compared with a state that has it (taken
        before the first connection, under a slow VM, it did not). Not every peer: with
        kills every few seconds and peers slow to start there may be no such moment."""
        return any(p.messages > 0 for p in self.live())

    def live(self) -> list[Peer]:
        with self.lock:
            return [p for p in self.peers.values() if p.killed_at is None]

    def kill_one(self) -> None:
        live = [p for p in self.live() if p.proc.poll() is None and p.connected.is_set()]
        if not live:
            return
        victim = self.rng.choice(live)
        victim.killed_at = time.monotonic()
        victim.proc.kill()
        self.kills += 1
        if not victim.done.wait(self.a.lost_within + 30):
            self.fail(f"peer {victim.id}.{victim.incarnation} killed: the hub never "
                      "noticed")
            return
        if victim.lost_after is None or victim.lost_after > self.a.lost_within:
            self.fail(f"peer {victim.id}.{victim.incarnation} killed: PeerLost after "
                      f"{victim.lost_after} s (limit {self.a.lost_within})")
        else:
            self.lost_latency.append(victim.lost_after)
        victim.proc.wait()
        self.spawn(victim.id, victim.incarnation + 1)
        self.restarts += 1

    def reap_dead(self) -> None:
        for p in self.live():
            if p.proc.poll() not in (None, 0):
                self.fail(f"peer {p.id}.{p.incarnation} exited with {p.proc.returncode}")
                p.killed_at = time.monotonic()

    def finish(self, base: dict | None, elapsed: float) -> dict:
        for p in self.live():   # a peer still starting (slow in the VM) connects first
            if p.proc.poll() is None and not p.connected.wait(60):
                self.fail(f"peer {p.id}.{p.incarnation} never connected")
        for p in self.live():
            p.proc.send_signal(signal.SIGTERM)
        for p in self.live():
            try:
                code = p.proc.wait(120)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                code = "hung"
                self.fail(f"peer {p.id}.{p.incarnation} did not finish within 120 s")
            if not p.done.wait(30):
                self.fail(f"peer {p.id}.{p.incarnation}: its channel never closed")
            r = p.report
            if code != 0:
                self.fail(f"peer {p.id}.{p.incarnation} exited with {code}: "
                          f"{r and r['errors']}")
            if r is None:
                self.fail(f"peer {p.id}.{p.incarnation}: no final report")
                continue
            for t, n in enumerate(r["counts"]):
                if p.next_seq.get(t, 0) != n or p.ended.get(t) != n:
                    self.fail(f"peer {p.id}.{p.incarnation} thread {t} sent {n}, "
                              f"{p.next_seq.get(t, 0)} arrived")
        self.stop.set()
        self.acc.join(10)       # its accept() times out within 0.5 s
        self.lst.close()
        gc.collect()
        end = resources()
        if base is None:
            self.fail("no baseline: no peer was ever connected and sending")
        else:
            self.check_flat(base, end)
        with self.lock:
            peers = list(self.peers.values())
        forks = sum(p.forks for p in peers)
        return {
            "provider": self.a.provider, "seconds": round(elapsed, 1),
            "messages": sum(p.messages for p in peers),
            "bytes": sum(p.bytes for p in peers),
            "peers": len(peers), "kills": self.kills, "restarts": self.restarts,
            "forks": forks,
            "peer_lost_s": {"max": max(self.lost_latency, default=None),
                            "median": sorted(self.lost_latency)[len(self.lost_latency) // 2]
                            if self.lost_latency else None},
            "hub_after_warmup": counts_only(base), "hub_at_end": counts_only(end),
            "hub_maps_changed": base and end and grown(base["map_kinds"], end["map_kinds"]),
            "failures": self.failures,
        }

    def check_flat(self, base: dict, end: dict) -> None:
        a = self.a
        for key, slack in (("fds", 4), ("threads", 2), ("maps", 16)):
            if end[key] > base[key] + slack:
                kinds = {"maps": "map_kinds", "fds": "fd_kinds"}.get(key)
                what = f" (changed: {grown(base[kinds], end[kinds])})" if kinds else ""
                self.fail(f"hub {key}: {base[key]} after warm-up, {end[key]} at the end{what}")
        if end["rss_mib"] > base["rss_mib"] + a.rss_slack_mib:
            self.fail(f"hub RSS: {base['rss_mib']:.0f} MiB after warm-up, "
                      f"{end['rss_mib']:.0f} MiB at the end")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", choices=sorted(ADDRESS), default="shm")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="sending threads per peer")
    ap.add_argument("--kill-every", type=float, default=10, help="s (0: never)")
    ap.add_argument("--fork-every", type=float, default=4, help="s per peer (0: never)")
    ap.add_argument("--lost-within", type=float, default=2.0)
    ap.add_argument("--max-size", type=int, default=1 << 20, help="largest message")
    ap.add_argument("--rss-slack-mib", type=float, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the summary here")
    # a peer process (started by the hub)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pool-seed", type=int, default=12345, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.peer:
        return peer_main(a)
    summary = Hub(a).run()
    emit(summary, a.json)
    print(f"soak {a.provider}: {summary['messages']} messages, {summary['bytes'] / 1e9:.2f} GB "
          f"in {summary['seconds']} s; {summary['kills']} kills, {summary['forks']} forks; "
          f"{len(summary['failures'])} failures")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
