"""The counting of bench/connections.py (bench/conncost.py), on the host: what /proc and
iproute2's `rdma resource show` say, read back into per-process and per-peer figures."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("conncost", ROOT / "bench" / "conncost.py")
cc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cc)

STATUS = """Name:\tpython3
VmPeak:\t  900000 kB
VmSize:\t  812345 kB
VmLck:\t       8 kB
VmPin:\t   16435 kB
VmHWM:\t   70000 kB
VmRSS:\t   65432 kB
Threads:\t3
"""


def test_status_fields_are_read_in_kib_and_missing_ones_are_zero():
    assert cc.parse_status(STATUS) == {"vm_kib": 812345, "rss_kib": 65432,
                                       "pin_kib": 16435, "lck_kib": 8}
    assert cc.parse_status("VmSize:\t 10 kB\n")["pin_kib"] == 0


def test_fds_are_sorted_into_device_contexts_and_infiniband_events():
    targets = ["/dev/null", "/dev/infiniband/uverbs0", "/dev/infiniband/uverbs1",
               "/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0.bak",
               "anon_inode:[infinibandevent]", "anon_inode:[infinibandevent]",
               "anon_inode:[infinibandevent]", "anon_inode:[eventfd]", "socket:[123]"]
    assert cc.classify_fds(targets) == {"fds": 10, "uverbs_fds": 2, "ib_event_fds": 3}
    own = cc.classify_fds(cc.fd_targets())          # this process, on the host
    assert own["fds"] >= 3 and own["uverbs_fds"] == 0


# `rdma -j resource show qp` of iproute2 6.1 in the soft-RoCE VM (shortened): the
# kernel's GSI QP carries no pid
QP_JSON = ('[{"ifindex":3,"ifname":"rxe0","port":1,"lqpn":1,"type":"GSI","state":"RTS",'
           '"sq-psn":0,"comm":"[ib_core]"},{"ifindex":3,"ifname":"rxe0","port":1,'
           '"lqpn":17,"rqpn":18,"type":"RC","state":"RTS","pid":701,"comm":"python"},'
           '{"ifindex":3,"ifname":"rxe0","port":1,"lqpn":18,"rqpn":17,"type":"RC",'
           '"state":"RTS","pid":702,"comm":"python"},{"ifindex":3,"ifname":"rxe0",'
           '"port":1,"lqpn":19,"type":"RC","state":"RTS","pid":701,"comm":"python"}]\n')


# and one made by a handshake thread that has exited since: no pid, no comm
GONE = '[{"ifindex":0,"ifname":"rxe0","port":1,"lqpn":20,"type":"RC","state":"RTS"}]'


def test_rdma_json_objects_are_counted_per_process_and_per_job():
    objs = cc.parse_rdma_json(QP_JSON + GONE)
    assert len(objs) == 5
    assert cc.count_for_pid(objs, {701}) == 2 and cc.count_for_pid(objs, {702, 9}) == 1
    assert cc.count_for_pid(objs, {1}) == 0         # the GSI QP is nobody's
    assert cc.count_user(objs) == 4                 # all but the kernel's GSI QP
    # one array per device (older iproute2), and nothing at all
    two = cc.parse_rdma_json('[{"pid":5}]\n[{"pid":5},{"pid":6}]\n')
    assert cc.count_for_pid(two, {5}) == 2 and cc.count_user(two) == 3
    assert cc.parse_rdma_json("") == [] and cc.parse_rdma_json("[]\n") == []


def test_rdma_counts_asks_each_kind_and_says_why_when_the_tool_fails():
    asked = []

    def fake(cmd, **kw):
        asked.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 0, QP_JSON + GONE, "")
    counts, why = cc.rdma_counts({701, 703}, run=fake)
    assert asked == ["qp", "cq", "pd", "mr"] and why is None
    assert counts == {f"{k}_{w}": n for k in cc.RDMA_KINDS for w, n in (("own", 2), ("job", 4))}

    def refusing(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 255, "", "Operation not permitted")
    counts, why = cc.rdma_counts({701}, run=refusing)
    assert set(counts.values()) == {None} and len(counts) == 8
    assert "Operation not permitted" in why

    def missing(cmd, **kw):
        raise FileNotFoundError("rdma")
    assert cc.rdma_counts({701}, run=missing)[0]["qp_job"] is None


def test_a_snapshot_without_the_tool_counts_the_rest():
    snap = cc.snapshot(4, rdma=False)
    assert snap["qp"] is None and snap["rdma_error"].startswith("not asked")
    assert snap["fds"] >= 3 and snap["threads"] >= 1 and snap["vm_kib"] > 0


def _snap(**kv) -> dict:
    base = dict.fromkeys(k for k, _, _ in cc.METRICS)
    base.update({k: 0 for k in ("uverbs_fds", "fds", "pin_kib")}, rdma_error=None)
    base.update(kv)
    return base


def _row(rank: int, mesh_fds: int, pin: int, rndv_pin: int, connect: float) -> dict:
    return {"rank": rank, "connect_s": connect, "rndv_s": 1.0, "snap": {
        "before": _snap(fds=10, uverbs_fds=0, pin_kib=0, qp=0),
        "mesh": _snap(fds=mesh_fds, uverbs_fds=3, pin_kib=pin, qp=3),
        "rndv": _snap(fds=mesh_fds, uverbs_fds=3, pin_kib=pin + rndv_pin, qp=3),
        "done": _snap(fds=mesh_fds, uverbs_fds=3, pin_kib=pin, qp=3)}}


def test_summary_takes_medians_per_rank_and_per_peer():
    """A 4-rank job (3 peers each): the medians, not the means, and the slowest
    connect; a figure nobody could count stays None."""
    rows = [_row(0, 19, 300, 12288, 1.0), _row(1, 22, 300, 12288, 2.5),
            _row(2, 19, 330, 24576, 1.5), _row(3, 40, 900, 12288, 9.0)]
    s = cc.summarize(rows, 4)
    fds = s["metrics"]["fds"]
    assert fds["before"] == 10 and fds["after"] == 20.5
    assert fds["per_peer"] == pytest.approx((12 / 3 + 9 / 3) / 2)     # median of 3, 3, 4, 10
    pin = s["metrics"]["pin_kib"]
    assert pin["per_peer"] == pytest.approx(105)                       # (300 + 330) / 2 / 3
    assert pin["rndv_per_rank"] == 12288 and pin["rndv_per_peer"] == 4096
    assert s["metrics"]["qp"]["per_peer"] == 1 and s["metrics"]["uverbs_fds"]["after"] == 3
    assert s["metrics"]["mr"]["per_peer"] is None
    assert s["connect_s_slowest"] == 9.0 and s["connect_s_median"] == 2.0
    text = cc.table(s)
    assert "| RDMA device contexts (uverbs fds) | 0 | 3 | 1 |" in text
    assert "| MRs (job / ranks) | n/a | n/a | n/a | n/a | n/a |" in text


def test_two_runs_side_by_side():
    before = cc.summarize([_row(0, 19, 300, 12288, 1.0), _row(1, 19, 300, 12288, 2.0)], 4)
    after = cc.summarize([_row(0, 13, 30, 4096, 0.5), _row(1, 13, 30, 4096, 0.7)], 4)
    text = cc.compare_table([("before", before), ("after", after)])
    lines = text.splitlines()
    assert lines[0].count("per rank") == 2 and len(lines) == 2 + len(cc.METRICS) + 1
    assert "| all fds | 19 | 3 | 0 | 13 | 1 | 0 |" in text
    assert "| pinned, VmPin (KiB) | 300 | 100 | 4,096 | 30 | 10 | 1,365 |" in text
    assert lines[-1] == "| connect, slowest rank (s) | 2.00 | | | 0.70 | | |"


def test_headings_name_the_array_each_job_sent():
    """``--array-bytes`` is carried into the summary and named in both tables; a run
    written before the option existed sent 4 MiB."""
    rows = [_row(0, 19, 300, 256, 1.0), _row(1, 19, 300, 256, 2.0)]
    small = cc.summarize(rows, 4) | {"array_bytes": 256 << 10}
    old = cc.summarize(rows, 4)
    assert "| 256 KiB to every peer: per rank | per peer |" in cc.table(small)
    assert "| 4 MiB to every peer: per rank |" in cc.table(old)
    head = cc.compare_table([("new", small), ("old", old)]).splitlines()[0]
    assert "new: +256 KiB to all, per peer" in head and "old: +4 MiB to all, per peer" in head


def test_one_rank_counts_the_job_s_objects_and_the_medians_are_its(monkeypatch):
    """The job-wide QPs, CQs, PDs and MRs are asked of iproute2 by one rank only (64
    ranks listing ~38,000 MRs at once ran into the tool's timeout); the others leave
    them None without an error, and the summary's figures are the counting rank's."""
    calls = []

    def fake(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, QP_JSON + GONE, "")
    monkeypatch.setattr(cc.subprocess, "run", fake)
    other = cc.snapshot(4, rdma=True, counter=False)
    assert calls == [] and other["qp"] is None and other["rdma_error"] is None
    counting = cc.snapshot(4, rdma=True, counter=True)
    assert len(calls) == len(cc.RDMA_KINDS) and counting["rdma_error"] is None
    assert counting["qp"] == 4 / 4                 # the 4 user-made QPs of QP_JSON + GONE
    before = _snap(qp=0)
    rows = [{"rank": r, "connect_s": 1.0, "rndv_s": 1.0, "snap": {
        "before": before if r == 0 else _snap(),
        "mesh": counting if r == 0 else other, "rndv": counting if r == 0 else other,
        "done": counting if r == 0 else other}} for r in range(4)]
    s = cc.summarize(rows, 4)
    assert s["metrics"]["qp"]["after"] == 1 and s["metrics"]["qp"]["per_peer"] == 1 / 3
    assert s["rdma_error"] is None
