"""One command for the rdmamw benchmark against its peers on this machine.

Runs, in one go and with the two processes of every pair pinned to the two cores:
ping-pong one-way latency (8 B, 4 KiB, 64 KiB), 8 B message rate with batches of
1/16/256, 64 KiB streaming bandwidth, the rdmamw idle-receiver CPU, and single-thread
numpy.copyto as the memory limit. Systems: rdmamw batched (and "many": the same
channel by send_many / recv_many_into, rate and bandwidth), rdmamw ack, pyzmq ipc://,
mpi4py on MPICH, UCX's own C benchmark (ucx_perftest over posix shm), ucxx (UCX's
Python binding, its asyncio API on host memory, in bench/setup.sh's .venv-ucxx), memcpy. Prints
one table with ratios and the project's target checks, and writes the raw results as
JSON into bench/results/.

    python bench/run.py                    # full run, about 80 s of measuring
    python bench/run.py --quick            # smoke run, about 25 s
    python bench/run.py --only batched,mpi4py
    python bench/run.py --wait-quiet 120   # on a shared box: wait for other load first

Other processes on the two cores distort every number here; the CPU they used during
each system's run is recorded in the JSON and flagged under the table.

Prerequisites: bash bench/setup.sh .venv/bin/python (MPICH, mpi4py, ucx-utils, pyzmq,
rich).
Timings live here, never in unit tests: they depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
RESULTS = HERE / "results"
SYSTEMS = ("batched", "many", "ack", "zmq", "mpi4py", "ucx", "ucxx", "memcpy")
#: the ucxx venv's Python (bench/setup.sh): ucxx's wheel wants numpy >= 2 and CUDA's
#: Python bindings, kept out of the project's venv
UCXX_PY = os.environ.get("RDMAMW_UCXX_PY", str(HERE.parent / ".venv-ucxx" / "bin" / "python"))

FULL = {
    "lat_sizes": [8, 4096, 65536],
    "lat_seconds": 1.0,
    "lat_warmup_seconds": 0.2,
    "lat_max_iters": 300_000,
    "rate_size": 8,
    "rate_batches": [1, 16, 256],
    "rate_runs": 5,
    "rate_seconds": 0.5,
    "bw_size": 65536,
    "bw_batch": 16,
    "bw_runs": 5,
    "bw_seconds": 0.5,
    "idle_seconds": 5.0,
    "memcpy_sizes": [8, 4096, 65536],
    "memcpy_runs": 5,
    "memcpy_seconds": 0.1,
    "slots": 256,
    "slot_size": 65536,
    "timeout": 150,
}
QUICK = {
    **FULL,
    "lat_seconds": 0.25,
    "lat_warmup_seconds": 0.05,
    "rate_runs": 3,
    "rate_seconds": 0.12,
    "bw_runs": 3,
    "bw_seconds": 0.12,
    "idle_seconds": 2.0,
    "memcpy_runs": 3,
    "memcpy_seconds": 0.03,
    "timeout": 60,
}


# ---- running the peers --------------------------------------------------------------


def cpu_busy(seconds: float = 0.5) -> float:
    """Percent of all cores busy (whoever runs) over `seconds`: flags a loaded machine."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals), idle

    t0, i0 = sample()
    time.sleep(seconds)
    t1, i1 = sample()
    return 100.0 * (1 - (i1 - i0) / max(t1 - t0, 1))


def busy_seconds() -> float:
    """CPU seconds spent non-idle on all cores since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals[:8]) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    """CPU seconds of our finished peer processes (and their children, e.g. under mpiexec)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(limit: float, busy_max: float = 10.0) -> float:
    """Sample other load; poll up to `limit` s for it to drop. Returns the last sample."""
    deadline = time.monotonic() + limit
    busy = cpu_busy(0.3)
    while busy > busy_max and time.monotonic() < deadline:
        busy = cpu_busy(1.0)
    return busy


def finish_report(name: str, meta: dict, cfg: dict, res: dict, lines: list[str],
                  out: Path) -> Path:
    """Flag a loaded machine under the table, print it and write the JSON to
    ``out/NAME-DATE.json``; returns the path."""
    if max(meta["loadavg"][0], meta["loadavg_end"][0]) > 1.5:
        lines.append(f"WARNING: load average {meta['loadavg'][0]:.1f} -> "
                     f"{meta['loadavg_end'][0]:.1f} on {meta['cores']} cores: other jobs "
                     "shared the cores, numbers are noisy")
    print("\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"meta": meta, "config": cfg, "results": res,
                                "table": lines}, indent=1))
    print(f"raw results: {path}")
    return path


