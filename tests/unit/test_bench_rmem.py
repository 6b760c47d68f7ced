"""bench/rmem_bench.py's peers: a peer's RESULT line and its owner's OWNER line are read
past the libraries' log lines around them, and the rows and targets compare the right
numbers (each peer with rdmamw on its own transport, time over time)."""

from __future__ import annotations

import io

import pytest

from tests.support.bench_module import load

rmem = load("bench_rmem", "rmem_bench.py")
one_sided = load("bench_one_sided", "peers/one_sided.py")

# what a NIXL reader prints (its log goes to stdout), shortened
NIXL_OUT = (
    "2026-12-06 21:22:41 NIXL INFO    _api.py:405 Backend UCX was instantiated\n"
    'RESULT {"tool": "nixl", "sizes": {"65536": {"read_s": [1e-05], "write_s": [2e-05]}},'
    ' "writes8_s": [0.001]}\n'
    "2026-12-06 21:22:42 NIXL INFO    _api.py:300 agent destroyed\n"
)


def test_the_result_line_is_found_among_log_lines():
    assert rmem.parse_result(NIXL_OUT, "nixl") == {
        "tool": "nixl", "sizes": {"65536": {"read_s": [1e-05], "write_s": [2e-05]}},
        "writes8_s": [0.001]}


@pytest.mark.parametrize("out", ["", "I1206 log only\n", 'RESULT {"tool": "x"}\n',
                                 'RESULT {"sizes": {}, "writes8_s": 3}\n'])
def test_a_missing_or_partial_result_is_an_error_naming_the_peer(out):
    with pytest.raises(RuntimeError, match="mooncake"):
        rmem.parse_result(out, "mooncake")


def test_the_owner_line_is_read_past_the_log():
    out = io.StringIO('W1206 topology.cpp:201] No RDMA devices found\n'
                      'OWNER {"port": 15823, "addrs": [1, 2]}\nlater\n')
    assert one_sided.owner_info(out, "mooncake") == {"port": 15823, "addrs": [1, 2]}
    with pytest.raises(RuntimeError, match="NIXL owner exited"):
        one_sided.owner_info(io.StringIO("NIXL ERROR no backend\n"), "NIXL")


def _run(read_s: float, write_s: float, writes8_s: float, copy_s: float | None = None) -> dict:
    sizes = {}
    for n in ("65536", "4194304"):
        per = {"read_s": [read_s, read_s * 3, read_s / 3], "write_s": [write_s]}
        if copy_s is not None:
            per |= {"copyto_s": [copy_s], "pull_s": [copy_s * 4]}
        sizes[n] = per
    return {"tool": "t", "sizes": sizes, "writes8_s": [writes8_s]}


def test_each_peer_is_compared_with_rdmamw_on_its_transport():
    rdmamw = {"shm": _run(1.0, 2.0, 256e-7, copy_s=0.9), "tcp": _run(10.0, 10.0, 1.0)}
    peers = {"nixl": _run(2.0, 1.0, 1.0), "mooncake": _run(30.0, 5.0, 2.0),
             "ucx": _run(0.5, 0.5, 1e-5)}
    rows, targets = rmem.summarize(rdmamw, peers, 256, "shm")
    verdicts = {t["target"]: (t["value"], t["verdict"]) for t in targets}
    # medians: rdmamw shm read 1.0 (of 1, 3, 1/3), copyto 0.9 -> 0.9 < 1.0 at 4M, >= 0.8 at 64K
    assert verdicts["shm read 4M / np.copyto >= 1.0"] == (0.9, "FAIL")
    assert verdicts["shm read 64K / np.copyto >= 0.8"] == (0.9, "PASS")
    assert verdicts["shm batched 8 B writes >= 10 M ops/s"] == (pytest.approx(10.0), "PASS")
    # nixl against shm: read 2.0 / 1.0, write 1.0 / 2.0; mooncake against tcp (10, 10)
    assert verdicts["shm read 64 KiB: rdmamw >= nixl (nixl/rdmamw time)"] == (2.0, "PASS")
    assert verdicts["shm write 4096 KiB: rdmamw >= nixl (nixl/rdmamw time)"] == (0.5, "FAIL")
    assert verdicts["tcp read 4096 KiB: rdmamw >= mooncake (mooncake/rdmamw time)"] == (
        3.0, "PASS")
    assert verdicts["tcp write 64 KiB: rdmamw >= mooncake (mooncake/rdmamw time)"] == (
        0.5, "FAIL")
    assert not any("ucx" in t for t in verdicts)         # ucx: rows, no target (C, not Python)
    ucx = [r for r in rows if r["system"] == "ucx" and r["size"] == 65536]
    assert ucx[0]["read_ucx/rdmamw"] == 0.5
    rate = [r for r in rows if r["system"] == "mooncake" and r["size"] == 8][0]
    assert rate["writes8_ops_per_s"] == 128.0
    assert rate["rdmamw/mooncake 8 B write rate"] == 2.0     # tcp 256/s over 128/s


def test_a_peer_that_did_not_run_is_a_row_with_its_reason():
    rows, targets = rmem.summarize({"tcp": _run(1.0, 1.0, 1.0)},
                                   {"mooncake": {"error": "no peers Python at /x"}}, 256, "tcp")
    assert {"system": "mooncake", "error": "no peers Python at /x"} in rows
    assert targets == []


def test_rounds_are_merged_rep_by_rep():
    a, b = _run(1.0, 1.0, 1.0), _run(5.0, 5.0, 5.0)
    m = rmem.merge([a, b])
    assert m["sizes"]["65536"]["read_s"] == [1.0, 3.0, 1 / 3, 5.0, 15.0, 5 / 3]
    assert m["writes8_s"] == [1.0, 5.0]


def test_the_batched_fetch_adds_are_a_row_beside_the_single_ones():
    run = _run(1.0, 1.0, 1.0) | {"atomics": {
        "fadd_s": [2e-6], "read8_s": [1e-6], "fadd_single64_s": [4e-6, 2e-6, 3e-6],
        "fadd_batch64_s": [1e-6, 5e-7, 2e-6]}}
    rows, _ = rmem.summarize({"tcp": rmem.merge([run])}, {}, 256, "tcp")
    row = [r for r in rows if "batch64/single" in r][0]
    assert row["system"] == "rdmamw tcp"
    assert row["single64_fetch_add_ops_per_s"] == pytest.approx(1 / 3e-6)
    assert row["batch64_fetch_add_ops_per_s"] == pytest.approx(1e6)
    assert row["batch64/single"] == pytest.approx(3.0)       # medians 3 us over 1 us
