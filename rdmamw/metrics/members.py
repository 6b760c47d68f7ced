"""Who takes part in a host's endpoint (RDMAMW_METRICS_HOST_PORT): one file per
process in a directory of the host's temporary files named after the port and the
user, saying where that process's own endpoint answers (a loopback port) and its
rank. A process removes its file when it stops; one that died leaves it, and whoever
reads the directory next finds it gone (its pid ended, or is another process now)
and marks it so: it is out of the metrics at once, and named as gone by the health
answer for :data:`GONE_KEEP` seconds, then forgotten."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass

from rdmamw import _host

#: seconds a process found dead is still named (as gone) by the host's health answer
GONE_KEEP = 600.0


def directory(port: int) -> str:
    """The directory of the host's endpoint at ``port`` (this user's: mode 0700)."""
    d = os.path.join(tempfile.gettempdir(), f"rdmamw-metrics-{os.getuid()}-{port}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None if
    there is no such process or it is a zombie: a pid reused by another process
    starts at another time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()   # after the command, which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): alive, not answering."""
    return _host.state(pid) in ("T", "t")


@dataclass
class Member:
    """One process of the host's endpoint: its pid, rank ("" before rdmamw.init()),
    the URL of its own endpoint, and, once found dead, when (time.time())."""

    pid: int
    rank: str
    url: str
    start: str | None = None
    gone: float | None = None

    @property
    def name(self) -> str:
        """Its rank, or ``pid<N>`` for a process outside a job (as RDMAMW_TRACE's %r)."""
        return self.rank or f"pid{self.pid}"


def join(port: int, url: str, rank: str) -> str:
    """This process takes part in the host's endpoint at ``port``: returns its file."""
    pid = os.getpid()
    path = os.path.join(directory(port), f"{pid}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": pid, "rank": rank, "url": url, "start": started(pid)}, f)
    os.replace(tmp, path)       # whole or absent for a reader
    return path


def leave(path: str) -> None:
    """Remove a process's file (and its socket, rdmamw/metrics/host.py's)."""
    for p in (path, path.removesuffix(".json") + ".sock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def members(port: int) -> list[Member]:
    """The processes of the host's endpoint at ``port``, the ones alive and the ones
    found dead less than GONE_KEEP s ago; finds the dead (and forgets the old dead)."""
    d, now = directory(port), time.time()
    out = []
    for name in sorted(os.listdir(d)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(d, name)
        try:
            with open(path) as f:
                m = Member(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue        # removed meanwhile, or not ours
        if m.gone is None and started(m.pid) != m.start:
            m.gone = now
            _rewrite(path, m)
        if m.gone is not None and now - m.gone > GONE_KEEP:
            leave(path)
            continue
        out.append(m)
    return out


def _rewrite(path: str, m: Member) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(m.__dict__, f)
        os.replace(tmp, path)
    except OSError:
        pass
