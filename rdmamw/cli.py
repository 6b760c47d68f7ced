"""The ``rdmamw`` command: ``demo`` (the main job: a parameter-server training
cluster), ``demo-stream`` (batched vs ack streaming), ``perf`` (perftest-style latency,
bandwidth and message rate between two hosts), ``info``, ``trace merge`` (the ranks'
timelines on one clock), ``top`` (a live view of a job), ``status`` (which ranks
of a job are up, lost or silent, and whom they wait on), ``tune`` (the collectives'
cost model) and ``tune rndv`` (the eager/rendezvous threshold)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass

import rdmamw
from rdmamw.providers import best, local_address
from rdmamw.transport.wire import MODES


@dataclass
class StreamResult:
    mode: str
    size: int
    batch: int
    messages: int
    seconds: float
    sender: dict
    receiver: dict

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def gbps(self) -> float:
        return self.messages * self.size / self.seconds / 1e9

    def per_msg(self, key: str, side: str = "sender") -> float:
        stats = self.sender if side == "sender" else self.receiver
        return stats[key] / max(1, self.messages)


def _cores() -> list[int]:
    """The cores this process may use, read once before anything is pinned."""
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = sorted(os.sched_getaffinity(0))
    return _ALLOWED


_ALLOWED: list[int] | None = None


def _pin(core: int | None) -> None:
    """Pin to one core: sender and receiver each get their own, as in production."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def _receiver(address: str, slots: int, slot_size: int, core: int | None, ready, out) -> None:
    """Count and release messages until the sender closes; report the stats."""
    _pin(core)
    with rdmamw.listen(address, slots=slots, slot_size=slot_size) as lst:
        ready.set()
        ch = lst.accept(timeout=30)
        n = 0
        recv_batch = ch.recv_batch
        while True:
            try:
                msgs = recv_batch(timeout=10)
            except rdmamw.ChannelClosed:
                break
            n += len(msgs)
            del msgs
        out.put((n, ch.stats()))
        ch.close()


def stream(mode: str, size: int, batch: int, seconds: float, slots: int = 128,
           slot_size: int = 65536, progress: bool = True) -> StreamResult:
    """Stream batches of ``batch`` messages of ``size`` bytes for ``seconds`` from this
    process to a receiver process on this host, in ``mode``, over the best provider
    between two local processes (shm)."""
    ctx = mp.get_context("spawn")
    address = local_address(best().scheme, f"rdmamw-demo-{os.getpid()}-{mode}-{size}")
    ready, out = ctx.Event(), ctx.Queue()
    cores = _cores()
    sender_core, receiver_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    proc = ctx.Process(target=_receiver,
                       args=(address, slots, slot_size, receiver_core, ready, out))
    proc.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("demo receiver did not start")
        _pin(sender_core)
        ch = rdmamw.Channel.open(address, mode=mode, timeout=30, slots=16, slot_size=4096)
        msgs = [os.urandom(size)] * batch
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=round(seconds, 1), desc=f"{mode:>7} {size:>6} B x {batch:<3}",
                       unit="s", bar_format="{desc} |{bar}| {n:.1f}/{total} s {postfix}",
                       leave=False, file=sys.stderr)
        send_batch = ch.send_batch
        sent = 0
        t0 = time.perf_counter()
        next_tick = t0 + 0.1
        while True:
            send_batch(msgs)
            sent += batch
            now = time.perf_counter()
            if now >= next_tick:
                if bar is not None:
                    bar.n = round(now - t0, 1)
                    bar.set_postfix_str(f"{sent / (now - t0) / 1e6:.2f} M msg/s")
                next_tick = now + 0.1
                if now - t0 >= seconds:
                    break
        sender_stats = ch.stats()
        ch.close()
        received, receiver_stats = out.get(timeout=60)
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        if received != sent:
            raise RuntimeError(f"sent {sent} messages but {received} arrived")
        return StreamResult(mode, size, batch, sent, elapsed, sender_stats, receiver_stats)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _table(results: list[StreamResult]) -> str:
    head = (f"{'mode':>8} {'size':>7} {'batch':>5} {'msgs/s':>12} {'GB/s':>7} "
            f"{'signaled/msg':>13} {'doorbells/msg':>14} {'acks/msg':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.mode:>8} {r.size:>7} {r.batch:>5} {r.rate:>12,.0f} {r.gbps:>7.2f} "
            f"{r.per_msg('signaled_completions'):>13.4f} {r.per_msg('doorbells'):>14.4f} "
            f"{r.per_msg('reclaim_writebacks', 'receiver'):>9.4f}")
    return "\n".join(lines)


