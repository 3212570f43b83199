"""The weight-only kernel's tilings (`jax_epilog.kernels.weight_only`) at decode shapes,
against XLA's bf16 GEMM and XLA's own weight-only fusion, `gelu(x @ w + b)` (tanh GELU).

For each weight shape (K x N: a Llama FFN's up and down projections and a square one) the
whole grid of `Config`s is timed at 16 rows, then the best few at every row count. Each
call runs `LAYERS` such layers, each on its own weight, under one `jax.jit` (a decode step
runs many layers per call, so the host's dispatch, tens of microseconds, overlaps the
kernels instead of being what is timed); a layer is the kernel, then sum, scale, bias and
GELU in one XLA fusion. No weight is read twice in a row, so none comes from the 50 MiB L2.
Careful harness only: this sweep chooses the kernel's default tiling;
benchmarks/serving_bench.py measures the layer in both harnesses. Every variant's output is checked against XLA's weight-only one.

    python benchmarks/weight_only_sweep.py --out benchmarks/results/weight_only   # H200
    python benchmarks/weight_only_sweep.py --smoke --out /tmp/weight_only         # any CPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import timing  # benchmarks/timing.py
from jax_epilog.kernels import weight_only as kernel

SHAPES = {"K4096xN14336": (4096, 14336), "K14336xN4096": (14336, 4096),
          "K8192xN8192": (8192, 8192)}
ROWS = (1, 16, 64)
SWEEP_ROWS = 16
GRID = dict(block_n=(32, 64, 128), block_k=(256, 512), split_k=(1, 2, 4), num_warps=(4,),
            num_stages=(3, 5), swap=(False, True))
BEST = 4
#: Layers per call, each with its own weight (8 FP8 weights of K4096 x N14336: 470 MB).
LAYERS = 8


def configs(k: int, n: int) -> list[kernel.Config]:
    names = list(GRID)
    every = (kernel.Config(**dict(zip(names, values)))
             for values in itertools.product(*GRID.values()))
    return [c for c in every if kernel.fits(k, n, c)]


def config_name(c: kernel.Config) -> str:
    return (f"n{c.block_n} k{c.block_k} split{c.split_k} warps{c.num_warps} "
            f"stages{c.num_stages}{' swap' if c.swap else ''}")


def layers(config: Optional[kernel.Config], interpret: bool = False):
    """`LAYERS` served layers in one jitted call (as in a decode step, whose host dispatch
    then overlaps many kernels), each on its own weight: the kernel with `config`, XLA's
    weight-only fusion (None) or, with 16-bit weights, XLA's bf16 GEMM ("bf16")."""
    def forward(x, weights):
        out = []
        for weight in weights:
            if config == "bf16":
                w, b = weight
                out.append(jax.nn.gelu(x @ w + b))
                continue
            data, scale, b = weight
            if config is None:
                z = jax.lax.dot_general(x, data.astype(x.dtype), (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32)
            else:
                z = kernel.product(x, data, config=config, interpret=interpret)
            out.append(jax.nn.gelu(z * scale + b).astype(x.dtype))
        return out
    return jax.jit(forward)


def runnable(grid: dict, weights: tuple, rows: int, k: int) -> dict:
    """The configs that compile and run (some ask for more shared memory than there is)."""
    x = jnp.ones((rows, k), jnp.bfloat16)
    kept = {}
    for name, (fn, kind) in grid.items():
        try:
            jax.block_until_ready(fn(x, weights))
            kept[name] = (fn, kind)
        except jax.errors.JaxRuntimeError as error:
            print(f"  {name}: {str(error).splitlines()[0][:120]}", flush=True)
    return kept


def measure(variants: dict, weights: dict, rows: int, k: int, seconds: float) -> dict:
    """Microseconds per layer, the ratio to XLA's bf16 and the error against XLA's
    weight-only output."""
    x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
    calls = {name: (fn, [(x, weights[kind])]) for name, (fn, kind) in variants.items()}
    times = timing.time_interleaved(calls, rounds=5, round_seconds=seconds)
    want = np.asarray(variants["xla_weight_only"][0](x, weights["fp8"])[0], np.float32)
    out = {}
    for name, (fn, kind) in variants.items():
        got = np.asarray(fn(x, weights[kind])[0], np.float32)
        out[name] = {"us": times[name].microseconds / len(weights[kind]),
                     "ratio": times["xla_bf16"].seconds / times[name].seconds,
                     "error": float(np.max(np.abs(got - want)) / np.max(np.abs(want)))}
    return out


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weight_only"))
    parser.add_argument("--round-seconds", type=float, default=0.01)
    parser.add_argument("--smoke", action="store_true",
                        help="one small shape, the kernel interpreted (any CPU)")
    args = parser.parse_args(argv)
    shapes = {"K512xN256": (512, 256)} if args.smoke else SHAPES
    report = {"meta": timing.run_metadata(), "rows": []}
    lines = ["| shape | M | variant | us | vs bf16 | error |", "|---|---|---|---|---|---|"]
    for shape, (k, n) in shapes.items():
        start = time.perf_counter()
        count = 2 if args.smoke else LAYERS
        w = [jax.random.normal(jax.random.key(10 + i), (k, n), jnp.bfloat16) * k ** -0.5
             for i in range(count)]
        b = jax.random.normal(jax.random.key(20), (n,), jnp.bfloat16) * 0.1
        scale = jnp.float32(0.01)
        weights = {"bf16": [(wi, b) for wi in w],
                   "fp8": [(jnp.asarray(wi.T.astype(jnp.float32) / scale, jnp.float8_e4m3fn),
                            scale, b) for wi in w]}
        base = {"xla_bf16": (layers("bf16"), "bf16"), "xla_weight_only": (layers(None), "fp8")}
        grid = runnable({config_name(c): (layers(c, args.smoke), "fp8")
                         for c in configs(k, n)[:3 if args.smoke else None]},
                        weights["fp8"], SWEEP_ROWS, k)
        swept = measure({**base, **grid}, weights, SWEEP_ROWS, k, args.round_seconds)
        best = sorted(grid, key=lambda name: swept[name]["us"])[:BEST]
        print(f"{shape}: swept {len(grid)} configs at M{SWEEP_ROWS} in "
              f"{time.perf_counter() - start:.0f} s; best {best[0]} "
              f"{swept[best[0]]['ratio']:.2f}x bf16", flush=True)
        for rows in ROWS:
            kept = runnable({name: grid[name] for name in best}, weights["fp8"], rows, k)
            row = swept if rows == SWEEP_ROWS else measure({**base, **kept}, weights, rows, k,
                                                          args.round_seconds)
            for name in ("xla_bf16", "xla_weight_only", *kept):
                r = row[name]
                report["rows"].append({"shape": shape, "M": rows, "variant": name, **r})
                lines.append(f"| {shape} | {rows} | {name} | {r['us']:.1f} | {r['ratio']:.2f} "
                             f"| {r['error']:.4f} |")
            print("\n".join(lines[-(2 + len(kept)):]), flush=True)
    report["table"] = lines
    timing.write_report(report, args.out, "weight_only_sweep", lambda r: "\n".join(r["table"]) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
