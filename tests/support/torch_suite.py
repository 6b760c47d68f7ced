"""torch's own distributed test suite against a backend: ``DistributedTest._DistTestBase``
of ``torch/testing/_internal/distributed/distributed_test.py``, the tests torch runs for
gloo, nccl and ucc, run here as torch's ``test/distributed/test_distributed_spawn.py``
runs them (one ``TestDistBackend`` subclass; every test starts WORLD_SIZE fresh
processes that meet through a file:// store), with "rdmamw" added where torch lists a
plugin backend's features (``DistTestCases.backend_feature["plugin"]``, ``["ddp"]``,
``["subgroup"]``).

One difference: the rank processes are forked from this one, not spawned (a spawned
rank imports torch's test modules again, 15 s each on the CI machine; 300 tests x 2
backends would take hours). Nothing is initialised before the fork (no process group,
no thread): the rank starts as a spawned one would, with the modules already imported.
``--spawn`` runs them exactly as torch does.

    python tests/support/torch_suite.py --backend rdmamw --world-size 2 [-k PATTERN ...]
        [--json FILE] [--list] [--spawn] [--timeout SECONDS]

prints one line per test (``PASS`` / ``FAIL`` / ``SKIP`` and seconds), then the counts;
``--json`` writes {test: [outcome, seconds, reason]} (tests/integrations/test_torch_suite.py,
``make test-torch``). Exit code 0 whatever the outcomes: comparing is the caller's job."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: tests that pass on gloo here and cannot on rdmamw, with the reason (docs/torch.md
#: lists the same; tests/integrations/test_torch_suite.py holds the two together)
_MONITORED = ("torch's dist.monitored_barrier refuses every backend but gloo by name "
              "(torch.distributed.distributed_c10d.monitored_barrier)")
NOT_APPLICABLE: dict[str, str] = {
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_sparse_all_reduce_sum": "sparse tensors: the backend refuses them "
                                  "(UnsupportedTensor); no sparse all_reduce",
}


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="rdmamw")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run the tests whose name matches this regular expression "
                         "(repeatable; default: all)")
    ap.add_argument("--json", help="write the outcomes here")
    ap.add_argument("--list", action="store_true", help="list the selected tests and exit")
    ap.add_argument("--spawn", action="store_true", help="spawn the ranks, as torch does")
    ap.add_argument("--as-gloo", action="store_true",
                    help="torch's skip decorators see 'gloo' (the tests it runs for gloo "
                         "only, by name), the process groups are --backend's")
    ap.add_argument("--compare", action="store_true",
                    help="run gloo, then --backend (and, as gloo, the tests torch keeps "
                         "for gloo by name); print both counts and every test gloo "
                         "passes and --backend does not; exit 1 if one is not in "
                         "NOT_APPLICABLE")
    ap.add_argument("--timeout", type=int, default=120,
                    help="seconds per test before its ranks are killed (torch: 300)")
    return ap.parse_args(argv)


def setup_env(args: argparse.Namespace) -> None:
    """What distributed_test.py reads when it is imported."""
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(args.timeout))
    tmp = tempfile.mkdtemp(prefix="torch-suite-")
    os.makedirs(os.path.join(tmp, "barrier"))
    os.environ["TEMP_DIR"] = tmp
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_class(backend: str, spawn: bool, as_gloo: bool = False) -> type:
    """The test class; ``as_gloo``: torch's tests see "gloo" (its decorators and the
    tests' own ``if BACKEND == "gloo"``: the tests torch runs for gloo only, by name)
    while every process group they make is ``backend``'s."""
    import torch
    from torch.testing._internal.common_distributed import DistTestCases

    if backend == "rdmamw":
        import rdmamw.torch
        rdmamw.torch.register()
        # before distributed_test is imported: its decorators read these sets then
        for feature in ("plugin", "ddp", "subgroup"):
            DistTestCases.backend_feature[feature].add(backend)
    if as_gloo:
        os.environ["BACKEND"] = "gloo"
        as_backend(backend)
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            ctx = "spawn" if spawn else "fork"
            self._start_processes(torch.multiprocessing.get_context(ctx).Process)

    name = f"TestDistBackendWithSpawn{backend.upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn      # a spawned rank finds it by name
    return TestDistBackendWithSpawn


def as_backend(backend: str) -> None:
    """init_process_group and new_group asked for gloo make ``backend``'s groups."""
    import torch.distributed as dist
    init, new = dist.init_process_group, dist.new_group

    def swap(kw: dict, args: tuple) -> tuple:
        if args and args[0] == "gloo":
            args = (backend, *args[1:])
        if kw.get("backend") == "gloo":
            kw["backend"] = backend
        return args

    def init_process_group(*args, **kw):
        return init(*swap(kw, args), **kw)

    def new_group(*args, **kw):
        if len(args) > 2 and args[2] == "gloo":
            args = (*args[:2], backend, *args[3:])
        swap(kw, ())
        return new(*args, **kw)

    dist.init_process_group, dist.new_group = init_process_group, new_group


