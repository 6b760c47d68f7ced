"""One rank of a test job: rdmamw.init() from whatever launcher started us, a channel
to every other rank, messages both ways, one JSON line of results on stdout.

``--hold``: afterwards watch the channels to other hosts (tcp, verbs) and report when
each one raised PeerLost (the fault tests take a host's link down or kill a rank).

``FAKE_VERBS_FABRIC=10.1.0.1/24`` (tests only): this rank's descriptor claims a RoCE
port with that address, on that network, so that two "hosts" without RDMA show the
choice between fabrics."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import rdmamw


def fake_fabric(spec: str) -> None:
    """Replace this rank's verbs descriptor entry with one RoCE port on ``spec``."""
    import ipaddress

    from rdmamw.providers.verbs import rank as verbs_rank
    ip = ipaddress.ip_interface(spec)
    port = verbs_rank.Port("rxefake", 1, 1, ipaddress.IPv6Address(f"::ffff:{ip.ip}").packed,
                           "ethernet", f"roce:{ip.network}")
    verbs_rank.advertise = lambda *a: ({"addr": "verbs://127.0.0.1:9",
                                        "ports": [port.as_dict()]}, None)


def phase(rank: int, what: str, t0: float) -> None:
    """A line on stderr per step: a failed job shows how far each rank got, and when."""
    print(f"rank {rank}: {what} at {time.monotonic() - t0:.2f} s", file=sys.stderr,
          flush=True)


def main() -> None:
    hold = "--hold" in sys.argv
    t0 = time.monotonic()
    if os.environ.get("FAKE_VERBS_FABRIC"):
        fake_fabric(os.environ["FAKE_VERBS_FABRIC"])
    w = rdmamw.init(timeout=float(sys.argv[1]) if len(sys.argv) > 1 and
                    sys.argv[1][0].isdigit() else 60)
    phase(w.rank, "initialized", t0)
    chans = {r: rdmamw.Channel.open(r, timeout=60) for r in range(w.world_size)
             if r != w.rank}
    phase(w.rank, "channels open", t0)
    big = np.full(16384, w.rank, dtype=np.float32)            # 64 KiB
    for r, ch in chans.items():
        ch.send_batch([b"%d->%d #%d" % (w.rank, r, i) for i in range(1000)] + [big])
    for r, ch in chans.items():
        got: list = []
        while len(got) < 1001:      # no more: the next phase's messages may be there
            got += [bytes(m) for m in ch.recv_batch(1001 - len(got), timeout=30)]
        assert got[:1000] == [b"%d->%d #%d" % (r, w.rank, i) for i in range(1000)]
        assert np.frombuffer(got[1000], np.float32).tolist() == [float(r)] * 16384
        phase(w.rank, f"1,001 messages from rank {r}", t0)
    # batches of 32 small messages: one doorbell each (the target over verbs), counted
    # around the sends only (receiving writes slots back: doorbells of its own)
    traffic = {}
    for r, ch in chans.items():
        before = ch.stats()
        for i in range(10):
            ch.send_batch([b"%07d" % i] * 32).wait(timeout=30)
        st = ch.stats()
        traffic[r] = {k: st.get(k, 0) - before.get(k, 0) for k in (
            "batches", "doorbells", "wakeups_sent", "wakeups_chained", "control_writes",
            "reclaim_writebacks")}         # (wakeups_chained: verbs only)
        phase(w.rank, f"10 batches to rank {r}", t0)
    for r, ch in chans.items():
        got = []
        while len(got) < 320:
            got += [bytes(m) for m in ch.recv_batch(320 - len(got), timeout=30)]
        assert got == [b"%07d" % i for i in range(10) for _ in range(32)]
        phase(w.rank, f"320 messages from rank {r}", t0)
        st = ch.stats()
        traffic[r].update({k: st[k] for k in ("bytes", "bytes_written", "bytes_received")})
    out = {"rank": w.rank, "traffic": traffic, "world": w.world_size, "launcher": w.launcher,
           "token_from_env": bool(os.environ.get("RDMAMW_TOKEN")),
           "providers": {r: ch.peer.split("://")[0] for r, ch in chans.items()},
           "channel_provider": {r: ch.provider for r, ch in chans.items()},
           "stats_provider": {r: ch.stats()["provider"] for r, ch in chans.items()}}
    print(json.dumps(out), flush=True)
    if hold:
        lost: dict = {}
        done: set = set()
        end = time.monotonic() + 10
        watch = {r: ch for r, ch in chans.items() if ch.provider != "shm"}
        while time.monotonic() < end and len(done) < len(watch):
            for r, ch in watch.items():     # watch the other host's ranks at once
                if r not in done:
                    try:
                        ch.recv(timeout=0.01)
                    except rdmamw.PeerLost:
                        lost[r] = time.time()
                        done.add(r)
                    except rdmamw.ChannelClosed:
                        done.add(r)
                    except rdmamw.Timeout:
                        pass
        print(json.dumps({"rank": w.rank, "lost": lost}), flush=True)
    for ch in chans.values():
        ch.close()
    phase(w.rank, "channels closed", t0)
    rdmamw.finalize()
    phase(w.rank, "finalized", t0)


if __name__ == "__main__":
    main()
