"""The served FP8 GEMM of few rows' Pallas kernel against XLA, at each tiling, at decode sizes.

`gelu(x @ (scale · W8)ᵀ + b)` for x (M, K) bf16 with M from 1 to 64 and W8 an FP8 weight
stored `(N, K)`, at the shapes of a Llama-8B-sized layer (K4096×N14336, K14336×N4096,
K4096×N4096) and K8192×N8192. Variants, each timed over `LAYERS` layers per call (each with
its own weight and input, as a decode step runs a model; serving_bench.py's `stacked`):
- xla_bf16: `jax.nn.gelu(x @ w + b)`, bf16 weights (the baseline);
- weight_only_xla: XLA's weight-only GEMM (`serving.weight_only`);
- xla_fp8: XLA's own FP8 dot of the quantized input (serving_bench.py's `xla_fp8_dense`);
- fp8k b{block_n}k{block_k}w{warps}s{stages}[x{split_k}]: `few_rows_fp8_kernel.few_rows_fp8_gemm`, both
  operands FP8, x quantized per tensor by the kernel itself from its rows' amaxes (one XLA
  reduction; as the served layers run it), with that tiling; `fp8k_default` the tiling it
  picks by itself (`default_tiling`); `fp8k_default_xla_quantized` the kernel with x quantized
  by XLA before it (as xla_fp8's is: three more kernels a layer).

At the first of `--rows` every tiling of the grid runs; at the other rows the three fastest
of those (careful harness) and the default. Both harnesses of benchmarks/README.md. Reported
per layer: ms, the ratio to xla_bf16 (user harness in brackets), the FP8 weight's GB/s, and
the error against weight_only_xla (max |y - y_xla| / max |y_xla|).

    python benchmarks/few_rows_tuning.py --out /tmp/few          # H200: about 2 min
    python benchmarks/few_rows_tuning.py --smoke --out /tmp/few  # CPU: the interpreter
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import timing  # benchmarks/timing.py
import jax_epilog
from jax_epilog.float8 import scaling
from jax_epilog.float8.few_rows_fp8_kernel import (SHARED_MEMORY, Tiling, default_tiling,
                                                   few_rows_fp8_gemm, row_amax, stage_bytes)
from jax_epilog.layers import serving
from serving_bench import layer_inputs, normal, stacked, xla_fp8_dense

SHAPES = {"K4096xN14336": (4096, 14336), "K14336xN4096": (14336, 4096),
          "K4096xN4096": (4096, 4096), "K8192xN8192": (8192, 8192)}
ROWS = (16, 1, 64)
LAYERS = 8
GRID = [Tiling(n, k, w, s) for n, k, (w, s) in itertools.product(
    (32, 64, 128), (128, 256), ((4, 3), (4, 5)))] + [
    Tiling(n, 256, w, s, split) for n, (w, s), split in itertools.product(
        (64, 128), ((4, 3), (4, 5)), (2, 4))]
SMOKE = dict(shapes={"K64xN96": (64, 96)}, rows=(16, 3), layers=2,
             grid=[Tiling(32, 32, 4, 2), Tiling(32, 64, 4, 2), Tiling(32, 32, 4, 2, 2)])
FINALISTS = 3


def name(t: Tiling) -> str:
    split = f"x{t.split_k}" if t.split_k > 1 else ""
    return f"fp8k b{t.block_n}k{t.block_k}w{t.num_warps}s{t.num_stages}{split}"


def layers(k: int, n: int, count: int):
    """(bf16 layers [(w (K, N), b)], stored layers [(Fp8Weight, b)])."""
    ws = [normal(1 + i, (k, n), k ** -0.5) for i in range(count)]
    b = normal(100, (n,), 0.1)
    stored = [jax_epilog.quantize_params({"kernel": w}, include=lambda path, leaf: True)["kernel"]
              for w in ws]
    return [(w, b) for w in ws], [(s, b) for s in stored]


def variants(bf16, fp8, tilings, rows: int, interpret: bool) -> dict:
    """name: (jitted fn of (x, layers), layers)."""
    def kernel(tiling, quantized_by_xla: bool = False):
        def layer(x, s, b):
            if quantized_by_xla:
                x8, sx = scaling.quantize(x, scaling.amax(x), "float8_e4m3fn", 0)
                return few_rows_fp8_gemm(x8, sx, s.data, s.scale, b, activation="gelu",
                                         tiling=tiling, interpret=interpret)
            return few_rows_fp8_gemm(x, None, s.data, s.scale, b, row_amax=row_amax(x),
                                     activation="gelu", input_scaling="tensor",
                                     tiling=tiling, interpret=interpret)
        return layer

    out = {
        "xla_bf16": (stacked(lambda x, w, b: jax.nn.gelu(x @ w + b)), bf16),
        "weight_only_xla": (stacked(lambda x, s, b: serving.weight_only(x, s, b, "gelu")),
                            fp8),
        "xla_fp8": (stacked(xla_fp8_dense), fp8),
        "fp8k_default": (stacked(kernel(None)), fp8),
        "fp8k_default_xla_quantized": (stacked(kernel(None, True)), fp8),
    }
    n, k = fp8[0][0].data.shape
    out.update({name(t): (stacked(kernel(t)), fp8) for t in tilings
                if n % t.block_n == 0 and k % (t.block_k * t.split_k) == 0
                and fits_shared_memory(t, rows)})
    return out


def fits_shared_memory(t: Tiling, rows: int) -> bool:
    """Whether the tiling's stages fit a program's shared memory with a 16-bit x (5 stages of
    64 rows did not, and the launch failure ended the run of 2026-12-05 10:16)."""
    return t.num_stages * stage_bytes(rows, t.block_n, t.block_k, 2) <= SHARED_MEMORY


def measure(fns: dict, rows: int, k: int, weight_bytes: int, count: int,
            rounds: int) -> dict[str, Any]:
    xs = [layer_inputs(10 + i, (rows, k), count)
          for i in range(timing.input_copies(rows * k * 2 * count))]
    careful = timing.time_interleaved({n: (fn, [(x, ws) for x in xs])
                                       for n, (fn, ws) in fns.items()}, rounds=rounds)
    user = {n: timing.time_calls(fn, [(xs[0], ws)], rounds=rounds) for n, (fn, ws) in fns.items()}
    out = {n: np.asarray(jnp.stack(fn(xs[0], ws)).astype(jnp.float32)) for n, (fn, ws) in fns.items()}
    want = out["weight_only_xla"]
    row = {}
    for n in fns:
        seconds = careful[n].seconds / count
        row[n] = {"careful_ms": seconds * 1e3, "user_ms": user[n].seconds / count * 1e3,
                  "careful_ratio": careful["xla_bf16"].seconds / careful[n].seconds,
                  "user_ratio": user["xla_bf16"].seconds / user[n].seconds,
                  "weight_gb_per_s": weight_bytes / seconds / 1e9,
                  "error": float(np.max(np.abs(out[n] - want)) / np.max(np.abs(want)))}
    return row


def render(report: dict) -> str:
    lines = ["# The served FP8 GEMM of few rows: Pallas kernel tilings against XLA", "",
             timing.provenance(report["meta"]), "",
             "Per layer; ratio to xla_bf16, careful harness (user harness in brackets); GB/s: "
             "the FP8 weight's bytes over the careful time; error against weight_only_xla.", ""]
    for r in report["rows"]:
        lines += [f"## {r['shape']}, M {r['M']} (default tiling {r['default_tiling']})", "",
                  "| variant | ms | ratio | GB/s | error |", "|---|---|---|---|---|"]
        for n, v in sorted(r["variants"].items(), key=lambda kv: kv[1]["careful_ms"]):
            lines.append(f"| {n} | {v['careful_ms']:.4f} | {v['careful_ratio']:.2f} "
                         f"({v['user_ratio']:.2f}) | {v['weight_gb_per_s']:.0f} | "
                         f"{v['error']:.4f} |")
        lines.append("")
    return "\n".join(lines + timing.footnotes(report["meta"], [])) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, the interpreter")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", type=lambda text: text.split(","),
                        help=f"default {','.join(SHAPES)}")
    parser.add_argument("--rows", type=lambda text: tuple(int(r) for r in text.split(",")),
                        help=f"default {','.join(map(str, ROWS))}; the grid runs at the first")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.shapes or ()) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES)}")
    grid = SMOKE if args.smoke else dict(
        shapes={s: SHAPES[s] for s in args.shapes or SHAPES}, rows=args.rows or ROWS,
        layers=LAYERS, grid=GRID)
    interpret = jax.default_backend() != "gpu"
    report: dict[str, Any] = {"meta": timing.run_metadata(), "rows": []}
    for shape, (k, n) in grid["shapes"].items():
        bf16, fp8 = layers(k, n, grid["layers"])
        tilings = grid["grid"]
        for i, rows in enumerate(grid["rows"]):
            fns = variants(bf16, fp8, tilings, rows, interpret)
            row = measure(fns, rows, k, n * k, grid["layers"], args.rounds)
            report["rows"].append({"shape": shape, "M": rows, "variants": row,
                                   "default_tiling": name(default_tiling(rows, k, n, 2))})
            print(shape, rows, {v: round(r["careful_ratio"], 2) for v, r in row.items()},
                  flush=True)
            if i == 0:  # the other rows time the fastest few
                tilings = sorted((t for t in tilings if name(t) in row),
                                 key=lambda t: row[name(t)]["careful_ms"])[:FINALISTS]
            timing.write_report(report, args.out, "few_rows_tuning", render)
    return report


if __name__ == "__main__":
    main()
