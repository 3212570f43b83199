"""Per-layer cost of small problems (G6, G7): is the custom call as cheap to run as XLA's GEMM?

A jitted `lax.scan` runs 1,000 layers back to back, each feeding the next (a square layer's
output is the next input; otherwise it overwrites the first min(K, N) columns of the input, the
same small update for every variant), so XLA can neither hoist nor drop any layer. Compared:
  - `x @ W` (XLA's own GEMM call),
  - XLA on `relu(x @ W + b)` (XLA's fused BIAS_RELU GEMM),
  - `jax_epilog.matmul(x, W, epilog=RELU_BIAS)`,
each as a rolled loop and unrolled by 10 (less loop control per layer). Reported: µs per layer
(loop time / layers). Results go to `<out>/overhead.{json,md,png}`.

    python benchmarks/overhead_bench.py --out benchmarks/results
    python benchmarks/overhead_bench.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable

import jax
from jax import lax

import forward_bench
import plot
import timing
from jax_epilog import Epilog

ROWS = ("G6", "G7")
SMOKE_GRID = {"S1": (64, 48, 40), "S3": (32, 32, 32)}
LAYERS = 1000
SMOKE_LAYERS = 20
UNROLLS = (1, 10)
ROUNDS = 5

LAYER_FUNCTIONS = {
    "gemm": lambda x, w, b: forward_bench.plain_gemm(x, w),
    "xla": forward_bench.xla_layer(Epilog.RELU_BIAS),
    "jax_epilog": forward_bench.epilog_layer(Epilog.RELU_BIAS),
}


def layer_loop(layer: Callable, layers: int, unroll: int) -> Callable:
    """`layers` applications of `layer`, each reading the previous one's output."""

    def feed_back(x, y):
        if x.shape == y.shape:
            return y
        width = min(x.shape[-1], y.shape[-1])
        return x.at[:, :width].set(y[:, :width])

    def loop(x, w, b):
        def step(carry, _):
            return feed_back(carry, layer(carry, w, b)), None

        return lax.scan(step, x, None, length=layers, unroll=unroll)[0]

    return loop


def run(grid: dict, rows: list[str], dtypes: list[str], layers: int,
        dump_hlo: Path | None = None) -> dict[str, Any]:
    selected = [(row, dtype) for row in rows for dtype in dtypes]
    records = []
    runs = len(selected) * len(UNROLLS) * len(LAYER_FUNCTIONS)
    with timing.progress_bar(runs, "overhead") as bar:
        for row, dtype in selected:
            shape = grid[row]
            args = forward_bench.random_inputs(shape, forward_bench.DTYPES[dtype], copies=1)[0]
            for unroll in UNROLLS:
                record = {"row": row, "shape": list(shape), "dtype": dtype,
                          "loop": f"scan unroll {unroll}", "results": {}}
                for name, layer in LAYER_FUNCTIONS.items():
                    bar.set_postfix_str(f"{row} {dtype} unroll {unroll} {name}", refresh=False)
                    jitted = jax.jit(layer_loop(layer, layers, unroll))
                    t = timing.time_calls(jitted, [args], rounds=ROUNDS, round_seconds=0.05)
                    record["results"][name] = {**t.as_dict(), "us_per_layer": t.microseconds / layers}
                    if dump_hlo is not None:  # the optimized HLO, to read what XLA made of it
                        text = jitted.lower(*args).compile().as_text()
                        dump_hlo.mkdir(parents=True, exist_ok=True)
                        (dump_hlo / f"{row}_{dtype}_unroll{unroll}_{name}.txt").write_text(text)
                    if name == "jax_epilog":
                        record["results"][name]["lowering"] = (
                            "custom call" if timing.uses_custom_call(jitted, *args)
                            else "reference lowering")
                    bar.update()
                gemm_us = record["results"]["gemm"]["us_per_layer"]
                xla_us = record["results"]["xla"]["us_per_layer"]
                for result in record["results"].values():
                    result["extra_us_vs_gemm"] = result["us_per_layer"] - gemm_us
                    result["speedup_vs_xla"] = xla_us / result["us_per_layer"]
                records.append(record)
    return {"benchmark": "overhead", "metadata": timing.run_metadata(),
            "method": {"layers": layers, "rounds": ROUNDS, "unrolls": list(UNROLLS),
                       "layer": "RELU_BIAS (gemm: x @ W only)",
                       "speedup_vs_xla": "XLA time / this time (> 1: faster than XLA)"},
            "records": records}


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    layers = report["method"]["layers"]
    lines = [
        "# Per-layer overhead of small problems",
        "",
        f"{meta['date']} · {meta['gpu_name'] or meta['device']} · driver "
        f"{meta['driver_version']} · jax {meta['jax']} / jaxlib {meta['jaxlib']} · cuBLASLt "
        f"{meta['cublaslt_version']} · custom call active: {meta['custom_call_active']}",
        "",
        f"µs per layer in a jitted `lax.scan` of {layers} layers (median of rounds); "
        "'+µs' is the extra time per layer over XLA's plain GEMM `x @ W` in the same loop.",
        "",
        "| row | dtype | B×K×N | loop | x @ W µs | XLA relu(x@W+b) µs | +µs | "
        "jax_epilog RELU_BIAS µs | +µs | vs XLA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        res = r["results"]
        ours = res["jax_epilog"]
        label = "" if ours["lowering"] == "custom call" else " (reference lowering)"
        lines.append(
            f"| {r['row']} | {r['dtype']} | {'×'.join(map(str, r['shape']))} | {r['loop']} | "
            f"{res['gemm']['us_per_layer']:.2f} | {res['xla']['us_per_layer']:.2f} | "
            f"{res['xla']['extra_us_vs_gemm']:+.2f} | {ours['us_per_layer']:.2f}{label} | "
            f"{ours['extra_us_vs_gemm']:+.2f} | {ours['speedup_vs_xla']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few layers (CPU)")
    parser.add_argument("--rows", help="comma-separated grid ids (default: G6,G7)")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated from bf16, fp16, fp32")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers per loop (default {LAYERS}; smoke {SMOKE_LAYERS})")
    parser.add_argument("--dump-hlo", type=Path, default=None,
                        help="write each loop's optimized HLO to this folder")
    args = parser.parse_args(argv)
    grid = SMOKE_GRID if args.smoke else {row: forward_bench.GRID[row] for row in ROWS}
    rows = forward_bench.choose(args.rows, grid, "rows")
    dtypes = forward_bench.choose(args.dtypes, forward_bench.DTYPES, "dtypes")
    layers = args.layers or (SMOKE_LAYERS if args.smoke else LAYERS)
    report = run(grid, rows, dtypes, layers, args.dump_hlo)
    forward_bench.write_report(report, args.out, "overhead", markdown, plot.plot_overhead)


if __name__ == "__main__":
    main()
