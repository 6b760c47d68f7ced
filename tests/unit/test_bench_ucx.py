"""bench/run.py's ucx column: ucx_perftest's Final line is read right and the
batched/ucx targets compare the rows the docs say (8 B b256 rate against UCX's put
rate, 8 B latency against ucp_am_lat)."""

from __future__ import annotations

import pytest

from tests.support.bench_module import load

run = load("bench_run", "run.py")
ucx = load("bench_ucx_peer", "peers/ucx_peer.py")

# a real ucx_perftest 1.13.1 client's output (ucp_put_bw -s 8 -n 2000000, this machine)
FINAL = (
    "| Message size: 8 |\n"
    "Final:               2000000      0.015     0.018     0.018      413.93     413.93"
    "    54254814    54254814\n"
)


def test_the_final_line_is_read_column_by_column():
    assert ucx.parse_final(FINAL) == {
        "iters": 2000000.0, "lat_p50_us": 0.015, "lat_avg_us": 0.018,
        "gb_per_s": 413.93 * (1 << 20) / 1e9, "msgs_per_s": 54254814.0,
    }


@pytest.mark.parametrize("bad", ["", "Final: 1 2 3", "no such line\n"])
def test_output_without_a_whole_final_line_is_an_error(bad):
    with pytest.raises(ValueError):
        ucx.parse_final(bad)


def test_the_ucx_targets_compare_b256_with_the_put_rate_and_latency_with_am():
    results = {
        "batched": {"latency": {"8": {"median_us": 0.6}},
                    "rate": {"256": {"msgs_per_s": 30e6}}, "bw": {"gb_per_s": 20.0}},
        "ucx": {"latency": {"8": {"median_us": 0.3}}, "rate": {},
                "rate_stream": {"msgs_per_s": 6e6}, "put_rate": {"msgs_per_s": 60e6},
                "bw": {"gb_per_s": 8.0}, "put_bw": {"gb_per_s": 40.0}},
    }
    m = {k: run.metrics(k, v) for k, v in results.items()}
    rows = {t["target"]: (t["value"], t["verdict"]) for t in run.targets(m)}
    assert rows["target: 8 B rate b256 >= UCX put rate"] == (0.5, "FAIL")
    assert rows["target: 8 B latency <= UCX am latency"] == (2.0, "FAIL")
    header, table, _ = run.build_table(results)
    assert header == ["metric", "batched", "ucx", "batched/ucx", "check"]
    by_label = {r[0]: r[1:4] for r in table}
    assert by_label["8 B one-sided put rate [M ops/s] \u2191"] == ["-", "60.000", "-"]
    assert by_label["64 KiB stream [GB/s] \u2191"] == ["20.00", "8.00", "2.50"]


def test_the_many_column_and_its_target_against_the_put_rate():
    """The "many" system (send_many / recv_many_into) is a column beside batched, and
    its b256 rate is the one compared with UCX's put rate in its own target."""
    results = {
        "batched": {"rate": {"256": {"msgs_per_s": 15e6}}},
        "many": {"rate": {"256": {"msgs_per_s": 66e6}}, "bw": {"gb_per_s": 5.0}},
        "ucx": {"rate": {}, "put_rate": {"msgs_per_s": 60e6}},
    }
    m = {k: run.metrics(k, v) for k, v in results.items()}
    rows = {t["target"]: (t["value"], t["verdict"]) for t in run.targets(m)}
    assert rows["target: 8 B rate b256 send_many / UCX put >= 1"] == (1.1, "PASS")
    assert rows["target: 8 B rate b256 >= UCX put rate"] == (0.25, "FAIL")
    header, table, _ = run.build_table(results)
    assert header == ["metric", "batched", "many", "ucx", "batched/ucx", "check"]
    by_label = {r[0]: r[1:4] for r in table}
    assert by_label["8 B rate, batch 256 [M msg/s] \u2191"] == ["15.000", "66.000", "-"]
    target = next(r for r in table if r[0].startswith("target: 8 B rate b256 send_many"))
    assert target[2] == "1.10" and target[-1] == "PASS"
