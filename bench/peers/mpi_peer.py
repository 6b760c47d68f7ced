"""mpi4py on MPICH shared memory -- the "spinning" peer rdmamw must match or beat.

Usage (started by bench/run.py): mpiexec -n 2 python mpi_peer.py CONFIG_JSON.
Rank 1 serves (echo / count), rank 0 drives every phase and prints the result.
Only buffer-based (uppercase) calls on page-aligned numpy buffers are timed; control
uses the pickle-based lowercase calls outside the timed regions. A batch of k is k
Isend then Waitall, as an MPI user would write it; the receiver pre-posts k
persistent receives (Recv_init, Startall/Waitall), MPI's cheapest receive path.
"""

from __future__ import annotations

import time

from common import aligned, emit, latency_summary, load_config, pin, rate_summary, run_phases
from mpi4py import MPI

DATA, STOP_TAG = 1, 2


def serve(comm, cfg: dict) -> None:
    """Rank 1: obey commands from rank 0 until told to stop."""
    status = MPI.Status()
    while True:
        cmd = comm.recv(source=0, tag=0)
        op = cmd["op"]
        if op == "done":
            break
        size = cmd["size"]
        if op == "lat":
            buf = aligned(size)
            comm.send("ready", dest=0, tag=0)
            recv, send = comm.Recv, comm.Send
            while True:
                recv(buf, 0, MPI.ANY_TAG, status)
                if status.Get_tag() == STOP_TAG:
                    break
                send(buf, 0, DATA)
        elif op == "stream":
            k = cmd["batch"]
            buf = aligned(size * k)
            flag = memoryview(buf)
            reqs = [comm.Recv_init(buf[i * size : (i + 1) * size], 0, DATA) for i in range(k)]
            comm.send("ready", dest=0, tag=0)
            startall, waitall = MPI.Prequest.Startall, MPI.Request.Waitall
            batches = 0
            while True:
                startall(reqs)
                waitall(reqs)
                if flag[0]:  # the sender's stop batch has its first byte set
                    break
                batches += 1
            for r in reqs:
                r.Free()
            comm.send({"count": batches * k}, dest=0, tag=0)


def ping_pong(comm, size: int, cfg: dict) -> dict:
    """Time-bounded Send/Recv ping-pong; every round trip is stamped."""
    sbuf, rbuf = aligned(size), aligned(size)
    comm.send({"op": "lat", "size": size}, dest=1, tag=0)
    comm.recv(source=1, tag=0)
    stamps: list[int] = []
    append = stamps.append
    clock = time.perf_counter_ns
    t = clock()
    append(t)
    deadline = t + int((cfg["lat_warmup_seconds"] + cfg["lat_seconds"]) * 1e9)
    left = cfg["lat_max_iters"]
    send, recv = comm.Send, comm.Recv
    while t < deadline and left:
        send(sbuf, 1, DATA)
        recv(rbuf, 1, DATA)
        t = clock()
        append(t)
        left -= 1
    comm.Send(aligned(1), 1, STOP_TAG)
    return latency_summary(stamps, int(cfg["lat_warmup_seconds"] * 1e9))


def stream_once(comm, size: int, k: int, seconds: float) -> dict:
    """Stream batches of k (Isend x k + Waitall) for `seconds`, then one stop batch."""
    data, stop = aligned(size * k), aligned(size * k, fill=1)
    views = [data[i * size : (i + 1) * size] for i in range(k)]
    stops = [stop[i * size : (i + 1) * size] for i in range(k)]
    comm.send({"op": "stream", "size": size, "batch": k}, dest=1, tag=0)
    comm.recv(source=1, tag=0)
    isend, waitall = comm.Isend, MPI.Request.Waitall
    clock = time.perf_counter
    t0 = clock()
    deadline = t0 + seconds
    sent = 0
    while True:
        waitall([isend(v, 1, DATA) for v in views])
        sent += k
        if clock() >= deadline:
            break
    waitall([isend(v, 1, DATA) for v in stops])
    count = comm.recv(source=1, tag=0)["count"]
    return {"messages": count, "sent": sent, "seconds": clock() - t0}


def stream(comm, size: int, k: int, runs: int, seconds: float) -> dict:
    """One discarded warm-up run, then `runs` measured runs."""
    stream_once(comm, size, k, min(seconds, 0.1))
    return rate_summary([stream_once(comm, size, k, seconds) for _ in range(runs)], size)


def drive(comm, cfg: dict) -> None:
    """Rank 0: run the phases and print the result."""
    out: dict = {
        "system": "mpi4py",
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "batch_semantics": "k Isend + Waitall; receiver k persistent Recv_init + Startall/Waitall",
    }
    out.update(run_phases(cfg, lambda size: ping_pong(comm, size, cfg),
                          lambda *a: stream(comm, *a)))
    comm.send({"op": "done"}, dest=1, tag=0)
    emit(out)


def main() -> None:
    """Entry point: pin rank r to core r, then serve (rank 1) or drive (rank 0)."""
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise SystemExit("mpi_peer.py needs exactly 2 ranks (mpiexec -n 2)")
    cfg = load_config()
    rank = comm.Get_rank()
    pin(rank)
    comm.Barrier()
    (drive if rank == 0 else serve)(comm, cfg)
    comm.Barrier()


if __name__ == "__main__":
    main()
