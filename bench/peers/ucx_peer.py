"""UCX's own benchmark (``ucx_perftest``, Debian's ucx-utils) as a peer of bench/run.py.

Each test is a server and a client process of ``ucx_perftest`` over UCX's shared-memory
transport (``UCX_TLS=posix,self``), pinned to cores 0 and 1 like the other systems;
the client's ``Final:`` line is parsed. What maps to which row of the table:

* latency rows: ``ucp_am_lat`` (UCP active messages, the two-sided call closest to a
  channel's send/receive), one-way median;
* ``rate_stream``: ``ucp_am_bw`` of 8 B (UCX pipelines a window of messages; rdmamw's
  closest is its batch of 256);
* ``put_rate`` / ``put_bw``: ``ucp_put_bw`` of 8 B / 64 KiB (one-sided puts, UCX's
  fastest path: the issue's "UCX's put rate");
* ``bw``: ``ucp_am_bw`` of 64 KiB (two-sided, as rdmamw's stream).

Usage: python bench/peers/ucx_peer.py CONFIG_JSON; prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

MB = 1 << 20  # ucx_perftest's MB/s are MiB/s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def final(test: str, size: int, iters: int, timeout: float, warmup: int | None = None) -> dict:
    """Run one ucx_perftest pair; the client's Final line as numbers. ``warmup``:
    ucx_perftest's ``-w`` (its default, 10000 iterations, is long at 4 MiB)."""
    env = {**os.environ, "UCX_TLS": "posix,self", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    port = str(free_port())
    server = subprocess.Popen(["ucx_perftest", "-p", port, "-c", "0"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        out = ""
        for _ in range(50):  # the server listens within a few ms; retry until it does
            c = subprocess.run(["ucx_perftest", "-p", port, "127.0.0.1", "-c", "1", "-t", test,
                                "-s", str(size), "-n", str(iters),
                                *([] if warmup is None else ["-w", str(warmup)])], env=env,
                               capture_output=True, text=True, timeout=timeout)
            out = c.stdout + c.stderr
            if "Final:" in out:
                break
            time.sleep(0.05)
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    try:
        return parse_final(out)
    except ValueError as e:
        raise RuntimeError(f"ucx_perftest {test} -s {size}: {e}") from None


def parse_final(out: str) -> dict:
    """The numbers of ucx_perftest's ``Final:`` line: iterations, latency 50 %ile,
    average, overall (us), bandwidth average, overall (MiB/s), rate average, overall."""
    line = next((ln for ln in out.splitlines() if ln.startswith("Final:")), None)
    if line is None:
        raise ValueError(f"no Final line in: {out[-800:]}")
    f = [float(v) for v in line.split()[1:]]
    if len(f) != 8:
        raise ValueError(f"a Final line of {len(f)} numbers, not 8: {line}")
    return {"iters": f[0], "lat_p50_us": f[1], "lat_avg_us": f[2],
            "gb_per_s": f[4] * MB / 1e9, "msgs_per_s": f[6]}


def one_sided(cfg: dict) -> dict:
    """bench/rmem_bench.py's ucx peer: ``ucp_get`` (read) and ``ucp_put_bw`` (write) of
    each size, ``ucp_put_bw`` of 8 B for the batched rate, ``reps`` runs each, in the
    shape of its Python peers' results: seconds per operation (1 / the Final line's
    overall rate; UCX keeps operations in flight, a ``ch.read`` waits for each), and
    seconds per ``batch`` 8 B puts. ucx_perftest allocates its buffers through UCX, so
    on ``posix`` a put or get is a copy into or from a shared mapping."""
    t, reps = cfg.get("timeout", 120.0), cfg["reps"]

    def per_op(test: str, size: int, iters: int) -> list[float]:
        return [1 / final(test, size, iters, t, warmup=max(1, iters // 10))["msgs_per_s"]
                for _ in range(reps)]

    res: dict = {"tool": "ucx_perftest, UCX_TLS=posix,self", "sizes": {}}
    for n in cfg["sizes"]:
        iters = max(64, cfg["bytes_per_rep"] // n)
        res["sizes"][str(n)] = {"read_s": per_op("ucp_get", n, iters),
                                "write_s": per_op("ucp_put_bw", n, iters)}
    res["writes8_s"] = [cfg["batch"] * s for s in per_op("ucp_put_bw", 8, 1_000_000)]
    return res


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if shutil.which("ucx_perftest") is None:
        raise SystemExit("ucx_perftest not found: apt-get install ucx-utils (bench/setup.sh)")
    quick = cfg.get("rate_seconds", 0.5) < 0.3
    scale = 1 if quick else 4
    t = cfg["timeout"] / 8
    res: dict = {"latency": {}, "rate": {}, "tool": "ucx_perftest, UCX_TLS=posix,self"}
    for s in cfg["lat_sizes"]:
        r = final("ucp_am_lat", s, 50_000 * scale if s <= 4096 else 10_000 * scale, t)
        res["latency"][str(s)] = {"median_us": r["lat_p50_us"], "mean_us": r["lat_avg_us"]}
    runs = cfg.get("rate_runs", 3)

    def median_of(test: str, size: int, iters: int, key: str) -> float:
        vals = sorted(final(test, size, iters, t)[key] for _ in range(runs))
        return vals[len(vals) // 2]

    res["rate_stream"] = {"msgs_per_s": median_of("ucp_am_bw", 8, 500_000 * scale, "msgs_per_s")}
    res["put_rate"] = {"msgs_per_s": median_of("ucp_put_bw", 8, 1_000_000 * scale, "msgs_per_s")}
    res["bw"] = {"gb_per_s": median_of("ucp_am_bw", cfg["bw_size"], 5_000 * scale, "gb_per_s")}
    res["put_bw"] = {"gb_per_s": median_of("ucp_put_bw", cfg["bw_size"], 5_000 * scale,
                                           "gb_per_s")}
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
