"""The counting half of bench/connections.py: what one process holds (read from /proc and
from iproute2's ``rdma resource show``), and the medians over the ranks of a job. Pure
functions of text and rows, so tests/unit/test_connections_bench.py checks them on the host."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
from pathlib import Path

from rdmamw.memory.units import human

#: /proc/self/status fields, in KiB
STATUS_KEYS = {"VmSize": "vm_kib", "VmRSS": "rss_kib", "VmPin": "pin_kib", "VmLck": "lck_kib"}
#: the objects of this pid that `rdma resource show KIND` lists
RDMA_KINDS = ("qp", "cq", "pd", "mr")
#: the rows of the table: (key, label, divisor to the unit shown)
METRICS = (
    ("uverbs_fds", "RDMA device contexts (uverbs fds)", 1),
    ("ib_event_fds", "infiniband event fds (async + completion channels)", 1),
    ("fds", "all fds", 1),
    ("threads", "threads", 1),
    ("qp", "QPs (job / ranks)", 1),
    ("cq", "CQs (job / ranks)", 1),
    ("pd", "PDs (job / ranks)", 1),
    ("mr", "MRs (job / ranks)", 1),
    ("pin_kib", "pinned, VmPin (KiB)", 1),
    ("lck_kib", "locked, VmLck (KiB)", 1),
    ("vm_kib", "VmSize (MiB)", 1024),
    ("rss_kib", "RSS (MiB)", 1024),
)
_UVERBS = re.compile(r"^/dev/infiniband/uverbs\d+$")


def parse_status(text: str) -> dict[str, int]:
    """The KiB figures of STATUS_KEYS from the text of /proc/PID/status (0 when a kernel
    does not report one)."""
    out = dict.fromkeys(STATUS_KEYS.values(), 0)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_KEYS and value.split():
            out[STATUS_KEYS[key]] = int(value.split()[0])
    return out


def classify_fds(targets: list[str]) -> dict[str, int]:
    """All fds, the uverbs device fds (one per device context) and the anon inodes of
    infiniband events (each context's async event fd and each completion channel), from
    the link targets of /proc/PID/fd."""
    return {"fds": len(targets),
            "uverbs_fds": sum(1 for t in targets if _UVERBS.match(t)),
            "ib_event_fds": sum(1 for t in targets
                                if t.startswith("anon_inode:") and "infiniband" in t)}


def fd_targets(pid: str | int = "self") -> list[str]:
    base = f"/proc/{pid}/fd"
    out = []
    for name in os.listdir(base):
        try:
            out.append(os.readlink(f"{base}/{name}"))
        except OSError:             # closed meanwhile (the listdir's own fd)
            pass
    return out


def parse_rdma_json(text: str) -> list[dict]:
    """The objects of `rdma -j resource show KIND`: one JSON array (iproute2 6.x), or
    one array per device / per line (older versions); empty output is no objects."""
    dec = json.JSONDecoder()
    out: list[dict] = []
    i, text = 0, text.strip()
    while i < len(text):
        value, i = dec.raw_decode(text, i)
        out.extend(value if isinstance(value, list) else [value])
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def count_for_pid(objects: list[dict], pids: set[int]) -> int:
    """How many of the listed objects belong to one of ``pids`` (the threads of a
    process; the kernel's own, such as the GSI QP, carry no pid)."""
    return sum(1 for o in objects if o.get("pid") in pids)


def count_user(objects: list[dict]) -> int:
    """How many of the listed objects user space made: the kernel names its own
    (``comm`` without a pid); the kernel reports the pid of the *thread* that made an
    object and drops it once that thread has exited (an accepting side's handshake
    thread), so those have neither."""
    return sum(1 for o in objects if "pid" in o or "comm" not in o)


#: how long one `rdma resource show KIND` may take: a 64-rank job has ~38,000 MRs, which
#: iproute2 lists in about a minute under TCG
RDMA_TIMEOUT = 900


def rdma_counts(pids: set[int], run=None) -> tuple[dict[str, int | None], str | None]:
    """For each of QPs, CQs, PDs and MRs: ``KIND_own``, those made by a live thread of
    ``pids``, and ``KIND_job``, all user-made ones on the host's devices (in the VM:
    the job's); (None for each, why) when iproute2's ``rdma`` is missing or refuses."""
    counts: dict[str, int | None] = {}
    nothing = {f"{k}_{w}": None for k in RDMA_KINDS for w in ("own", "job")}
    run = run or subprocess.run
    for kind in RDMA_KINDS:
        try:
            p = run(["rdma", "-j", "resource", "show", kind], capture_output=True,
                    text=True, timeout=RDMA_TIMEOUT)
        except (OSError, subprocess.SubprocessError) as e:
            return nothing, f"rdma resource show {kind}: {e}"
        if p.returncode != 0:
            why = (p.stderr or p.stdout).strip()[:200]
            return nothing, f"rdma resource show {kind}: {why}"
        objs = parse_rdma_json(p.stdout)
        counts[f"{kind}_own"] = count_for_pid(objs, pids)
        counts[f"{kind}_job"] = count_user(objs)
    return counts, None


def snapshot(world: int, rdma: bool = True, counter: bool = True) -> dict:
    """What this process holds now: the status figures, fds, threads and (``rdma``) the
    QPs, CQs, PDs and MRs: ``qp`` etc. are the job's user-made objects / ``world`` (the
    kernel cannot tell which process made an object whose thread has exited; all ranks
    measure between the same barriers); ``rdma_error`` says why they are None. Those
    are the same for every rank, so only one rank (``counter``) asks the tool: the
    others' are None, with no error (64 ranks listing ~38,000 MRs at once under TCG
    took minutes each)."""
    snap: dict = parse_status(Path("/proc/self/status").read_text())
    snap.update(classify_fds(fd_targets()))
    tids = {int(t) for t in os.listdir("/proc/self/task")}
    snap["threads"] = len(tids)
    nothing = {f"{k}_{w}": None for k in RDMA_KINDS for w in ("own", "job")}
    if not rdma:
        counts, why = nothing, "not asked (--no-rdma-tool)"
    elif not counter:
        counts, why = nothing, None
    else:
        counts, why = rdma_counts(tids)
    snap.update(counts)
    for kind in RDMA_KINDS:
        job = counts[f"{kind}_job"]
        snap[kind] = None if job is None else job / world
    snap["rdma_error"] = why
    return snap


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _diff(a, b):
    return None if a is None or b is None else b - a


def summarize(rows: list[dict], n: int) -> dict:
    """Medians over the ranks of one job: each metric per rank before the mesh (after
    init), after it, per peer ((after - before) / (n - 1)), and what the rendezvous round
    (one array to every peer) added per rank and per peer; the slowest rank's connect."""
    peers = n - 1
    out: dict = {"ranks": n, "metrics": {}}
    for key, _, _ in METRICS:
        def phase(name: str, key: str = key) -> float | None:
            return _median([r["snap"][name].get(key) for r in rows])
        mesh = [_diff(r["snap"]["before"].get(key), r["snap"]["mesh"].get(key)) for r in rows]
        rndv = [_diff(r["snap"]["mesh"].get(key), r["snap"]["rndv"].get(key)) for r in rows]
        out["metrics"][key] = {
            "before": phase("before"), "after": phase("mesh"),
            "per_peer": _median([None if d is None else d / peers for d in mesh]),
            "rndv_per_rank": _median(rndv),
            "rndv_per_peer": _median([None if d is None else d / peers for d in rndv]),
            "after_rndv_done": phase("done")}
    out["connect_s_slowest"] = max(r["connect_s"] for r in rows)
    out["connect_s_median"] = statistics.median(r["connect_s"] for r in rows)
    out["rndv_s_slowest"] = max(r["rndv_s"] for r in rows)
    out["rdma_error"] = next((r["snap"]["mesh"]["rdma_error"] for r in rows
                              if r["snap"]["mesh"].get("rdma_error")), None)
    return out


def _fmt(v: float | None, div: int) -> str:
    if v is None:
        return "n/a"
    v = v / div
    if v == int(v) and abs(v) >= 1 or v == 0:
        return f"{int(v):,}"
    return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"


def _array(summary: dict) -> str:
    """The array the job sent to every peer, as the heading names it (runs written before
    ``--array-bytes`` existed sent 4 MiB)."""
    return human(summary.get("array_bytes", 4 << 20))


def table(summary: dict) -> str:
    """The job's medians as a markdown table, one row a metric."""
    head = ("| metric (median over ranks) | per rank, before | per rank, after mesh "
            f"| per peer | {_array(summary)} to every peer: per rank | per peer |")
    lines = [head, "|---|---|---|---|---|---|"]
    for key, label, div in METRICS:
        m = summary["metrics"][key]
        lines.append(f"| {label} | " + " | ".join(
            _fmt(m[c], div) for c in ("before", "after", "per_peer", "rndv_per_rank",
                                      "rndv_per_peer")) + " |")
    return "\n".join(lines)


def compare_table(labelled: list[tuple[str, dict]]) -> str:
    """Summaries of one job size from several runs (``[(label, summary), ...]``, e.g.
    before and after a change) side by side: per rank after the mesh and per peer for
    each, then what the array to every peer added per peer; the slowest connect last."""
    head = "| metric (median over ranks) | " + " | ".join(
        f"{lab}: per rank | {lab}: per peer | {lab}: +{_array(s)} to all, per peer"
        for lab, s in labelled) + " |"
    lines = [head, "|---|" + "---|---|---|" * len(labelled)]
    for key, label, div in METRICS:
        cells = []
        for _, s in labelled:
            m = s["metrics"][key]
            cells += [_fmt(m["after"], div), _fmt(m["per_peer"], div),
                      _fmt(m["rndv_per_peer"], div)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| connect, slowest rank (s) | " + " | ".join(
        f"{s['connect_s_slowest']:.2f} | | " for _, s in labelled) + " |")
    return "\n".join(lines).replace("|  |", "| |")
