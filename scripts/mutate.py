"""Mutation testing of the pure-Python layers that carry results (`make mutate`).

mutmut 3 makes the mutants (its libcst operators: ``mutmut.mutation.file_mutation.
create_mutations``); this driver runs them. mutmut's own runner does not fit this
suite: it picks the tests of a mutant from the calls it recorded inside the pytest
process, and most of the PS, collectives and bootstrap code runs in child processes
(tests/support/ps_job.py, tests/support/coll_worker.py, launch.spawn), so those mutants come out as
"no tests" and are never run; and it forks the pytest process per mutant while the
engine's threads are live. Here each mutant is written, alone, into a copy of the tree
(with the built extensions), and the module's own tests (MODULE_TESTS) run in a fresh
pytest with the copy first on PYTHONPATH, so child processes import the mutant too;
a mutant they miss runs against the module's slower tests (SECOND_TESTS) as well.

    scripts/mutate.py [--modules ps/server.py,sched/] [--budget 600] [--max 0] [--jobs 1]
                      [--seed 1] [--only NAME ...] [--tests FILE::TEST ...] [--list]
                      [--fail-under 85] [--out mutants-py.json]

A module's run stops at --budget seconds (a random sample of its mutants, seeded,
when it does not finish); --max caps the count. Results: one line per mutant
(killed / survived / timeout / error) and a score table; the JSON keeps every
mutant's diff and the first failure line that killed it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a test of the suite takes seconds; a mutant that makes one hang is killed sooner
TEST_TIMEOUT = 60

#: module (relative to rdmamw/) -> the test files (or node ids) that cover it
MODULE_TESTS: dict[str, list[str]] = {
    "ps/consistency.py": ["tests/unit/test_ps_consistency.py", "tests/integrations/test_ps.py"],
    "ps/server.py": ["tests/integrations/test_ps.py"],
    "ps/worker.py": ["tests/integrations/test_ps.py"],
    "ps/stream.py": ["tests/integrations/test_ps.py"],
    "ps/optim.py": ["tests/unit/test_ps_optim.py", "tests/integrations/test_ps.py"],
    "ps/wire.py": ["tests/integrations/test_ps.py"],
    "ps/job.py": ["tests/integrations/test_ps.py", "tests/unit/test_config.py::"
                  "test_the_parameter_server_ring_has_its_own_default_and_yields_to_the_general"],
    "ps/metrics.py": ["tests/integrations/test_ps.py"],
    # the matrix at 6-8 ranks adds half a minute per run and no code path 3-5 do not take
    "collectives/": ["tests/integrations/test_collectives.py"] + [
        f"--deselect=tests/integrations/test_collectives.py::test_every_algorithm_dtype_and_op_matches_numpy"
        f"[{p}]" for p in ("5-None", "6-None", "6-a,b,a,c,b,c", "7-None", "8-None",
                           "8-a,b,c,a,b,c,d,a")],
    "sched/": ["tests/unit/test_sched.py"],
    "bitmap/model.py": ["tests/unit/test_bitmap_unit.py", "tests/unit/test_bitmap_properties.py"],
    "auth.py": ["tests/providers/test_fuzz_tcp.py", "tests/channel/test_channel_errors.py",
                "tests/providers/test_tcp.py::test_token_file_is_private",
                "tests/providers/test_tcp.py::test_token_file_defaults_to_the_home_config",
                "tests/providers/test_tcp.py::test_the_token_file_is_made_in_a_config_directory_that_exists",
                "tests/providers/test_tcp.py::test_an_empty_token_file_is_a_config_error_that_says_so"],
    "bootstrap/": ["tests/integrations/test_bootstrap.py"],
}

#: slower tests that cover the module too: run only for a mutant the fast ones missed
SECOND_TESTS: dict[str, list[str]] = {
    **{f"ps/{m}.py": ["tests/integrations/test_dsana.py"]
       for m in ("server", "worker", "stream", "wire", "job", "metrics")},
    "sched/": ["tests/integrations/test_dsana.py"],
    "collectives/": ["tests/integrations/test_collectives.py::"
                     "test_every_algorithm_dtype_and_op_matches_numpy"],
}

#: the order and the seconds per module of `make mutate` on a 2-core machine: the
#: layers that carry results first, the slow suites (collectives) with more time
DEFAULT_BUDGET: dict[str, float] = {
    "ps/consistency.py": 240, "ps/server.py": 300, "collectives/": 450,
    "bitmap/model.py": 240, "sched/": 300, "ps/worker.py": 240, "ps/stream.py": 150,
    "ps/optim.py": 150, "ps/wire.py": 100, "ps/job.py": 120, "ps/metrics.py": 100,
    "auth.py": 150, "bootstrap/": 300,
}


#: (tests) -> the clean run's (status, why, seconds), measured once per invocation
BASELINES: dict[tuple[str, ...], tuple[str, str, float]] = {}


@dataclass
class Mutant:
    name: str          # module:line:index, stable for a given source
    path: str          # relative to the tree root
    line: int
    source: str        # the whole mutated file
    diff: str
    status: str = "pending"
    seconds: float = 0.0
    why: str = ""      # the first failure line (killed) or the error


@dataclass
class ModuleResult:
    module: str
    tests: list[str]
    total: int = 0
    mutants: list[Mutant] = field(default_factory=list)

    def count(self, *status: str) -> int:
        return sum(m.status in status for m in self.mutants)


def files_of(module: str) -> list[str]:
    """The .py files a MODULE_TESTS key stands for (a file or a package directory)."""
    base = ROOT / "rdmamw" / module
    if module.endswith("/"):
        return sorted(str(p.relative_to(ROOT)) for p in base.glob("*.py"))
    return [str(base.relative_to(ROOT))]


def make_mutants(path: str) -> list[Mutant]:
    """Every mutant mutmut's operators make of one file, each as a whole source."""
    from mutmut.mutation.file_mutation import create_mutations

    code = (ROOT / path).read_text()
    os.chdir(ROOT)                        # mutmut reads [tool.mutmut] of ./pyproject.toml
    module, mutations, _, _ = create_mutations(path, code)
    lines = code.splitlines(keepends=True)
    out: list[Mutant] = []
    for i, mu in enumerate(mutations):
        if mu.contained_by_top_level_function is None:
            continue                      # as mutmut: module-level code is not mutated
        src = module.deep_replace(mu.original_node, mu.mutated_node).code
        new = src.splitlines(keepends=True)
        diff = "".join(difflib.unified_diff(lines, new, path, path, n=0))
        first = next((ln for ln in diff.splitlines() if ln.startswith("@@")), "@@ -0 @@")
        line = int(first.split()[1].lstrip("-").split(",")[0])
        mod = path.removeprefix("rdmamw/").removesuffix(".py").replace("/", ".")
        out.append(Mutant(f"{mod}:{line}:{i}", path, line, src, diff))
    return out