def spawn(cmd: list[str]) -> subprocess.Popen:
    """Start a peer in its own process group, so a hung pair can be killed as a unit."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def reap(proc: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """Wait for a peer; on timeout kill its process group (only what we started)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        return out, err, True


def parse(out: str, err: str, rc: int | None, timed_out: bool) -> dict:
    """The peer's RESULT line, or an error record with the tail of its stderr."""
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    why = "timed out" if timed_out else f"exit code {rc}"
    return {"error": f"{why}: {err.strip()[-1500:] or out.strip()[-1500:]}"}


def run_pair(script: str, cfg: dict, py: str = sys.executable) -> dict:
    """Serve with role b, drive with role a (both under ``py``); the result comes from a."""
    arg = json.dumps(cfg)
    b = spawn([py, str(PEERS / script), "b", arg])
    a = spawn([py, str(PEERS / script), "a", arg])
    out, err, timed_out = reap(a, cfg["timeout"])
    res = parse(out, err, a.returncode, timed_out)
    bout, berr, btimed = reap(b, 15 if not timed_out else 1)
    if b.returncode and "error" not in res:
        res["serve_error"] = berr.strip()[-1500:]
    return res


def run_system(name: str, cfg: dict, tmp: str) -> dict:
    """Run one system's peers and return its raw result."""
    phases = ["lat", "rate", "bw"]
    if name in ("batched", "ack"):
        problem = rdmamw_problem()
        if problem:
            return {"error": f"rdmamw API not importable: {problem}", "untested": True}
        unique = f"{os.getpid()}-{name}-{time.monotonic_ns()}"
        c = {**cfg, "address": f"shm://rdmamw-bench-{unique}", "mode": name}
        return run_pair("rdmamw_peer.py", {**c, "phases": phases + ["idle"]})
    if name == "many":      # batched, by send_many / recv_many_into: streams only
        problem = rdmamw_problem()
        if problem:
            return {"error": f"rdmamw API not importable: {problem}", "untested": True}
        unique = f"{os.getpid()}-{name}-{time.monotonic_ns()}"
        return run_pair("rdmamw_peer.py", {**cfg, "address": f"shm://rdmamw-bench-{unique}",
                                           "mode": "batched", "api": "many",
                                           "phases": ["rate", "bw"]})
    if name == "zmq":
        return run_pair("zmq_peer.py", {**cfg, "endpoint": f"ipc://{tmp}/zmq", "phases": phases})
    if name == "ucxx":
        if subprocess.run([UCXX_PY, "-c", "import ucxx"], capture_output=True).returncode:
            return {"error": f"ucxx does not import under {UCXX_PY}: run bash bench/setup.sh",
                    "untested": True}
        with socket.socket() as s:      # a free port for role b's listener
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return run_pair("ucxx_peer.py", {**cfg, "port": port, "phases": phases}, UCXX_PY)
    if name == "mpi4py":
        mpiexec = shutil.which("mpiexec")
        if not mpiexec:
            return {"error": "mpiexec not found: run bash bench/setup.sh", "untested": True}
        arg = json.dumps({**cfg, "phases": phases})
        p = spawn([mpiexec, "-n", "2", sys.executable, str(PEERS / "mpi_peer.py"), arg])
        out, err, timed_out = reap(p, cfg["timeout"])
        return parse(out, err, p.returncode, timed_out)
    if name in ("memcpy", "ucx"):
        script = "memcpy.py" if name == "memcpy" else "ucx_peer.py"
        p = spawn([sys.executable, str(PEERS / script), json.dumps(cfg)])
        out, err, timed_out = reap(p, cfg["timeout"])
        return parse(out, err, p.returncode, timed_out)
    raise ValueError(name)


def rdmamw_problem() -> str | None:
    """None if the rdmamw channel API imports in a fresh interpreter, else the error."""
    probe = "import rdmamw; rdmamw.listen; rdmamw.Channel.open; rdmamw.Timeout"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1]


# ---- reading the results -------------------------------------------------------------


