"""What one more connection costs: jobs of N ranks open channels all-to-all and report,
per process and per peer, what the channels hold: RDMA device contexts, infiniband event
fds, all fds, threads, QPs, CQs, PDs and MRs of the process, pinned and locked bytes,
virtual size, resident memory; the connect time of the slowest rank; and what one numpy
array (``--array-bytes``, 4 MiB by default) sent to every peer (rendezvous) adds.

    python bench/connections.py                      # N = 8, 32, 64 on the default provider
    python bench/connections.py --ranks 2,8,16 --provider verbs --json out.json
    python bench/connections.py --ranks 64 --array-bytes 256K   # 63 arrays held must fit

Every rank calls ``rdmamw.init()``, measures itself (``before``), opens
``Channel.open(r)`` to every other rank (both sides open, as the API says), trades one
message on each channel (so the rings are really wired), measures again (``mesh``),
sends the same array to every peer and receives theirs, measures (``rndv``, the
received arrays and the send handles still held), waits for its sends, drops the arrays,
measures (``done``) and prints one JSON line; all ranks measure between the same
barriers (one message each way on every channel). Per job the table gives the median over ranks of
each figure before and after the mesh, per peer ((after - before) / (N - 1)), and what
the array round added (per rank, and per peer). The counting is bench/conncost.py:
/proc/self/status (VmSize, VmRSS, VmPin, VmLck), the link targets of /proc/self/fd
(``/dev/infiniband/uverbsN`` = one device context; ``anon_inode:[infinibandevent]`` =
a context's async event fd or a completion channel), /proc/self/task, and iproute2's
``rdma -j resource show qp|cq|pd|mr``: the kernel names the *thread* that made an object
and forgets it when that thread exits (a listener's handshake thread), so the table
gives the job's user-made objects / N, in the VM where the job is alone on the device
(rank 0 alone asks the tool, since those figures are the job's; its JSON also has
``KIND_own``, those of its live threads). ``n/a`` when the tool is missing or refuses
(the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import conncost  # noqa: E402

from rdmamw.config import parse_bytes  # noqa: E402

ARRAY_BYTES = 4 << 20          # default of --array-bytes


def sync(chans: dict, tag: bytes, timeout: float) -> None:
    """One message each way on every channel: when it returns, every rank has finished
    what it did before calling (a barrier; the job-wide counts of QPs etc. need all
    ranks between the same two)."""
    for ch in chans.values():
        ch.send(tag)
    for r, ch in chans.items():
        got = bytes(ch.recv(timeout=timeout))
        assert got == tag, (r, got[:16], tag)


def rank_main(timeout: float, rdma_tool: bool, array_bytes: int) -> None:
    import numpy as np

    import rdmamw
    w = rdmamw.init(timeout=timeout)
    n = w.world_size

    def snapshot() -> dict:       # rank 0 counts the job's QPs, CQs, PDs and MRs
        return conncost.snapshot(n, rdma_tool, counter=w.rank == 0)

    snap = {"before": snapshot()}
    t0 = time.monotonic()
    chans = {r: rdmamw.Channel.open(r, timeout=timeout) for r in range(n) if r != w.rank}
    connect_s = time.monotonic() - t0
    sync(chans, b"x", timeout)          # my channels are wired both ways
    sync(chans, b"mesh", timeout)       # everybody's are
    snap["mesh"] = snapshot()
    sync(chans, b"measured", timeout)
    t0 = time.monotonic()
    x = np.full(array_bytes, w.rank & 0xFF, dtype=np.uint8)   # one array to every peer
    handles = [ch.send(x) for ch in chans.values()]
    got = {r: ch.recv(timeout=timeout) for r, ch in chans.items()}
    for r, m in got.items():
        a = np.frombuffer(m, np.uint8)
        assert a.size == array_bytes and a[0] == a[-1] == r & 0xFF, (r, a.size)
    rndv_s = time.monotonic() - t0
    sync(chans, b"received", timeout)
    snap["rndv"] = snapshot()      # arrays and send handles held
    sync(chans, b"measured", timeout)
    for h in handles:
        h.wait(timeout)
    del got, handles
    sync(chans, b"done", timeout)
    snap["done"] = snapshot()
    sync(chans, b"bye", timeout)        # nobody closes while a peer still counts
    some = next(iter(chans.values()))
    print(json.dumps({"rank": w.rank, "pid": os.getpid(), "snap": snap,
                      "connect_s": connect_s, "rndv_s": rndv_s,
                      "provider": some.peer.partition("://")[0],
                      "ring_bytes": some.nslots * some.slot_size,
                      "array_bytes": array_bytes,
                      "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]}),
          flush=True)
    for ch in chans.values():
        ch.close()


def run_job(n: int, provider: str | None, timeout: float, rdma_tool: bool,
            array_bytes: int = ARRAY_BYTES) -> list[dict]:
    """Start the job as the project's launcher does (``spawn``'s environment); each rank's
    output goes to its own file (a full pipe must not stall a rank while another is read)."""
    import secrets

    from rdmamw.bootstrap.launch import free_port, job_env
    env = {"RDMAMW_PROVIDER": provider} if provider else {}
    args = [sys.executable, __file__, "--rank", "--timeout", str(timeout),
            "--array-bytes", str(array_bytes)]
    if not rdma_tool:
        args.append("--no-rdma-tool")
    port, token = free_port(), secrets.token_hex(32)
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        files = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+"))
                 for r in range(n)]
        try:
            for r, (fo, fe) in enumerate(files):
                procs.append(subprocess.Popen(
                    args, env=job_env(r, n, "127.0.0.1", port, token, env),
                    stdin=subprocess.DEVNULL, stdout=fo, stderr=fe))
            deadline = time.monotonic() + 3 * timeout
            for r, p in enumerate(procs):
                rc = p.wait(max(1.0, deadline - time.monotonic()))
                if rc != 0:
                    files[r][1].seek(0)
                    raise SystemExit(f"rank {r} failed ({rc}):\n{files[r][1].read()[-3000:]}")
            out = []
            for fo, _ in files:
                fo.seek(0)
                out.append(json.loads(fo.read().strip().splitlines()[-1]))
            return out
        finally:
            for p in procs:
                p.kill()
                p.wait()
            for fo, fe in files:
                fo.close(), fe.close()


def compare(specs: list[str]) -> None:
    runs = []
    for spec in specs:
        label, _, path = spec.rpartition("=")
        runs.append((label or Path(path).stem, {r["summary"]["ranks"]: r["summary"]
                                                for r in json.loads(Path(path).read_text())}))
    for n in sorted({n for _, by_n in runs for n in by_n}):
        have = [(label, by_n[n]) for label, by_n in runs if n in by_n]
        print(f"\n{n} ranks, {have[0][1]['provider']}:")
        print(conncost.compare_table(have))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="8,32,64", help="job sizes (default 8,32,64)")
    ap.add_argument("--provider", default=None,
                    help="force one (RDMAMW_PROVIDER); default: the automatic choice")
    ap.add_argument("--timeout", type=float, default=300,
                    help="init, connect and receive timeout of each rank, s (default 300)")
    ap.add_argument("--no-rdma-tool", action="store_true",
                    help="do not run iproute2's rdma (QPs, CQs, PDs, MRs are then n/a)")
    ap.add_argument("--array-bytes", type=parse_bytes, default=ARRAY_BYTES,
                    help="the array each rank sends to every peer (default 4M); a rank "
                         "holds N - 1 of them at once, so large jobs want less")
    ap.add_argument("--json", default=None, help="write the summaries and raw rows here")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=FILE.json",
                    help="run nothing: print the --json files of earlier runs side by "
                         "side, one table per job size (e.g. before=a.json after=b.json)")
    a = ap.parse_args()
    if a.rank:
        rank_main(a.timeout, not a.no_rdma_tool, a.array_bytes)
        return
    if a.compare:
        compare(a.compare)
        return
    results = []
    for n in (int(x) for x in a.ranks.split(",")):
        t0 = time.monotonic()
        rows = sorted(run_job(n, a.provider, a.timeout, not a.no_rdma_tool, a.array_bytes),
                      key=lambda r: r["rank"])
        s = conncost.summarize(rows, n)
        s.update(provider=rows[0]["provider"], ring_bytes=rows[0]["ring_bytes"],
                 array_bytes=rows[0]["array_bytes"],
                 memlock=rows[0]["memlock"], job_s=time.monotonic() - t0)
        results.append({"summary": s, "rows": rows})
        lim = "unlimited" if s["memlock"] == resource.RLIM_INFINITY else s["memlock"]
        print(f"\n{n} ranks, {s['provider']} (ring {s['ring_bytes']:,} B, ulimit -l {lim}): "
              f"connect {s['connect_s_slowest']:.2f} s (slowest rank; median "
              f"{s['connect_s_median']:.2f} s), array round {s['rndv_s_slowest']:.2f} s, "
              f"whole job {s['job_s']:.1f} s", flush=True)
        if s["rdma_error"]:
            print(f"QPs, CQs, PDs, MRs not counted: {s['rdma_error']}")
        print(conncost.table(s), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
