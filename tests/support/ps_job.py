"""One rank of a parameter-server test job (started by the local launcher): ranks
below --servers serve, the others minimise 0.5 * |x - target|^2 over a few keys
(one of them larger than the eager limit, so it travels in blocks). Each rank prints
one JSON line: a server its stats, a worker its final values' error and metrics.

--dump DIR: each worker saves its final values of every key to DIR/worker<index>.npz
(the tests compare whole vectors); each server reports in ``blocks`` how many distinct
blocks of each key it received (GRAD, INIT) and sent (VAL), counted from the headers.

--bad shape|unknown|init|after-bye: every worker makes that mistake once after its
init (after-bye: a BYE and a PULL in one batch to server 0, then it leaves).

--rounds: each server also reports every round it closed, in order, as the model
decided it (``rounds``: [version, merged, last, left_out], as rdmamw.ps.server's
timeline span names them), for the tests that check the timeline against it.

Faults: --die W:I makes worker W exit without a word before iteration I; --hang W:I:S
makes it sleep S s there; --kill-server V makes server 0 exit without a word once
its model reached version V."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np

import rdmamw
from rdmamw import ps
from rdmamw.ps import wire

KEYS = ["big", "b", "c", 7]


def shapes(big: int) -> list[tuple]:
    return [((big,), np.float32), ((3,), np.float64), ((2, 5), np.float32), ((4,), np.float32)]


def targets(big: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(d) for s, d in shapes(big)]


def emit(obj: dict) -> None:
    """One write per line: the ranks share the launcher's stdout pipe."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def count_blocks(node: ps.KVServer) -> dict[str, set]:
    """Wrap this server's payload handler and sender (test job only) to record the
    block offsets of each key: "grad:big" -> {0, 1020, ...}; "val:big" for replies."""
    seen: dict[str, set] = {}
    payload, send = node._payload, node._send

    def on_payload(w: int, h: dict, m: object) -> None:
        seen.setdefault(f"{h['op']}:{h['k']}", set()).add(h.get("o", 0))
        payload(w, h, m)

    def on_send(w: int, msgs: list) -> bool:
        for m in msgs:
            if isinstance(m, bytes) and (h := wire.unpack(m))["op"] == wire.VAL:
                seen.setdefault(f"val:{h['k']}", set()).add(h["o"])
        return send(w, msgs)

    node._payload, node._send = on_payload, on_send
    return seen


def log_rounds(node: ps.KVServer) -> list[list]:
    """Wrap this server's model's close (test job only) to log each round it closes:
    its version, the workers merged (sorted), the one that came last, the live ones
    left out."""
    rounds: list[list] = []
    close = node.policy.close

    def logged(now: float) -> list[int]:
        done = close(now)
        live = sorted(node.policy.live)
        rounds.append([node.policy.version, sorted(done), done[-1] if done else None,
                       [w for w in live if w not in done]])
        return done

    node.policy.close = logged  # type: ignore[method-assign]
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--consistency", default="bsp")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--big", type=int, default=40000)
    ap.add_argument("--slow", type=float, default=0.0, help="worker 0 sleeps this per iter")
    ap.add_argument("--die", default="")
    ap.add_argument("--hang", default="")
    ap.add_argument("--kill-server", type=int, default=0)
    ap.add_argument("--round-timeout", type=float, default=10.0)
    ap.add_argument("--timeout", type=float, default=None, help="the workers' wait limit")
    ap.add_argument("--bad", default="")
    ap.add_argument("--push-pull", action="store_true", help="one push_pull per iteration")
    ap.add_argument("--dump", default="", help="directory for the workers' final values")
    ap.add_argument("--rounds", action="store_true", help="servers report each round")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    c = ps.Consistency.parse(a.consistency, round_timeout=a.round_timeout)
    node = ps.start(a.servers, consistency=c, lr=0.2, momentum=0.5, timeout=a.timeout)
    rank = rdmamw.world().rank
    if isinstance(node, ps.KVServer):
        seen = count_blocks(node)
        rounds = log_rounds(node) if a.rounds else None
        if a.kill_server and rank == 0:
            end = time.monotonic() + 60
            while node.policy.version < a.kill_server and time.monotonic() < end:
                node.serve_once() or time.sleep(0.0005)
            os._exit(0)
        stats = node.serve()
        stats["round_sizes"] = sorted(set(stats["round_sizes"]))
        stats["reported_times"] = [m["compute_s"]["n"] for m in node.worker_metrics().values()]
        stats["blocks"] = {k: len(v) for k, v in seen.items()}
        if rounds is not None:
            stats["rounds"] = rounds
        emit({"role": "server", "rank": rank, **stats})
        node.close()
        return
    me = ps.worker_index(a.servers)
    tg = targets(a.big)
    x = [np.zeros(s, d) for s, d in shapes(a.big)]
    node.init(KEYS, [np.full(s, 1.0, d) for s, d in shapes(a.big)])
    out = {"role": "worker", "index": me}
    if a.bad:
        try:
            if a.bad == "shape":
                node.push(["b"], [np.zeros(4)])
            elif a.bad == "unknown":
                node.pull(["nope"])
            elif a.bad == "init":
                node.init(["c"], [np.zeros((5, 2), np.float32)])
            elif a.bad == "after-bye":      # a pull behind a goodbye, in one batch
                node.chans[0].send_batch([wire.pack(wire.BYE),
                                          wire.pack(wire.PULL, keys=["b"], id=0)]).wait()
                emit(out)
                return                      # no close: that would say goodbye again
        except (KeyError, ValueError, ps.PSError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
    die = [int(v) for v in a.die.split(":")] if a.die else [-1, -1]
    hang = [float(v) for v in a.hang.split(":")] if a.hang else [-1, -1, 0]
    try:
        node.pull(KEYS, out=x)
        for i in range(a.iters):
            if me == die[0] and i == die[1]:
                os._exit(0)
            if me == hang[0] and i == hang[1]:
                time.sleep(hang[2])
            if me == 0 and a.slow:
                time.sleep(a.slow)
            grads = [xi - ti for xi, ti in zip(x, tg, strict=True)]
            if a.push_pull:
                node.push_pull(KEYS, grads, out=x)
            else:
                node.push(KEYS, grads)
                node.pull(KEYS, out=x)
    except rdmamw.PeerLost as e:
        out["peer_lost"] = str(e)
    except rdmamw.Timeout as e:
        out["timeout"] = str(e)
    out["error_norm"] = float(max(np.abs(xi - ti).max() for xi, ti in zip(x, tg, strict=True)))
    if a.dump:
        np.savez(os.path.join(a.dump, f"worker{me}.npz"), *x)
    out["metrics"] = {k: v for k, v in node.metrics.as_dict().items() if k.startswith("bytes")}
    out["pushes"], out["clock"] = node.metrics.push.n, node.clock
    out["merged"] = node.merged
    out["pull_counts"] = node.pull_counts()
    emit(out)
    if "peer_lost" not in out:
        node.close()


if __name__ == "__main__":
    main()