def get(res: dict, *path):
    """Nested lookup that yields None on any missing piece."""
    cur = res
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def metrics(name: str, res: dict) -> dict:
    """Flatten one system's result to the table's rows (None when not applicable)."""
    if "error" in res:
        return {}
    if name == "memcpy":
        sizes = res.get("sizes", {})
        m = {
            f"lat{s}_med": get(sizes, str(s), "ns_per_copy") and sizes[str(s)]["ns_per_copy"] / 1e3
            for s in (8, 4096, 65536)
        }
        m["rate1"] = get(sizes, "8", "copies_per_s")
        m["bw"] = get(sizes, "65536", "gb_per_s")
        m["bw_aliased"] = get(sizes, "65536", "offsets", "aliased_8", "gb_per_s")
        return m
    m = {}
    for s in (8, 4096, 65536):
        m[f"lat{s}_med"] = get(res, "latency", str(s), "median_us")
        m[f"lat{s}_p99"] = get(res, "latency", str(s), "p99_us")
    for k in (1, 16, 256):
        m[f"rate{k}"] = get(res, "rate", str(k), "msgs_per_s")
        m[f"sig{k}"] = get(res, "rate", str(k), "signaled_completions_per_msg")
    m["bw"] = get(res, "bw", "gb_per_s")
    m["idle"] = get(res, "idle", "cpu_percent")
    m["rate_stream"] = get(res, "rate_stream", "msgs_per_s")
    m["put_rate"] = get(res, "put_rate", "msgs_per_s")
    m["put_bw"] = get(res, "put_bw", "gb_per_s")
    return m


# (key, label, unit scale, format); the arrow says which direction is better
ROWS = [
    ("lat8_med", "8 B one-way median [us] \u2193", 1, "{:.2f}"),
    ("lat8_p99", "8 B one-way p99 [us] \u2193", 1, "{:.2f}"),
    ("lat4096_med", "4 KiB one-way median [us] \u2193", 1, "{:.2f}"),
    ("lat4096_p99", "4 KiB one-way p99 [us] \u2193", 1, "{:.2f}"),
    ("lat65536_med", "64 KiB one-way median [us] \u2193", 1, "{:.2f}"),
    ("lat65536_p99", "64 KiB one-way p99 [us] \u2193", 1, "{:.2f}"),
    ("rate1", "8 B rate, batch 1 [M msg/s] \u2191", 1e-6, "{:.3f}"),
    ("rate16", "8 B rate, batch 16 [M msg/s] \u2191", 1e-6, "{:.3f}"),
    ("rate256", "8 B rate, batch 256 [M msg/s] \u2191", 1e-6, "{:.3f}"),
    ("rate_stream", "8 B rate, windowed stream [M msg/s] \u2191", 1e-6, "{:.3f}"),
    ("put_rate", "8 B one-sided put rate [M ops/s] \u2191", 1e-6, "{:.3f}"),
    ("bw", "64 KiB stream [GB/s] \u2191", 1, "{:.2f}"),
    ("put_bw", "64 KiB one-sided put [GB/s] \u2191", 1, "{:.2f}"),
    ("sig1", "signaled compl./msg, batch 1 \u2193", 1, "{:.4f}"),
    ("sig16", "signaled compl./msg, batch 16 \u2193", 1, "{:.4f}"),
    ("sig256", "signaled compl./msg, batch 256 \u2193", 1, "{:.4f}"),
    ("idle", "idle receiver CPU [% core] \u2193", 1, "{:.2f}"),
]
COLUMNS = [
    ("batched", "batched"),
    ("many", "many"),
    ("ack", "ack"),
    ("zmq", "zmq"),
    ("mpi4py", "mpi4py"),
    ("ucx", "ucx"),
    ("ucxx", "ucxx"),
    ("memcpy", "memcpy"),
]
RATIOS = [("ack", "batched/ack"), ("mpi4py", "batched/mpi4py"), ("zmq", "batched/zmq"),
          ("ucx", "batched/ucx"), ("ucxx", "batched/ucxx")]


def ratio(a, b):
    """a / b, or None when either side is missing."""
    return a / b if a is not None and b else None


