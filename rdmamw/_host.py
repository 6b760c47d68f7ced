"""Which host this process is on, as the bootstrap and the providers judge it."""

from __future__ import annotations

import os
from typing import Any


def host_key() -> str:
    """Equal for two processes exactly when they share a kernel boot and a network
    namespace: what the bootstrap descriptor's ``host`` carries (shm works between two
    such processes; the collectives group ranks by it)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rfind(b")") + 2:].decode("ascii", "replace").split()


def state(pid: int | str) -> str | None:
    """Process ``pid``'s state letter (/proc/PID/stat: R, S, D, T, t, Z...), None when
    there is no such process."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_key() -> str:
    """This process's pid namespace and start time (clock ticks after boot): with the
    pid and :func:`host_key`, what tells a process that ended from a new one given its
    pid (the bootstrap descriptor's ``proc``)."""
    fields = _stat_fields("self") or []
    start = fields[19] if len(fields) > 19 else "0"
    return f"{proc_ns()}:{start}"


def ended(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why the process ``theirs`` describes (a bootstrap descriptor) has certainly
    ended, seen from the process ``mine`` describes; None when it has not or when
    nothing here can tell (another host or pid namespace, a descriptor without the
    fields): then only a deadline decides."""
    local = _local(mine, theirs)
    if local is None:
        return None
    pid, start = local
    fields = _stat_fields(pid)
    if fields is None:
        return f"its process {pid} ended"
    if len(fields) > 19 and fields[19] != start:
        return f"its process {pid} ended (the pid now names another)"
    if fields and fields[0] in ("Z", "X"):
        return f"its process {pid} ended (killed or exited, not yet reaped)"
    return None


def stopped(mine: dict[str, Any], theirs: dict[str, Any]) -> bool | None:
    """Whether the process ``theirs`` describes is stopped (SIGSTOP, a debugger's
    stop): True; running or sleeping, however starved of CPU: False; None when nothing
    here can tell (another host or pid namespace, a descriptor without the fields,
    the process ended). A member past its deadline asks it before it names a rank
    that said nothing (rdmamw/collectives/revoke.py)."""
    local = _local(mine, theirs)
    if local is None:
        return None
    fields = _stat_fields(local[0])
    if fields is None or len(fields) <= 19 or fields[19] != local[1] or \
            fields[0] in ("Z", "X"):
        return None
    return fields[0] in ("T", "t")


def _local(mine: dict[str, Any], theirs: dict[str, Any]) -> tuple[int, str] | None:
    """(pid, start time) of the process ``theirs`` describes when it is of this host
    and pid namespace (its pid means the same here), else None."""
    host, proc, pid = theirs.get("host"), theirs.get("proc"), theirs.get("pid")
    if not isinstance(host, str) or host != mine.get("host") or not isinstance(proc, str):
        return None
    ns, _, start = proc.partition(":")
    if ns != proc_ns() or type(pid) is not int or pid <= 0 or not start.isdigit():
        return None
    return pid, start


def proc_ns() -> str:
    """This process's pid namespace (the first part of :func:`process_key`)."""
    return str(os.stat("/proc/self/ns/pid").st_ino)
