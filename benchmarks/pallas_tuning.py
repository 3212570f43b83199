"""The block recipe's Pallas (Triton) quantization kernel against XLA's fusion, at each warp count.

`block_kernel.quantize_both`, a tensor x (rows, K) into both its 1×128 copies (the block
recipe's layer inputs and gradients), at the shapes of the example's `large` config: `plain`
(x itself), `gelu` (gelu(Z), the forward's prologue) and `gelu_backward` (dY · gelu'(Z) with
the column sums, the backward's); against `blocks.quantize_1x128_both(kernel="xla")`.

The kernel runs with 4, 8 and 16 warps per program (`Prologue.num_warps` is the default) and
must give the default's bytes and scales (the column sums, a float32 reduction in another
order, within 1e-4). Both harnesses of benchmarks/README.md: careful (inputs rotated past L2,
variants interleaved) and user (one input). GB/s counts each input read once and each output
written once.

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
from jax_epilog.float8 import block_kernel, blocks

WARPS = (4, 8, 16)
HARNESSES = ("careful", "user")
ROUNDS = 7
BLOCK_SHAPES = ((16384, 16384), (16384, 4096))
SMOKE_BLOCK_SHAPES = ((256, 384),)
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
    return variants, arg_sets, moved, prologue.num_warps


def _same(outputs, reference) -> bool:
    """The 1-byte copies and scales equal, the column sums (if any) within 1e-4."""
    out, ref = jax.tree.leaves(outputs), jax.tree.leaves(reference)
    as_bytes = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)
                                    if a.dtype.itemsize == 1 else a)
    return all(np.array_equal(as_bytes(a), as_bytes(b)) for a, b in zip(out[:4], ref[:4])) \
        and all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(out[4:], ref[4:]))


def measure(case: str, variants, arg_sets, moved: int, default_warps: int,
            budget) -> dict[str, Any]:
    record: dict[str, Any] = {"case": case, "bytes_moved": moved, "variants": {}}
    default = f"pallas_w{default_warps}"
    reference = variants[default](*arg_sets[0])
    for name, fn in variants.items():
        same = name == "xla" or _same(fn(*arg_sets[0]), reference)
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
             "| case | variant | same as the default | careful ms | GB/s | ×xla | user ms | ×xla |",
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
    block_shapes = SMOKE_BLOCK_SHAPES if args.smoke else BLOCK_SHAPES
    interpret = jax.default_backend() != "gpu"
    cases = [(f"quantize_both {p} {r}×{k}", *_block_case((r, k), p, interpret))
             for r, k in block_shapes for p in PROLOGUES]
    budget = timing.Budget(args.max_s, len(cases) * len(HARNESSES),
                           rounds=(len(WARPS) + 1) * ROUNDS)
    report: dict[str, Any] = {"benchmark": "pallas_tuning", "metadata": timing.run_metadata(),
                              "cases": []}
    for name, variants, arg_sets, moved, default_warps in cases:
        report["cases"].append(measure(name, variants, arg_sets, moved, default_warps, budget))
        timing.write_report(report, args.out, "pallas_tuning", markdown)
    return report


if __name__ == "__main__":
    main()
