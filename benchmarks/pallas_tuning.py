"""The package's Pallas (Triton) quantization kernels against XLA's fusions, at each warp count.

Two kernels, at the shapes of the example's `large` configs:

- `block_kernel.quantize_both`, a tensor x (rows, K) into both its 1×128 copies (the block
  recipe's layer inputs and gradients): `plain` (x itself), `gelu` (gelu(Z), the forward's
  prologue) and `gelu_backward` (dY · gelu'(Z) with the column sums, the backward's);
  against `blocks.quantize_1x128_both(kernel="xla")`.
- `swiglu_kernel.quantize_gradient`, SwiGLU's backward `[dg du]` into e5m2 with its transpose,
  against XLA's fusions (`layers.swiglu`'s "xla" path, with the transposed copy materialized
  as the weight gradient's GEMM reads it).

Each Pallas variant runs with 4, 8 and 16 warps per program (`NUM_WARPS` is the default),
the SwiGLU kernel also with 64 and 32 rows per tile (`_r64`, `_r32`), and must give the
bytes of the default. Both harnesses of benchmarks/README.md: careful
(inputs rotated past L2, variants interleaved) and user (one input). GB/s counts each input
read once and each output written once.

    python benchmarks/pallas_tuning.py --out /tmp/tuning            # on the GPU
    python benchmarks/pallas_tuning.py --smoke --out /tmp/tuning    # CPU: the interpreter
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import timing
from jax_epilog.float8 import block_kernel, blocks, swiglu_kernel
from jax_epilog.float8.scaling import quantize_scaled
from jax_epilog.layers.swiglu import _hidden_gradient

WARPS = (4, 8, 16)
#: The SwiGLU kernel's rows per tile (`_rN` in a variant's name where not the default).
TILE_ROWS = (128, 64, 32)
HARNESSES = ("careful", "user")
ROUNDS = 7
BLOCK_SHAPES = ((16384, 16384), (16384, 4096))
SWIGLU_SHAPE = (16384, 14336)
SMOKE_BLOCK_SHAPES = ((256, 384),)
SMOKE_SWIGLU_SHAPE = (256, 384)
PROLOGUES = {"plain": (None, False), "gelu": ("gelu", False), "gelu_backward": ("gelu", True)}


def _block_case(shape, prologue_name: str, interpret: bool):
    """(variants {name: fn}, argument sets, bytes moved) for one quantize_both case."""
    activation, derivative = PROLOGUES[prologue_name]
    rows, k = shape
    inputs = 2 if derivative else 1
    moved = rows * k * (2 * inputs + 2) + 2 * 4 * rows * k // blocks.BLOCK + 4 * k * derivative
    copies = timing.input_copies(rows * k * 2 * inputs)
    arg_sets = [tuple(jax.random.normal(jax.random.key(seed * 2 + i), shape, jnp.bfloat16)
                      for i in range(inputs)) for seed in range(copies)]

    def xla(x, *z):
        return blocks.quantize_1x128_both(x, kernel="xla", activation=activation,
                                          pre_activation=z[0] if z else None,
                                          column_sums=derivative)

    prologue = block_kernel.Prologue(activation, derivative, "bfloat16")
    variants = {"xla": jax.jit(xla)}
    for warps in WARPS:
        variants[f"pallas_w{warps}"] = jax.jit(functools.partial(
            block_kernel.quantize_both, dtype="float8_e4m3fn", prologue=prologue,
            sums=derivative, interpret=interpret, num_warps=warps))
    return variants, arg_sets, moved


def _swiglu_case(shape, interpret: bool):
    m, f = shape
    moved = m * f * (2 + 1 + 1) + 2 * 2 * m * f  # read dh, g8, u8; write [dg du] and its transpose
    copies = timing.input_copies(m * f * 4)
    arg_sets = []
    for seed in range(copies):
        keys = jax.random.split(jax.random.key(seed), 3)
        dh = jax.random.normal(keys[0], shape, jnp.bfloat16)
        (g8, gs), (u8, us) = (quantize_scaled(jax.random.normal(k, shape) * 3, "float8_e4m3fn", 0)
                              [:2] for k in keys[1:])
        arg_sets.append((dh, g8, gs, u8, us))

    def xla(dh, g8, gs, u8, us):
        g, u = g8.astype(jnp.float32) * gs, u8.astype(jnp.float32) * us
        dgu8, scale, amax = quantize_scaled(_hidden_gradient(dh, g, u, dh.dtype), "float8_e5m2", 0)
        return dgu8, dgu8.T, scale, amax

    variants = {"xla": jax.jit(xla)}
    for rows in TILE_ROWS:
        for warps in WARPS:
            suffix = "" if rows == swiglu_kernel.TILE_ROWS else f"_r{rows}"
            variants[f"pallas_w{warps}{suffix}"] = jax.jit(functools.partial(
                swiglu_kernel.quantize_gradient, fmt="float8_e5m2", margin=0, amax_axes=None,
                dtype="bfloat16", interpret=interpret, num_warps=warps, tile_rows=rows))
    return variants, arg_sets, moved


def _bytes(outputs) -> list[np.ndarray]:
    return [np.asarray(jax.lax.bitcast_convert_type(o, jnp.uint8) if o.dtype.itemsize == 1
                       else o) for o in jax.tree.leaves(outputs)]


def measure(case: str, variants, arg_sets, moved: int, default_warps: int,
            budget) -> dict[str, Any]:
    record: dict[str, Any] = {"case": case, "bytes_moved": moved, "variants": {}}
    default = f"pallas_w{default_warps}"
    reference = _bytes(variants[default](*arg_sets[0]))
    for name, fn in variants.items():
        got = _bytes(fn(*arg_sets[0]))
        same = name == "xla" or all(np.array_equal(a, b) for a, b in zip(got, reference))
        record["variants"][name] = {"same_bytes_as_default": same}
    for harness in HARNESSES:
        runs = {n: (fn, arg_sets if harness == "careful" else arg_sets[:1])
                for n, fn in variants.items()}
        times = timing.time_interleaved(runs, rounds=ROUNDS, round_seconds=budget.round_seconds())
        for name, t in times.items():
            record["variants"][name][harness] = {
                **t.as_dict(), "gb_per_s": moved / t.seconds / 1e9,
                "ratio_vs_xla": times["xla"].seconds / t.seconds}
    return record


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Pallas quantization kernels: warps per program against XLA", "",
             timing.provenance(report["metadata"]), "",
             "| case | variant | bytes as the default | careful ms | GB/s | ×xla | user ms | ×xla |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        for name, v in r["variants"].items():
            c, u = v["careful"], v["user"]
            lines.append(f"| {r['case']} | {name} | {'yes' if v['same_bytes_as_default'] else 'NO'}"
                         f" | {c['seconds'] * 1e3:.3f} | {c['gb_per_s']:.0f} | "
                         f"{c['ratio_vs_xla']:.3f} | {u['seconds'] * 1e3:.3f} | "
                         f"{u['ratio_vs_xla']:.3f} |")
    return "\n".join(lines + [""])


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, the interpreter")
    parser.add_argument("--max-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    block_shapes, swiglu_shape = ((SMOKE_BLOCK_SHAPES, SMOKE_SWIGLU_SHAPE) if args.smoke
                                  else (BLOCK_SHAPES, SWIGLU_SHAPE))
    interpret = jax.default_backend() != "gpu"
    cases = [(f"quantize_both {p} {r}×{k}", *_block_case((r, k), p, interpret),
              block_kernel.NUM_WARPS) for r, k in block_shapes for p in PROLOGUES]
    cases.append((f"swiglu gradient {swiglu_shape[0]}×{swiglu_shape[1]}",
                  *_swiglu_case(swiglu_shape, interpret), swiglu_kernel.NUM_WARPS))
    budget = timing.Budget(args.max_s, len(cases) * len(HARNESSES),
                           rounds=(len(WARPS) + 1) * ROUNDS * 2)
    report: dict[str, Any] = {"benchmark": "pallas_tuning", "metadata": timing.run_metadata(),
                              "cases": []}
    for name, variants, arg_sets, moved, default_warps in cases:
        report["cases"].append(measure(name, variants, arg_sets, moved, default_warps, budget))
        timing.write_report(report, args.out, "pallas_tuning", markdown)
    return report


if __name__ == "__main__":
    main()
