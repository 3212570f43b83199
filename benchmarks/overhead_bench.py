"""Per-layer cost of small problems (G6, G7): is the custom call as cheap to run as XLA's GEMM?

A jitted `lax.scan` runs 1,000 layers back to back, each feeding the next (a square layer's
output is the next input; otherwise it overwrites the first min(K, N) columns of the input, the
same small update for every variant), so XLA can neither hoist nor drop any layer. Compared:
  - `x @ W` (XLA's own GEMM call),
  - XLA on the plain layer `relu(x @ W + b)` (XLA's fused BIAS_RELU GEMM),
  - `jax_epilog.matmul(x, W, epilog=RELU_BIAS, backend="cublaslt")`,
  - `jax_epilog.dense(x, W, b, activation="relu", forward="fused")` (the layer users call),
each as a rolled loop and unrolled by 10 (less loop control per layer). Ours are forced onto the
cuBLASLt kernel: on "auto" the per-problem choice may give these small problems to XLA, and the
question is what the custom call costs. Reported: µs per layer (loop time / layers). Results go
to `<out>/overhead.{json,md,png}`, with XLA's command-buffer setting as XLA_FLAGS gave it (run
once as is and once with `XLA_FLAGS=--xla_gpu_enable_command_buffer=`, CUDA graphs off).

    python benchmarks/overhead_bench.py --out benchmarks/results
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/overhead_bench.py --out DIR
    python benchmarks/overhead_bench.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

import jax
from jax import lax

import forward_bench
import plot
import timing
import jax_epilog
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
    "jax_epilog": lambda x, w, b: jax_epilog.matmul(
        x, w, epilog=Epilog.RELU_BIAS, epilog_inputs={"bias": b}, backend="cublaslt"),
    "dense": lambda x, w, b: jax_epilog.dense(x, w, b, activation="relu", forward="fused"),
}
OURS = ("jax_epilog", "dense")  # the variants that should run the custom call
COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer"


def command_buffers(xla_flags: str) -> str:
    """XLA's command-buffer (CUDA graph) setting in `xla_flags`: "off" when the flag is given
    empty, its value when given one, else "XLA's default"."""
    value = None
    for flag in xla_flags.split():
        if flag.startswith(COMMAND_BUFFER_FLAG + "="):
            value = flag.split("=", 1)[1]  # the last one wins, as in XLA's parser
    if value is None:
        return "XLA's default"
    return value or "off"


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
                    if name in OURS:
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
    xla_flags = os.environ.get("XLA_FLAGS", "")
    return {"benchmark": "overhead", "metadata": timing.run_metadata(),
            "method": {"layers": layers, "rounds": ROUNDS, "unrolls": list(UNROLLS),
                       "layer": "RELU_BIAS (gemm: x @ W only); ours forced onto cuBLASLt",
                       "xla_flags": xla_flags, "command_buffers": command_buffers(xla_flags),
                       "speedup_vs_xla": "XLA time / this time (> 1: faster than XLA)"},
            "records": records}


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    layers = report["method"]["layers"]
    lines = [
        "# Per-layer overhead of small problems",
        "",
        timing.provenance(meta),
        "",
        f"µs per layer in a jitted `lax.scan` of {layers} layers (median of "
        f"{report['method']['rounds']} rounds); XLA command buffers (CUDA graphs): "
        f"{report['method']['command_buffers']} (XLA_FLAGS={report['method']['xla_flags']!r}). "
        "'+µs' is the extra time per layer over XLA's plain GEMM `x @ W` in the same loop; "
        "'vs XLA' is XLA's plain layer time / ours (> 1: ours faster). Ours run cuBLASLt "
        "(forced), RELU_BIAS.",
        "",
        "| row | dtype | M×K×N | loop | x @ W µs | XLA relu(x@W+b) µs | +µs | "
        "matmul µs | +µs | vs XLA | dense µs | +µs | vs XLA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        res = r["results"]
        ours = ""
        for name in OURS:
            result = res[name]
            label = "" if result["lowering"] == "custom call" else " (reference lowering)"
            ours += (f" {result['us_per_layer']:.2f}{label} | {result['extra_us_vs_gemm']:+.2f} | "
                     f"{result['speedup_vs_xla']:.3f} |")
        lines.append(
            f"| {r['row']} | {r['dtype']} | {'×'.join(map(str, r['shape']))} | {r['loop']} | "
            f"{res['gemm']['us_per_layer']:.2f} | {res['xla']['us_per_layer']:.2f} | "
            f"{res['xla']['extra_us_vs_gemm']:+.2f} |{ours}")
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
    timing.write_report(report, args.out, "overhead", markdown, plot.plot_overhead)


if __name__ == "__main__":
    main()
