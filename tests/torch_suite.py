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

    python tests/torch_suite.py --backend rdmamw --world-size 2 [-k PATTERN ...]
        [--json FILE] [--list] [--spawn] [--timeout SECONDS]

prints one line per test (``PASS`` / ``FAIL`` / ``SKIP`` and seconds), then the counts;
``--json`` writes {test: [outcome, seconds, reason]} (tests/test_torch_suite.py,
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """The test class; ``as_gloo``: torch's decorators see "gloo" (they run the tests
    torch keeps for gloo by name) while every process group is ``backend``'s."""
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
    from torch.testing._internal.distributed import distributed_test
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )
    distributed_test.BACKEND = backend          # what init_process_group is given

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            ctx = "spawn" if spawn else "fork"
            self._start_processes(torch.multiprocessing.get_context(ctx).Process)

    name = f"TestDistBackendWithSpawn{backend.upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn      # a spawned rank finds it by name
    return TestDistBackendWithSpawn


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


def main(argv: list[str]) -> int:
    args = parse(argv)
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