def targets(m: dict) -> list[dict]:
    """The project's targets, each shown under the table column its value belongs to."""
    b, a, p = m.get("batched", {}), m.get("ack", {}), m.get("mpi4py", {})
    u, many = m.get("ucx", {}), m.get("many", {})

    def row(label, column, value, ok) -> dict:
        verdict = "UNTESTED" if value is None else ("PASS" if ok(value) else "FAIL")
        return {"target": label, "column": column, "value": value, "verdict": verdict}

    return [
        row(
            "target: 8 B rate b256 >= 10x ack",
            "batched/ack",
            ratio(b.get("rate256"), a.get("rate256")),
            lambda v: v >= 10,
        ),
        row(
            "target: 8 B rate b256 >= 10x mpi4py",
            "batched/mpi4py",
            ratio(b.get("rate256"), p.get("rate256")),
            lambda v: v >= 10,
        ),
        row(
            "target: 8 B latency <= mpi4py",
            "batched/mpi4py",
            ratio(b.get("lat8_med"), p.get("lat8_med")),
            lambda v: v <= 1,
        ),
        row(
            "target: 64 KiB stream >= 2x mpi4py",
            "batched/mpi4py",
            ratio(b.get("bw"), p.get("bw")),
            lambda v: v >= 2,
        ),
        row(
            "target: signaled/msg b256 <= ack/64",
            "batched/ack",
            ratio(b.get("sig256"), a.get("sig256")),
            lambda v: v <= 1 / 64,
        ),
        row(
            "target: 8 B rate b256 >= UCX put rate",
            "batched/ucx",
            ratio(b.get("rate256"), u.get("put_rate")),
            lambda v: v >= 1,
        ),
        row(
            "target: 8 B rate b256 send_many / UCX put >= 1",
            "many",
            ratio(many.get("rate256"), u.get("put_rate")),
            lambda v: v >= 1,
        ),
        row(
            "target: 8 B latency <= UCX am latency",
            "batched/ucx",
            ratio(b.get("lat8_med"), u.get("lat8_med")),
            lambda v: v <= 1,
        ),
        row("target: idle CPU batched < 5 %", "batched", b.get("idle"), lambda v: v < 5),
        row("target: idle CPU ack < 5 %", "ack", a.get("idle"), lambda v: v < 5),
    ]


def fmt(v, spec: str = "{:.2f}") -> str:
    """Number or a dash."""
    return "-" if v is None else spec.format(v)


def fmt_ratio(v) -> str:
    """Ratios: enough digits for both 0.004 and 12x."""
    if v is None:
        return "-"
    return f"{v:.4f}" if v < 0.1 else f"{v:.2f}"


def build_table(results: dict) -> tuple[list[str], list[list[str]], int]:
    """Header, rows and the index where the target rows start (rich and plain share it)."""
    m = {name: metrics(name, res) for name, res in results.items()}
    cols = [(k, label) for k, label in COLUMNS if k in results]
    ratios = [(k, label) for k, label in RATIOS if "batched" in results and k in results]
    header = ["metric"] + [label for _, label in cols] + [label for _, label in ratios]
    header.append("check")
    rows = []
    for key, label, scale, spec in ROWS:
        vals = [m[k].get(key) for k, _ in cols]
        if all(v is None for v in vals):
            continue
        row = [label] + [fmt(v * scale if v is not None else None, spec) for v in vals]
        bval = m.get("batched", {}).get(key)
        row += [fmt_ratio(ratio(bval, m[k].get(key))) for k, _ in ratios]
        rows.append(row + [""])
    first_target = len(rows)
    for t in targets(m):
        if t["column"] not in header:
            continue
        row = [t["target"]] + [""] * (len(header) - 1)
        absolute = t["column"] in dict(COLUMNS)
        row[header.index(t["column"])] = fmt(t["value"]) if absolute else fmt_ratio(t["value"])
        row[-1] = t["verdict"]
        rows.append(row)
    return header, rows, first_target


def print_table(results: dict, meta: dict) -> None:
    """Print the table with rich when available, else as aligned plain text."""
    header, rows, first_target = build_table(results)
    title = (
        f"rdmamw bench ({'quick' if meta['quick'] else 'full'}): {meta['cpu_model']}, "
        f"{meta['cores']} cores, the two processes pinned to cores 0 and 1"
    )
    notes = table_notes(results, meta)
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None:
        table = Table(title=title, caption=escape("\n".join(notes)), caption_justify="left")
        for i, h in enumerate(header):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=True)
        style = {"PASS": "[green]PASS[/]", "FAIL": "[bold red]FAIL[/]"}
        for i, row in enumerate(rows):
            if i == first_target:
                table.add_section()
            table.add_row(*(escape(c) for c in row[:-1]), style.get(row[-1], row[-1]))
        Console(width=max(150, shutil.get_terminal_size().columns)).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(title)
    print(line(header))
    for i, row in enumerate(rows):
        if i in (0, first_target):
            print("-" * len(line(header)))
        print(line(row))
    for n in notes:
        print(n)


