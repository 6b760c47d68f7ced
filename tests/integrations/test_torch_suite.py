"""torch's own distributed test suite (``DistributedTest._DistTestBase`` of
torch/testing/_internal/distributed/distributed_test.py) on the rdmamw backend, run by
tests/support/torch_suite.py the way torch runs it for gloo. ``make test`` runs a fast
selection at world size 2 (each behaviour fixed for it, and the common operations);
``make test-torch`` runs the whole suite at world sizes 2 and 3 against gloo's run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.integrations.test_collectives import ROOT

pytest.importorskip("torch")
pytest.importorskip("expecttest")         # torch's test utilities import it
SUITE = os.path.join(ROOT, "tests", "support", "torch_suite.py")

#: tests gloo passes here, run as torch runs them (the first seven failed or were
#: skipped on rdmamw before issue 30)
SELECTION = [
    "test_send_recv_any_source", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_ddp_create_graph", "test_destroy_group",
    "test_destroy_full_group", "test_DistributedDataParallel_requires_grad",
    "test_all_reduce_sum", "test_all_reduce_max", "test_broadcast", "test_all_gather",
    "test_scatter", "test_gather", "test_reduce_sum", "test_barrier",
    "test_send_recv_with_tag", "test_isend", "test_irecv", "test_get_backend",
    "test_DistributedDataParallelCPU",
]
#: tests torch runs for gloo only, by name: run with --as-gloo (torch's tests see
#: "gloo", the process groups are rdmamw's)
GATED = ["test_barrier_timeout_full_group", "test_all_reduce_coalesced_sum",
         "test_batch_isend_irecv_gloo_tags", "test_get_future",
         "test_accumulate_gradients_no_sync"]


def suite(names: list[str], tmp_path, *extra: str) -> dict[str, list]:
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sel = [x for n in names for x in ("-k", f"^{n}$")]
    p = subprocess.run([sys.executable, SUITE, "--backend", "rdmamw", "--world-size", "2",
                        "--timeout", "60", "--json", str(out), *extra, *sel], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def failures(res: dict[str, list]) -> dict[str, str]:
    return {n: o[0] + ": " + o[2][-1500:] for n, o in res.items() if o[0] != "PASS"}


@pytest.mark.parametrize("extra, names", [((), SELECTION), (("--as-gloo",), GATED)],
                         ids=["selection", "gloo-only"])
def test_torch_distributed_tests_pass_on_rdmamw(extra, names, tmp_path):
    res = suite(names, tmp_path, *extra)
    assert sorted(res) == sorted(names)
    assert not failures(res), failures(res)


def test_the_tests_that_cannot_apply_are_documented():
    """Every test of tests/support/torch_suite.py's NOT_APPLICABLE is named in docs/torch.md
    (as ``_DistTestBase.test_...``: torch's, not a test of tests/)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
    try:
        from torch_suite import NOT_APPLICABLE
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", "torch.md")) as f:
        doc = f.read()
    assert NOT_APPLICABLE
    missing = [n for n in NOT_APPLICABLE if not re.search(rf"`_DistTestBase\.{n}`", doc)]
    assert not missing, missing
