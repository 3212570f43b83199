"""Plots of the benchmark reports (matplotlib, no display needed).

Called by the benchmarks after each run; also re-plots a saved report:

    python benchmarks/plot.py benchmarks/results/forward.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

COLOURS = {"gemm": "0.6", "xla": "tab:blue", "jax_epilog": "tab:green", "nvmath": "tab:orange"}
LABELS = {"gemm": "plain GEMM (x @ W)", "xla": "XLA, plain-JAX expression",
          "jax_epilog": "jax_epilog.matmul", "nvmath": "nvmath-python"}


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=LABELS.get(name, name), color=COLOURS.get(name))
    ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plot_forward(report: dict, path: Path) -> None:
    """One panel per epilog: TFLOP/s of each implementation on each (row, dtype)."""
    epilogs = list(dict.fromkeys(r["epilog"] for r in report["records"]))
    fig, axes = plt.subplots(len(epilogs), 1, figsize=(12, 3.2 * len(epilogs)), squeeze=False)
    for ax, epilog in zip(axes[:, 0], epilogs):
        records = [r for r in report["records"] if r["epilog"] == epilog]
        groups = [f"{r['row']} {r['dtype']}" for r in records]
        series = {"gemm": [r["gemm"]["tflops"] for r in records]}
        for name in ("xla", "jax_epilog", "nvmath"):
            if any("tflops" in r["results"].get(name, {}) for r in records):
                series[name] = [r["results"].get(name, {}).get("tflops", 0.0) for r in records]
        _bars(ax, groups, series, "TFLOP/s")
        ax.set_title(epilog, fontsize=10)
    axes[0, 0].legend(fontsize=8, ncol=4, loc="lower right")
    meta = report["metadata"]
    fig.suptitle(f"Forward epilogs · {meta['gpu_name'] or meta['device']} · "
                 f"jax {meta['jax']} · {meta['date']}"
                 + ("" if meta["custom_call_active"] else
                    " · jax_epilog ran its reference lowering (no CUDA custom call)"),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overhead(report: dict, path: Path) -> None:
    """Microseconds per layer of each implementation, per (row, dtype, loop form)."""
    records = report["records"]
    groups = [f"{r['row']} {r['dtype']} {r['loop']}" for r in records]
    names = list(dict.fromkeys(name for r in records for name in r["results"]))
    series = {name: [r["results"].get(name, {}).get("us_per_layer", 0.0) for r in records]
              for name in names}
    fig, ax = plt.subplots(figsize=(8, 4))
    _bars(ax, groups, series, "µs per layer")
    ax.legend(fontsize=8)
    meta = report["metadata"]
    ax.set_title(f"Per-layer time in a {report['method']['layers']}-layer loop · "
                 f"{meta['gpu_name'] or meta['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTTERS = {"forward": plot_forward, "overhead": plot_overhead}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/plot.py <report.json>")
    source = Path(argv[0])
    report = json.loads(source.read_text())
    kind = report.get("benchmark")
    if kind not in PLOTTERS:
        raise SystemExit(f"{source}: expected a report with benchmark in {list(PLOTTERS)}, "
                         f"got {kind!r}")
    PLOTTERS[kind](report, source.with_suffix(".png"))
    print(f"wrote {source.with_suffix('.png')}")


if __name__ == "__main__":
    main(sys.argv[1:])
