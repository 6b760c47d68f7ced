"""Instructions per 8 B message (send + receive + release), counted by valgrind's callgrind.

    python bench/instructions.py                      # batch 1: the total and the table
    python bench/instructions.py --batch 16 --top 30
    python bench/instructions.py --batch one          # send(msg) / recv(), not the batch calls
    python bench/instructions.py --batch many256      # send_many / recv_many_into of 256
    python bench/instructions.py --check              # fail above bench/instructions_baseline.json

Time per message drifts with the machine and its load; the instructions it executes do
not. ``bench/call_cost.py --batches B --reps 1`` runs under callgrind twice, with ``--n``
messages and with ``--base-n``; ``--dump-before=time_thread_time_ns`` cuts each run at
the calls that bracket its timed loop, so the fourth part is exactly that loop (the
first three are start-up, the warm-up loop and the gap after it). The difference of the
two loops over the difference of the message counts is the cost of one more message:
what a loop costs once cancels. Counts are deterministic (the hash seed is fixed) but
depend on the Python, the compiler and Cython that built the extensions: the baseline
is for the build it was recorded on.

``--check`` compares with the committed baseline (``bench/instructions_baseline.json``,
updated deliberately with ``--record``) and exits 1 when the count exceeds it by more
than ``--tolerance`` (1 %).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "instructions_baseline.json"
#: the timed loop of call_cost.py: part 4 of --dump-before=time_thread_time_ns
LOOP_PART = 4

_LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*?):(\S+)(?: \[(.*)\])?\s*$")


def demangle(name: str) -> str:
    """``__pyx_f_6rdmamw_6engine_7_engine_6Engine__send`` -> ``_engine.Engine._send``
    (Cython's length-prefixed names; the package prefix dropped)."""
    m = re.match(r"__pyx_(f|pw|pf|tp_\w+?)_(?=\d)", name)
    if not m:
        return name
    kind, s, parts = m.group(1), name[m.end():], []
    while True:
        d = re.match(r"\d+", s)
        if not d:
            break
        n = int(d.group())
        word = s[d.end():d.end() + n]
        rest = s[d.end() + n:]
        if len(word) < n or not (rest.startswith("_") or rest == ""):
            break           # a pw's index, not a length: the rest is the name
        parts.append(word)
        s = rest[1:]
        if not s:
            break
    tail = re.sub(r"^\d+", "", s)
    if kind.startswith("tp_"):
        tail = f"{tail}.{kind[3:]}" if tail else kind[3:]
    out = ".".join([p for p in parts if p != "rdmamw"] + ([tail] if tail else []))
    return out + (" (wrapper)" if kind == "pw" else "")


def functions(outfile: Path) -> tuple[int, dict[str, int]]:
    """Total and self instructions per function of one callgrind part (inlined code
    of a header counts to the function it was inlined into)."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100",
                           "--auto=no", str(outfile)], check=True, capture_output=True,
                          text=True).stdout
    total = int(re.search(r"^([\d,]+) \(\s*100\.0+%\)\s+PROGRAM TOTALS", text,
                          re.M).group(1).replace(",", ""))
    per: dict[str, int] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or m.group(2) == "PROGRAM TOTALS":
            continue
        ir = int(m.group(1).replace(",", ""))
        if ir == total:         # frames on the stack across the whole part
            continue
        fn = re.sub(r"'\d+$", "", m.group(3))      # recursion levels: one function
        fn = re.sub(r"@@?GLIBC.*$", "", fn)
        key = demangle(fn)
        per[key] = per.get(key, 0) + ir
    return total, per


def run_part(batch: str, n: int, tmp: Path, python: str) -> Path:
    out = tmp / f"cg-{batch}-{n}"
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=time_thread_time_ns",
                    f"--callgrind-out-file={out}", python, str(HERE / "call_cost.py"),
                    "--batches", str(batch), "--reps", "1", "--n", str(n)],
                   env=env, check=True, capture_output=True, text=True)
    part = Path(f"{out}.{LOOP_PART}")
    if not part.exists():
        sys.exit(f"instructions: callgrind wrote no part {LOOP_PART} ({out}.*): "
                 f"call_cost.py's timed loop is not where this script expects it")
    return part


def measure(batch: str, n: int, base_n: int, python: str = sys.executable
            ) -> tuple[float, dict[str, float]]:
    """Instructions per message at ``batch`` (messages per send_batch, or "one": the
    one-message calls), and per function (self cost)."""
    with tempfile.TemporaryDirectory(prefix="rdmamw-cg-") as t:
        hi = functions(run_part(batch, n, Path(t), python))
        lo = functions(run_part(batch, base_n, Path(t), python))
    size = per_batch(batch)
    dn = (n // size - base_n // size) * size
    per = {k: (hi[1].get(k, 0) - lo[1].get(k, 0)) / dn for k in set(hi[1]) | set(lo[1])}
    return (hi[0] - lo[0]) / dn, per


def per_batch(batch: str) -> int:
    """Messages per call of ``--batch``: N (send_batch), "one", or "manyN" (send_many
    of one buffer of N messages, recv_many_into)."""
    return 1 if batch == "one" else int(batch.removeprefix("many"))


def baseline_key(batch: str) -> str:
    return batch if batch == "one" or batch.startswith("many") else f"batch{int(batch)}"


def table(per: dict[str, float], total: float, top: int) -> str:
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    shown = [(k, v) for k, v in rows[:top] if abs(v) >= 0.5]
    rest = total - sum(v for _, v in shown)
    lines = ["| function (self) | instructions per message | share |", "|---|---:|---:|"]
    lines += [f"| `{k}` | {v:,.0f} | {v / total:.1%} |" for k, v in shown]
    lines += [f"| the other functions | {rest:,.0f} | {rest / total:.1%} |",
              f"| **total** | **{total:,.0f}** | |"]
    return "\n".join(lines)


def build() -> dict[str, str]:
    """What the count depends on besides the code: the baseline is for this build."""
    import Cython
    return {"python": sys.version.split()[0], "cython": Cython.__version__}


def over_budget(total: float, base: dict, key: str, tolerance: float) -> str | None:
    """Why ``total`` fails the baseline ``base[key]``, or None when within it."""
    if total > base[key] * (1 + tolerance):
        return (f"{total:,.1f} instructions per message ({key}) exceed the baseline's "
                f"{base[key]:,.1f} by {total / base[key] - 1:.1%}, more than {tolerance:.0%}")
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1",
                    help="messages per batch, or 'one': send()/recv(), or 'manyN': "
                         "send_many / recv_many_into of N (default 1)")
    ap.add_argument("--n", type=int, default=50_000, help="messages of the long run")
    ap.add_argument("--base-n", type=int, default=10_000, help="messages of the short run")
    ap.add_argument("--top", type=int, default=25, help="functions in the table")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 above the baseline ({BASELINE.name}) by > --tolerance")
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--record", action="store_true",
                    help=f"write this count as the new baseline into {BASELINE.name}")
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        sys.exit("instructions: valgrind (callgrind) is not installed")
    total, per = measure(args.batch, args.n, args.base_n)
    key = baseline_key(args.batch)
    if args.json:
        print(json.dumps({"instructions_per_message": round(total, 1),
                          "batch": args.batch if not args.batch.isdigit() else int(args.batch),
                          "functions": {k: round(v, 1) for k, v in per.items()
                                        if abs(v) >= 0.5}}))
    else:
        what = {"one": "send()/recv()"}.get(args.batch, f"batch {args.batch}")
        print(f"8 B messages at {what}: {total:,.1f} instructions per message "
              f"(send + receive + release; {args.n:,} - {args.base_n:,} messages)\n")
        print(table(per, total, args.top))
    if args.record:
        base = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
        base.update({key: round(total, 1), **build()})
        BASELINE.write_text(json.dumps(base, indent=2, sort_keys=True) + "\n")
    if args.check:
        base = json.loads(BASELINE.read_text())
        why = over_budget(total, base, key, args.tolerance)
        if why:
            sys.exit(f"instructions: {why} ({BASELINE})")
        print(f"instructions: within {args.tolerance:.0%} of the baseline "
              f"({base[key]:,.1f})", file=sys.stderr)

if __name__ == "__main__":
    main()