def demo_stream(args: argparse.Namespace) -> int:
    """Batched vs per-message-acknowledged streaming, side by side."""
    print(f"rdmamw {rdmamw.__version__} demo-stream: one sender and one receiver process on "
          f"{best().scheme}, {args.seconds:g} s per run\n")
    results = []
    for size, batch in ((8, 256), (65536, 16)):
        for mode in MODES:
            results.append(stream(mode, size, batch, args.seconds, progress=not args.quiet))
    print(_table(results))
    print()
    for size in (8, 65536):
        b, a = [r for r in results if r.size == size]
        sig = a.per_msg("signaled_completions") / max(b.per_msg("signaled_completions"), 1e-12)
        print(f"{size:>6} B: batched moves {b.rate / a.rate:5.1f}x the messages of ack, "
              f"with 1/{sig:,.0f} of its signaled completions per message")
    return 0


def config_table() -> str:
    """Every setting: its effective value and where it came from (``info --config``)."""
    from rdmamw import config
    rows = config.effective()
    width = max(len(r["name"]) for r in rows)
    lines, component = [], None
    for r in rows:
        if r["component"] != component:
            component = r["component"]
            lines.append(f"[{component}]")
        value = "-" if r["value"] in (None, "") else r["value"]
        lines.append(f"  {r['name']:<{width}}  {value!s:<14} ({r['source']})  {r['doc']}")
    if config.unknown():
        lines.append("unknown RDMAMW_* variables (typos?): " + ", ".join(config.unknown()))
    return "\n".join(lines)


def info(args: argparse.Namespace) -> int:
    """Which providers work here, and why not; with --config, every setting."""
    if args.config:
        print(config_table())
        return 0
    from rdmamw.providers import providers
    print(f"rdmamw {rdmamw.__version__}")
    for p in providers():
        ok, why = p.status()
        print(f"  {p.scheme}://  {'available: ' if ok else 'unavailable: '}{why}")
        for line in p.info():
            print(f"    {line}")
    return 0


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:2] == ["tune", "rndv"]:    # rdmamw tune rndv -h
        from rdmamw.apps.tune_rndv import main as tune_rndv
        return tune_rndv(given[2:])
    if given[:1] == ["tune"]:            # its own argument parser (rdmamw tune -h)
        from rdmamw.apps.tune_coll import main as tune
        return tune(given[1:])
    if given[:1] == ["perf"]:            # its own argument parser (rdmamw perf -h)
        from rdmamw.apps.perf import main as perf
        return perf(given[1:])
    if given[:1] == ["trace"]:           # rdmamw trace merge a.json b.json -o all.json
        from rdmamw.trace.merge import main as trace
        return trace(given[1:])
    if given[:1] == ["top"]:             # its own argument parser (rdmamw top -h)
        from rdmamw.apps.top import main as top
        return top(given[1:])
    if given[:1] == ["status"]:          # its own argument parser (rdmamw status -h)
        from rdmamw.apps.status import main as status
        return status(given[1:])
    if given[:1] == ["demo"]:            # its own argument parser (rdmamw demo -h)
        from rdmamw.apps.demo.demo import main as demo
        return demo(given[1:])
    parser = argparse.ArgumentParser(prog="rdmamw", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="a parameter-server training cluster: consistency models "
                                "compared (rdmamw demo -h)")
    p = sub.add_parser("demo-stream", help="stream batched vs ack between two processes on shm")
    p.add_argument("--seconds", type=float, default=1.5, help="per run (default 1.5)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=demo_stream)
    sub.add_parser("perf", help="latency, bandwidth and message rate between a server and "
                                "a client, on any provider (rdmamw perf -h)")
    p = sub.add_parser("info", help="providers usable on this machine")
    p.add_argument("--config", action="store_true",
                   help="every RDMAMW_* setting: effective value and where it came from")
    p.set_defaults(func=info)
    sub.add_parser("trace", help="merge the ranks' timelines (RDMAMW_TRACE) into one "
                                 "file for Perfetto, or draw one into a PNG (rdmamw trace "
                                 "merge -h, rdmamw trace plot -h)")
    sub.add_parser("top", help="a live view of a running job from its metrics endpoints "
                               "(rdmamw top -h)")
    sub.add_parser("status", help="which ranks of a running job are up, lost or silent, "
                                  "and which peers they wait on (rdmamw status -h)")
    sub.add_parser("tune", help="calibrate the collectives' cost model (rdmamw tune -h); "
                   "'rdmamw tune rndv': the eager/rendezvous threshold")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