def table_notes(results: dict, meta: dict) -> list[str]:
    """Footnotes: what the columns mean, errors, and a warning when the machine was busy."""
    notes = [
        "one-way = RTT/2 after warm-up; rates: sender streams, receiver counts, median of "
        "runs; ratios are batched / peer; each target shows its value in its own column.",
        "zmq batch of k = k back-to-back send() (PUSH/PULL; PAIR for ping-pong); "
        "mpi4py batch = k Isend + Waitall; rdmamw batch = send_batch of k; many = "
        "rdmamw batched by send_many of one buffer of k and recv_many_into (streams only).",
        "ucx = ucx_perftest (C) over posix shm: latency ucp_am_lat, windowed stream and "
        "64 KiB stream ucp_am_bw, one-sided rows ucp_put_bw; the batched/ucx target "
        "compares rdmamw's b256 message rate with UCX's 8 B put rate.",
        "ucxx = UCX's Python binding (RAPIDS), asyncio tag send/recv of numpy arrays, its "
        "default progress thread; batch of k = k sends awaited together.",
        "memcpy column: time of one np.copyto (latency rows), copyto calls/s of 8 B "
        "(rate row), best-offset 64 KiB GB/s (bw row).",
    ]
    mc = results.get("memcpy", {})
    aliased = get(mc, "sizes", "65536", "offsets", "aliased_8", "gb_per_s")
    if aliased is not None:
        notes.append(f"memcpy 64 KiB with 4K-aliased dst (+8 B): {aliased:.2f} GB/s.")
    for name, res in results.items():
        if "error" in res:
            notes.append(f"{name}: NOT MEASURED - {res['error'].splitlines()[-1][:200]}")
    busy = {k: v for k, v in meta["others_cpu_percent_of_core"].items() if v > 10}
    if busy:
        joined = ", ".join(f"{k} {v:.0f}%" for k, v in busy.items())
        notes.append(
            f"WARNING: other processes used CPU during these runs ({joined} of a core): "
            "the two cores were shared, numbers are noisy."
        )
    return notes


# ---- main ----------------------------------------------------------------------------


def machine() -> dict:
    """What the numbers were measured on."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": len(os.sched_getaffinity(0)),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the selected systems, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="~30 s smoke run (shorter phases)")
    ap.add_argument(
        "--only", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}"
    )
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON result")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each system, wait up to S seconds for other load to drop below 10%%",
    )
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown system(s) {sorted(unknown)}; choose from {SYSTEMS}")
    if len(os.sched_getaffinity(0)) < 2:
        print("warning: fewer than 2 cores available; the pair will share a core", file=sys.stderr)
    cfg = dict(QUICK if args.quick else FULL)
    meta = {
        **machine(),
        "quick": args.quick,
        "config": cfg,
        "busy_before_percent": {},
        "others_cpu_percent_of_core": {},
        "seconds": {},
        "started": dt.datetime.now().isoformat(timespec="seconds"),
    }
    results: dict = {}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rdmamw-bench-") as tmp:
        for name in (s for s in SYSTEMS if s in only):
            meta["busy_before_percent"][name] = wait_quiet(args.wait_quiet)
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            t0, b0, c0 = time.perf_counter(), busy_seconds(), children_seconds()
            results[name] = run_system(name, cfg, tmp)
            wall = time.perf_counter() - t0
            others = (busy_seconds() - b0) - (children_seconds() - c0)
            meta["seconds"][name] = wall
            meta["others_cpu_percent_of_core"][name] = max(0.0, 100 * others / wall)
            if "error" in results[name]:
                print(f"[bench] {name}: {results[name]['error'][:300]}", file=sys.stderr)
    meta["seconds"]["total"] = time.perf_counter() - t_all
    meta["seconds"]["measuring"] = sum(v for k, v in meta["seconds"].items() if k != "total")
    meta["loadavg_end"] = os.getloadavg()
    m = {name: metrics(name, res) for name, res in results.items()}
    report = {
        "meta": meta,
        "results": results,
        "metrics": m,
        "targets": targets(m),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = args.out / f"bench-{stamp}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(report, indent=1))
    print_table(results, meta)
    secs = meta["seconds"]
    print(
        f"raw results: {path}  ({secs['measuring']:.0f} s measuring, {secs['total']:.0f} s total)"
    )
    return 1 if any("error" in r and not r.get("untested") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
