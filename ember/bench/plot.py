"""PNG figures: one run's latency distributions and throughput over time; a sweep's trade-off curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display
import matplotlib.pyplot as plt  # noqa: E402


def plot_run(result: dict[str, Any], path: Path, title: str = "") -> None:
    """TTFT and TPOT histograms and output tokens/s per second of the run."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, name in ((axes[0], "ttfts", "TTFT"), (axes[1], "tpots", "TPOT")):
        values = [v * 1000.0 for v in result[key]]
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for stat, style in (("median", "--"), ("p99", ":")):
                value = result[f"{stat}_{name.lower()}_ms"]
                ax.axvline(value, color="black", linestyle=style, label=f"{stat} {value:.1f} ms")
            ax.legend()
        ax.set_title(f"{name} distribution")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("requests")
    per_second = result["output_throughput_per_second"]
    axes[2].step(range(len(per_second)), per_second, where="post", color="tab:green")
    axes[2].axhline(result["output_throughput"], color="black", linestyle="--",
                    label=f"mean {result['output_throughput']:.1f} tok/s")
    axes[2].set_title("Output tokens/s over time")
    axes[2].set_xlabel("seconds since start")
    axes[2].set_ylabel("output tok/s")
    axes[2].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_sweep(results: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """TTFT and TPOT (p50 and p99) against output throughput, one point per sweep setting."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    throughput = [r["output_throughput"] for r in results]
    for ax, name in ((axes[0], "ttft"), (axes[1], "tpot")):
        for stat, marker in (("median", "o-"), ("p99", "s--")):
            ax.plot(throughput, [r[f"{stat}_{name}_ms"] for r in results], marker,
                    label=f"{'p50' if stat == 'median' else stat} {name.upper()}")
        for r, x in zip(results, throughput, strict=True):
            ax.annotate(r["sweep_label"], (x, r[f"median_{name}_ms"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=8)
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name.upper()} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(f"{name.upper()} vs throughput")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
