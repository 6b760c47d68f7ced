"""A minimal local launcher: ``python -m rdmamw.bootstrap.launch -n N -- CMD ...``
starts N processes of CMD with torchrun-style variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and a shared RDMAMW_TOKEN that it generates
when none is set, so the job authenticates without a token file. If one rank fails,
the others are stopped; the exit code is the first failure's. ``--max-lost K`` lets a
job go on without up to K failed ranks (docs/collectives.md, "When a rank fails"):
those are reported on stderr and the others run on; the exit code is 0 when every other
rank returns 0, and a further failure stops the job as above."""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from rdmamw import config


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def job_env(rank: int, n: int, addr: str, port: int, token: str,
            extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any launcher's variables (a launcher around
    us may have set them: config.without_launchers), plus rank ``rank``'s torchrun-style
    ones, the job's token and ``extra``."""
    env = config.without_launchers()
    env.update(extra or {})
    env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=addr, MASTER_PORT=str(port),
               RDMAMW_TOKEN=token)
    return env


def spawn(n: int, cmd: Sequence[str], env: dict[str, str] | None = None,
          addr: str = "127.0.0.1", **popen) -> list[subprocess.Popen]:
    """Start ``cmd`` as ranks 0..n-1 of a new job and return the processes (stdout and
    stderr as ``popen`` says); ``env`` is added to each rank's environment."""
    token = config.get("RDMAMW_TOKEN") or secrets.token_hex(32)
    port = free_port(addr)
    return [subprocess.Popen(list(cmd), env=job_env(r, n, addr, port, token, env), **popen)
            for r in range(n)]


def run(cmd: list[str], n: int, addr: str = "127.0.0.1", port: int = 0,
        max_lost: int = 0) -> int:
    """Run the job; return its exit code (the first failure beyond ``max_lost``)."""
    if port:
        token = config.get("RDMAMW_TOKEN") or secrets.token_hex(32)
        procs = [subprocess.Popen(cmd, env=job_env(r, n, addr, port, token)) for r in range(n)]
    else:
        procs = spawn(n, cmd, addr=addr)
    rank = {p.pid: r for r, p in enumerate(procs)}
    code, lost = 0, 0
    try:
        while procs:
            for p in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove(p)
                if rc == 0 or code != 0:
                    continue
                if lost < max_lost:
                    lost += 1
                    print(f"[launch] rank {rank[p.pid]} failed ({_why(rc)}); the other "
                          f"{len(procs)} go on ({lost} of --max-lost {max_lost})",
                          file=sys.stderr, flush=True)
                    continue
                code = rc
                for q in procs:
                    q.send_signal(signal.SIGTERM)
            time.sleep(0.02)
    finally:
        for p in procs:
            p.kill()
    return code


def _why(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rdmamw.bootstrap.launch",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=0, help="0: a free port")
    ap.add_argument("--max-lost", type=int, default=0, metavar="K",
                    help="let the others run on when up to K ranks fail (default 0: one "
                         "failure stops the job)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd or args.nproc < 1:
        ap.error("need -n N and a command after --")
    if not 0 <= args.max_lost < args.nproc:
        ap.error(f"--max-lost must be 0 .. {args.nproc - 1}, not {args.max_lost}")
    sys.exit(run(cmd, args.nproc, args.master_addr, args.master_port, args.max_lost))


if __name__ == "__main__":
    main()