class Result(unittest.TextTestResult):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.outcomes: dict[str, list] = {}
        self._t0 = 0.0

    def startTest(self, test) -> None:  # noqa: N802 - unittest's name
        self._t0 = time.monotonic()
        super().startTest(test)

    def _note(self, test, outcome: str, reason: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        secs = round(time.monotonic() - self._t0, 2)
        self.outcomes[name] = [outcome, secs, reason[-3000:]]
        self.stream.write(f"{outcome} {secs:7.2f}s {name}\n")
        self.stream.flush()

    def addSuccess(self, test) -> None:  # noqa: N802
        super().addSuccess(test)
        self._note(test, "PASS")

    def addFailure(self, test, err) -> None:  # noqa: N802
        super().addFailure(test, err)
        self._note(test, "FAIL", self._exc_info_to_string(err, test))

    def addError(self, test, err) -> None:  # noqa: N802
        super().addError(test, err)
        self._note(test, "FAIL", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason) -> None:  # noqa: N802
        super().addSkip(test, reason)
        self._note(test, "SKIP", str(reason))

    def addExpectedFailure(self, test, err) -> None:  # noqa: N802
        super().addExpectedFailure(test, err)
        self._note(test, "PASS")

    def addUnexpectedSuccess(self, test) -> None:  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._note(test, "FAIL", "unexpected success")


def run(args: list[str], out: str) -> dict[str, list]:
    """This script in a process of its own (torch's module reads the backend when it
    is imported); its outcomes."""
    import subprocess
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = out[:-len(".json")] + ".log"
    print(f"running {' '.join(args[:4])} ... (output: {log})", flush=True)
    with open(log, "w") as f:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--json", out],
                           env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        raise SystemExit(f"tests/support/torch_suite.py {' '.join(args)} exited with "
                         f"{p.returncode}; see {log}")
    with open(out) as f:
        return json.load(f)


def compare(args: argparse.Namespace) -> int:
    ws, sel = str(args.world_size), [x for p in args.patterns for x in ("-k", p)]
    tmp = tempfile.mkdtemp(prefix="torch-compare-")
    common = ["--world-size", ws, "--timeout", str(args.timeout), *sel]
    gloo = run(["--backend", "gloo", *common], os.path.join(tmp, "gloo.json"))
    ours = run(["--backend", args.backend, *common], os.path.join(tmp, "ours.json"))
    gated = [n for n, o in gloo.items() if o[0] == "PASS" and ours[n][0] == "SKIP"]
    if gated:
        names = [x for n in gated for x in ("-k", f"^{n}$")]
        again = run(["--backend", args.backend, "--as-gloo", "--world-size", ws,
                     "--timeout", str(args.timeout), *names],
                    os.path.join(tmp, "gated.json"))
        ours.update({n: o for n, o in again.items() if o[0] != "SKIP"})

    def count(d: dict, what: str) -> int:
        return sum(1 for o in d.values() if o[0] == what)

    print(f"torch {__import__('torch').__version__} DistributedTest, world size {ws}: "
          f"{len(gloo)} tests")
    print(f"{'':10}{'gloo':>8}{args.backend:>8}")
    for what in ("PASS", "FAIL", "SKIP"):
        print(f"{what.lower():10}{count(gloo, what):>8}{count(ours, what):>8}")
    print(f"({len(gated)} tests torch runs for gloo only by name ran on {args.backend} "
          f"with --as-gloo; {sum(1 for n in gated if ours[n][0] == 'PASS')} passed)")
    missing = sorted(n for n, o in gloo.items() if o[0] == "PASS" and ours[n][0] != "PASS")
    bad = [n for n in missing if n not in NOT_APPLICABLE]
    for n in missing:
        why = NOT_APPLICABLE.get(n) or "NOT DOCUMENTED: " + (
            ours[n][2].strip().splitlines() or ["?"])[-1][:160]
        print(f"  gloo passes, {args.backend} {ours[n][0].lower()}s: {n}: {why}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.compare:
        return compare(args)
    setup_env(args)
    sys.path.insert(0, ROOT)
    cls = make_class(args.backend, args.spawn, args.as_gloo)
    names = sorted(n for n in unittest.TestLoader().getTestCaseNames(cls))
    if args.patterns:
        names = [n for n in names if any(re.search(p, n) for p in args.patterns)]
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(cls(n) for n in names)

    class _Runner(unittest.TextTestRunner):
        resultclass = Result

    t0 = time.monotonic()
    res = _Runner(stream=sys.stdout, verbosity=0).run(suite)
    counts = {k: sum(1 for o in res.outcomes.values() if o[0] == k)
              for k in ("PASS", "FAIL", "SKIP")}
    print(f"{args.backend} world size {args.world_size}: {len(names)} tests, "
          f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.monotonic() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