def copy_tree(dest: Path) -> Path:
    """The tracked files plus the built extensions, without bytecode caches."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    files += [str(p.relative_to(ROOT)) for d in ("rdmamw", "tests/support")
              for p in (ROOT / d).rglob("*.so")]
    for f in filter(None, files):
        src = ROOT / f
        if not src.is_file():
            continue                      # deleted but not yet committed
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / f)
    return dest


def kill_session(sid: int) -> None:
    """SIGKILL what is left of one test run's session: a mutant that hangs a job's
    ranks leaves them behind when pytest-timeout (or our timeout) ends the test."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    os.kill(int(d.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, str, float]:
    """(passed|failed|timeout|error, first failure line, seconds) of one pytest run."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "--tb=line", f"--timeout={TEST_TIMEOUT}", *tests]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        p.communicate()
        return "timeout", f"no result within {timeout:.0f} s", time.monotonic() - t0
    finally:
        kill_session(p.pid)
    dt = time.monotonic() - t0
    if p.returncode == 0:
        return "passed", "", dt
    if p.returncode == 1:
        lines = [ln for ln in out.splitlines()
                 if ln.startswith(("FAILED", "ERROR", "E ")) or ": " in ln and "/" in ln]
        return "failed", (lines[0] if lines else out.strip()[-200:])[:300], dt
    return "error", f"pytest exit {p.returncode}: {(out + err).strip()[-300:]}", dt


def run_module(module: str, workers: list[Path], args, log) -> ModuleResult:
    tests = args.tests or MODULE_TESTS[module]
    second = [] if args.tests else SECOND_TESTS.get(module, [])
    res = ModuleResult(module, tests)
    allm = [m for f in files_of(module) for m in make_mutants(f)]
    if args.only:
        allm = [m for m in allm if m.name in args.only]
    res.total = len(allm)
    random.Random(args.seed).shuffle(allm)
    if args.max:
        allm = allm[:args.max]
    if not allm:
        return res
    key = tuple(tests)
    if key not in BASELINES:            # the PS modules share test_ps.py: one clean run
        BASELINES[key] = run_tests(workers[0], tests, timeout=900)
    status, why, base = BASELINES[key]
    log(f"== {module}: {res.total} mutants, tests {' '.join(tests)}: baseline {status} "
        f"in {base:.0f} s")
    if status != "passed":
        log(f"   baseline does not pass, module skipped: {why}")
        return res
    timeout = base * 2 + TEST_TIMEOUT
    deadline = time.monotonic() + (args.budget or DEFAULT_BUDGET[module])
    free = list(workers)

    def one(m: Mutant) -> Mutant:
        tree = free.pop()
        target = tree / m.path
        try:
            target.write_text(m.source)
            st, m.why, m.seconds = run_tests(tree, tests, timeout)
            if st == "passed" and second:
                st, m.why, dt = run_tests(tree, second, 900)
                m.seconds += dt
            m.status = {"passed": "survived", "failed": "killed"}.get(st, st)
        finally:
            shutil.copy2(ROOT / m.path, target)
            free.append(tree)
        why = "" if m.status == "survived" else m.why[:120]
        log(f"   {m.status:8} {m.name} ({m.seconds:.0f} s) {why}")
        if m.status == "survived":
            log("     " + "\n     ".join(m.diff.splitlines()[2:]))
        return m

    with ThreadPoolExecutor(len(workers)) as pool:
        running: set = set()
        for m in allm:
            if len(running) >= len(workers):
                _, running = wait(running, return_when=FIRST_COMPLETED)
            if time.monotonic() > deadline:
                break
            running.add(pool.submit(one, m))
        wait(running)
    res.mutants = [m for m in allm if m.status != "pending"]
    return res


def score_table(results: list[ModuleResult]) -> str:
    rows = [f"{'module':22} {'mutants':>7} {'run':>5} {'killed':>6} {'timeout':>7} "
            f"{'survived':>8} {'error':>5} {'score':>6}"]
    for r in results:
        run = len(r.mutants)
        dead = r.count("killed", "timeout")
        score = f"{100 * dead / run:.0f}%" if run else "-"
        rows.append(f"{r.module:22} {r.total:7} {run:5} {r.count('killed'):6} "
                    f"{r.count('timeout'):7} {r.count('survived'):8} {r.count('error'):5} "
                    f"{score:>6}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default=os.environ.get("MUTATE_MODULES", ""),
                    help="comma-separated keys of MODULE_TESTS (default: all, in order)")
    ap.add_argument("--budget", type=float,
                    default=float(os.environ.get("MUTATE_BUDGET", "0")),
                    help="seconds per module, a seeded random sample of its mutants runs "
                         "(0: DEFAULT_BUDGET's, 240-600 s)")
    ap.add_argument("--max", type=int, default=int(os.environ.get("MUTATE_MAX", "0")),
                    help="at most this many mutants per module (0: no cap)")
    ap.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATE_JOBS", "1")))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("MUTATE_SEED", "1")))
    ap.add_argument("--only", nargs="*", default=[], help="mutant names to (re)run")
    ap.add_argument("--tests", nargs="*", default=[],
                    help="run these tests instead of the module's MODULE_TESTS")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument("--fail-under", type=float, default=85.0,
                    help="exit 1 when a module's score (killed %% of those run) is lower")
    ap.add_argument("--out", default=os.environ.get("MUTATE_OUT", "mutants-py.json"))
    args = ap.parse_args(argv)

    modules = [m.strip() for m in args.modules.split(",") if m.strip()] or list(DEFAULT_BUDGET)
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {sorted(MODULE_TESTS)}")
    if args.list:
        for mod in modules:
            for f in files_of(mod):
                for m in make_mutants(f):
                    print(m.name, m.diff.splitlines()[-1].strip()[:100])
        return 0

    def log(msg: str) -> None:
        print(msg, flush=True)

    results = []
    with tempfile.TemporaryDirectory(prefix="rdmamw-mutate-") as tmp:
        workers = [copy_tree(Path(tmp) / f"tree{i}") for i in range(max(1, args.jobs))]
        for mod in modules:
            results.append(run_module(mod, workers, args, log))
            Path(args.out).write_text(json.dumps(
                [{**asdict(r), "mutants": [{k: v for k, v in asdict(m).items() if k != "source"}
                                           for m in r.mutants]} for r in results], indent=1))
    log("\n" + score_table(results))
    low = [r.module for r in results
           if r.mutants and 100 * r.count("killed", "timeout") / len(r.mutants) < args.fail_under]
    if low:
        log(f"under {args.fail_under:.0f} %: {' '.join(low)}")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
