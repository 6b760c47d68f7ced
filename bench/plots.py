"""The plots of docs/benchmarks/, drawn from the figures those pages give.

    python bench/plots.py    # docs/benchmarks/figures.json -> docs/benchmarks/img/*.png

figures.json holds the tables of the benchmark pages as data (each with its source
command, date and load); a new run's figures go into the page and into the JSON, then
this script redraws. Needs matplotlib (the `examples` extra)."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "docs" / "benchmarks" / "figures.json"
OUT = ROOT / "docs" / "benchmarks" / "img"


def size_label(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def note(fig, source: str) -> None:
    """The figures' source (command, date, load) under the plot, wrapped to its width."""
    width = int(fig.get_figwidth() * 17)
    text = "\n".join(textwrap.wrap(source, width))
    fig.text(0.01, 0.01, text, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03 + 0.03 * text.count("\n") + 0.02, 1, 1))


def finish(fig, ax, title: str, source: str, path: Path) -> None:
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    note(fig, source)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rate_vs_batch(f: dict, out: Path) -> None:
    d = f["rate_vs_batch"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(d["batch"], [r / 1e6 for r in d["messages_per_s"]], "o-", label="8 B messages/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(d["batch"], [str(b) for b in d["batch"]])
    ax.set_ylim(0, max(d["messages_per_s"]) / 1e6 * 1.12)
    ax.set_xlabel("messages per send_batch")
    ax.set_ylabel("million messages / s")
    for b, r, c in zip(d["batch"], d["messages_per_s"], d["cpu_ns_per_message"], strict=True):
        ax.annotate(f"{c:.0f} ns CPU/msg", (b, r / 1e6), textcoords="offset points",
                    xytext=(8, 6), fontsize=8)
    ax.legend(loc="upper left")
    finish(fig, ax, "8 B message rate by batch size (shm)", d["source"], out / "rate-vs-batch.png")


def stream_vs_size(f: dict, out: Path) -> None:
    d = f["stream_vs_size"]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for name, ys in d["GB_per_s"].items():
        style = "--" if not name.startswith("rdmamw") else "o-"
        ax.plot(d["size_bytes"], ys, style, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(d["size_bytes"], [size_label(s) for s in d["size_bytes"]])
    ax.set_xlabel("message size")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    finish(fig, ax, "Streams by message size (shm, 2 cores)", d["source"],
           out / "stream-vs-size.png")


def allreduce(f: dict, out: Path) -> None:
    d = f["allreduce"]
    cases, systems = d["cases"], list(d["ms"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 4))
    for ax, size in zip(axes, ("1 MiB", "64 MiB"), strict=True):
        idx = [i for i, c in enumerate(cases) if c.startswith(size + ",")]
        width = 0.8 / len(systems)
        for k, name in enumerate(systems):
            xs = [j + k * width for j in range(len(idx))]
            ax.bar(xs, [d["ms"][name][i] for i in idx], width, label=name)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(idx))],
                      [cases[i].split(", ")[1] for i in idx])
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(f"allreduce {size}")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    note(fig, d["source"])
    fig.savefig(out / "allreduce.png", dpi=110)
    plt.close(fig)


def cost_per_peer(f: dict, out: Path) -> None:
    d = f["cost_per_peer"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(d["ranks"], d["pinned_KiB_per_idle_peer"], "o-", label="verbs: pinned KiB")
    ax.plot(d["ranks"], [r * 1024 for r in d["rss_MiB_per_idle_peer"]], "s-",
            label="verbs: resident KiB")
    ax.set_xscale("log", base=2)
    ax.set_xticks(d["ranks"], [str(r) for r in d["ranks"]])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("ranks in the job (all-to-all)")
    ax.set_ylabel("KiB per idle peer")
    ax.legend()
    finish(fig, ax, "What an idle peer costs (verbs, soft-RoCE VM)", d["source"],
           out / "cost-per-peer.png")


def dask_round_trip(f: dict, out: Path) -> None:
    d = f["dask_round_trip"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, ys in d["us"].items():
        ax.plot(d["size_bytes"], [y / 1000 for y in ys], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(d["size_bytes"], [size_label(s) for s in d["size_bytes"]])
    ax.set_xlabel("message size")
    ax.set_ylabel("round trip, ms (lower is better)")
    ax.legend()
    finish(fig, ax, "Dask comm round trip (shm under rdmamw://)", d["source"],
           out / "dask-round-trip.png")


def _peers(d: dict, key: str, xs: list, labels: list[str]):
    """A figure with one line per system of bench/run.py (rdmamw's solid), log axes."""
    fig, ax = plt.subplots(figsize=(9, 4.4))
    for name, ys in d[key].items():
        ax.plot(xs, ys, "o-" if name.startswith("rdmamw") else "s--", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, labels)
    return fig, ax


def peers_latency(f: dict, out: Path) -> None:
    """One-way latency by message size, every system of bench/run.py on one chart."""
    d = f["peers_latency"]
    fig, ax = _peers(d, "one_way_us", d["size_bytes"], [size_label(s) for s in d["size_bytes"]])
    ax.set_xlabel("message size")
    ax.set_ylabel("one-way latency, median [µs] (log)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    finish(fig, ax, "Ping-pong latency by size (shm, 2 cores)", d["source"],
           out / "peers-latency.png")


def peers_rate(f: dict, out: Path) -> None:
    """8 B message rate by batch size, every system of bench/run.py on one chart, and
    UCX's one-sided put rate as the line to reach."""
    d = f["peers_rate"]
    fig, ax = _peers(d, "messages_per_s", d["batch"], [str(b) for b in d["batch"]])
    ax.axhline(d["ucx_put_8B_per_s"], color="0.4", linestyle=":",
               label="ucx_perftest ucp_put_bw, 8 B (C, one-sided)")
    ax.set_xlabel("messages per batch")
    ax.set_ylabel("8 B messages / s (log)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    finish(fig, ax, "8 B message rate by batch size (shm, 2 cores)", d["source"],
           out / "peers-rate.png")


PLOTS = (rate_vs_batch, stream_vs_size, allreduce, cost_per_peer, dask_round_trip,
         peers_latency, peers_rate)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--figures", type=Path, default=FIGURES)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    figures = json.loads(a.figures.read_text())
    a.out.mkdir(parents=True, exist_ok=True)
    for plot in PLOTS:
        plot(figures, a.out)
        print(f"{plot.__name__}: written")


if __name__ == "__main__":
    main()
