"""Block-scaled FP8 GEMMs (issue 39; docs/fp8.md, "Block scaling") against per-tensor FP8 and
bf16, and the error of each on data with outlier channels.

Speed, for y = x Wᵀ with x (M, K) and W (N, K) (8192×4096×4096 and 65536×4096×4096, M×N×K),
y bfloat16, in one process on the same inputs, both harnesses of benchmarks/README.md
(careful: input copies rotated past L2; user: the same inputs every call), rounds interleaved:

- bf16: XLA's bf16 GEMM `x @ W.T` (what users have);
- tensor_fp8: `jax_epilog.matmul` of per-tensor e4m3 operands (`jax_epilog.quantize`);
- block_fp8: `jax_epilog.matmul` of block-scaled e4m3 operands: x in 1×128 tiles
  (`quantize_1x128`), W in 128×128 blocks (`quantize_128x128`);
- tensor_fp8_q, block_fp8_q: the same with the quantization of x (from bf16) in the timed
  call, as a training step pays it (W's stays outside: a step quantizes it once).

Error, against the float32 product (HIGHEST precision) of the unquantized operands: the output
y = x Wᵀ, and the weight gradient dW = dYᵀ x (dY a random gradient): per-tensor (e4m3 x and
W, e5m2 dY, as the per-tensor recipe quantizes gradients) against block-scaled (e4m3 all:
x and dY in 1×128 tiles along the contraction, W in 128×128 blocks; for dW, xᵀ and dYᵀ in
1×128 tiles along the tokens: `quantize_1x128(..., transposed=True)`), on ordinary data
(standard normal) and on outlier data (0.1% of x's channels ×1000). Relative Frobenius
errors; the issue's targets (block ≤ 0.25× per-tensor on outliers, ≤ 1× on ordinary data)
are printed met/MISSED.

    python benchmarks/block_fp8_bench.py --out benchmarks/results/block_fp8   # H200
    python benchmarks/block_fp8_bench.py --smoke --out /tmp/smoke              # any CPU

Writes `<out>/block_fp8.json` and `<out>/block_fp8.md`. A variant whose compilation warned
that cuBLASLt runs no kernel (the reference ran) is marked FALLBACK.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import timing
import jax_epilog
from jax_epilog import quantize_1x128, quantize_128x128
from jax_epilog.runtime.targets import MATMUL, MATMUL_BLOCK

ROUNDS = 7
HARNESSES = ("careful", "user")
SHAPES = [(8192, 4096, 4096), (65536, 4096, 4096)]  # (M, N, K)
ERROR_SHAPE = (8192, 4096, 4096)
SMOKE_SHAPES = [(256, 128, 256)]
SMOKE_ERROR_SHAPE = (256, 128, 1024)
OUTLIER_SHARE, OUTLIER_FACTOR = 0.001, 1000.0


def _fp8(x_quantized, w_quantized):
    """y = x Wᵀ from (x8, its scales) and (W8, its scales), per-tensor or block alike."""
    (x8, sx), (w8, sw) = x_quantized, w_quantized
    return jax_epilog.matmul(x8, w8, transpose_b=True, quantization_scales={"a": sx, "b": sw})


# Each takes (x, W, per-tensor x, per-tensor W, block x, block W); quantized ones are pairs.
VARIANTS = {
    "bf16": lambda x, w, xt, wt, xb, wb: x @ w.T,
    "tensor_fp8": lambda x, w, xt, wt, xb, wb: _fp8(xt, wt),
    "block_fp8": lambda x, w, xt, wt, xb, wb: _fp8(xb, wb),
    "tensor_fp8_q": lambda x, w, xt, wt, xb, wb: _fp8(jax_epilog.quantize(x), wt),
    "block_fp8_q": lambda x, w, xt, wt, xb, wb: _fp8(quantize_1x128(x), wb),
}


def _inputs(m: int, n: int, k: int, seed: int) -> tuple:
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    xt, wt = jax_epilog.quantize(x), jax_epilog.quantize(w)
    xb, wb = quantize_1x128(x), quantize_128x128(w)
    return jax.block_until_ready((x, w, (xt[0], xt[1]), (wt[0], wt[1]), xb, wb))


def _compile(fn, args) -> tuple[Any, list[str], str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = jax.jit(fn).lower(*args)
        compiled = lowered.compile()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    text = lowered.as_text()
    ran = ("cuBLASLt block" if MATMUL_BLOCK.name in text else
           "cuBLASLt" if MATMUL.name in text else "XLA")
    return compiled, fallbacks, ran


def measure_speed(shape: tuple[int, int, int], budget: timing.Budget) -> dict[str, Any]:
    m, n, k = shape
    copies = timing.input_copies(m * k * 2 + n * k * 2)
    arg_sets = [_inputs(m, n, k, seed) for seed in range(copies)]
    record: dict[str, Any] = {"shape": list(shape), "variants": {}}
    compiled = {}
    for name, fn in VARIANTS.items():
        compiled[name], fallbacks, ran = _compile(fn, arg_sets[0])
        for message in fallbacks:
            print(f"FALLBACK {shape} {name}: {message}", file=sys.stderr, flush=True)
        record["variants"][name] = {"fallbacks": fallbacks, "ran": ran,
                                    "temp_mib": _temp_mib(compiled[name])}
    flops = timing.gemm_flops(m, k, n)
    for harness in HARNESSES:
        runs = {name: (compiled[name], arg_sets if harness == "careful" else arg_sets[:1])
                for name in VARIANTS}
        times = timing.time_interleaved(runs, rounds=ROUNDS, round_seconds=budget.round_seconds())
        for name, t in times.items():
            result = record["variants"][name].setdefault(harness, t.as_dict())
            result["tflops"] = timing.tflops(flops, t.seconds)
            for base in ("bf16", "tensor_fp8"):
                result[f"ratio_vs_{base}"] = times[base].seconds / t.seconds
    return record


def _temp_mib(compiled):
    stats = timing.memory_analysis(compiled)
    return None if stats is None else stats["temp_size_in_bytes"] / 2**20


def _relative_error(y, exact):
    diff = jnp.linalg.norm((y.astype(jnp.float32) - exact).ravel())
    return diff / jnp.linalg.norm(exact.ravel())


@jax.jit
def _errors(x, w, dy):
    """Relative errors of y = x Wᵀ and dW = dYᵀ x, per-tensor and block-scaled FP8."""
    def exact(a, b):  # a @ bᵀ in float32
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST)

    def f32(a8, b8, sa, sb, **kw):
        return jax_epilog.matmul(a8, b8, quantization_scales={"a": sa, "b": sb},
                                 preferred_element_type=jnp.float32, **kw)

    y, dw = exact(x, w), exact(dy.T, x.T)  # dW (N, K)
    x8, sx = jax_epilog.quantize(x)
    w8, sw = jax_epilog.quantize(w)
    g8, sg = jax_epilog.quantize(dy, "float8_e5m2")
    tensor = (f32(x8, w8, sx, sw, transpose_b=True), f32(g8, x8, sg, sx, transpose_a=True))
    xb8, sxb = quantize_1x128(x)
    wb8, swb = quantize_128x128(w)
    gt8, sgt = quantize_1x128(dy, transposed=True)  # dYᵀ (N, M), tiles along M
    xt8, sxt = quantize_1x128(x, transposed=True)   # xᵀ (K, M), tiles along M
    block = (f32(xb8, wb8, sxb, swb, transpose_b=True), f32(gt8, xt8, sgt, sxt, transpose_b=True))
    return {f"{what}_{kind}": _relative_error(v, ref)
            for kind, values in (("tensor", tensor), ("block", block))
            for what, v, ref in zip(("y", "dw"), values, (y, dw))}


def measure_errors(shape: tuple[int, int, int]) -> dict[str, Any]:
    m, n, k = shape
    keys = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(keys[1], (n, k), jnp.float32) / np.sqrt(k)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32)
    ordinary = jax.random.normal(keys[0], (m, k), jnp.float32)
    count = max(1, round(OUTLIER_SHARE * k))
    channels = np.random.default_rng(0).choice(k, count, replace=False)
    outliers = ordinary.at[:, channels].multiply(OUTLIER_FACTOR)
    report = {"shape": list(shape), "outlier_channels": count}
    for name, x in (("ordinary", ordinary), ("outliers", outliers)):
        report[name] = {key: float(v) for key, v in _errors(x, w, dy).items()}
    return report


def targets(errors: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for data, least in (("outliers", 0.25), ("ordinary", 1.0)):
        for what in ("y", "dw"):
            e = errors[data]
            ratio = e[f"{what}_block"] / e[f"{what}_tensor"]
            rows.append({"what": f"{data} {what} error block/per-tensor", "ratio": ratio,
                         "at_most": least, "met": ratio <= least})
    return rows


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = ["# Block-scaled FP8 GEMMs against per-tensor FP8 and bf16", "",
             timing.provenance(meta), "",
             "| M×N×K | variant | ran | careful ms | TFLOP/s | ×bf16 | ×tensor_fp8 | user ms "
             "| ×bf16 | ×tensor_fp8 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["speed"]:
        for name, v in row["variants"].items():
            c, u = v.get("careful", {}), v.get("user", {})
            flag = " FALLBACK" if v["fallbacks"] else ""
            lines.append(
                f"| {'×'.join(map(str, row['shape']))} | {name}{flag} | {v['ran']} | "
                f"{c.get('seconds', 0) * 1e3:.3f} | {c.get('tflops', 0):.0f} | "
                f"{c.get('ratio_vs_bf16', 0):.3f} | {c.get('ratio_vs_tensor_fp8', 0):.3f} | "
                f"{u.get('seconds', 0) * 1e3:.3f} | {u.get('ratio_vs_bf16', 0):.3f} | "
                f"{u.get('ratio_vs_tensor_fp8', 0):.3f} |")
    e = report["errors"]
    lines += ["", f"## Error against float32 ({'×'.join(map(str, e['shape']))}, "
              f"{e['outlier_channels']} outlier channels ×{OUTLIER_FACTOR:g})", "",
              "| data | y per-tensor | y block | dW per-tensor | dW block |", "|---|---|---|---|---|"]
    for data in ("ordinary", "outliers"):
        d = e[data]
        lines.append(f"| {data} | {d['y_tensor']:.3e} | {d['y_block']:.3e} | "
                     f"{d['dw_tensor']:.3e} | {d['dw_block']:.3e} |")
    lines += ["", "## Targets", ""]
    lines += [f"- {t['what']}: {t['ratio']:.3f} (at most {t['at_most']}): "
              f"{'met' if t['met'] else 'MISSED'}" for t in report["targets"]]
    return "\n".join(lines + timing.footnotes(meta, [])) + "\n"


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any CPU")
    parser.add_argument("--max-s", type=float, default=240.0)
    args = parser.parse_args(argv)
    shapes, error_shape = (SMOKE_SHAPES, SMOKE_ERROR_SHAPE) if args.smoke else \
        (SHAPES, ERROR_SHAPE)
    budget = timing.Budget(args.max_s, len(HARNESSES) * len(shapes), rounds=len(VARIANTS) * ROUNDS)
    report: dict[str, Any] = {"benchmark": "block_fp8", "metadata": timing.run_metadata(),
                              "speed": []}
    report["errors"] = measure_errors(error_shape)
    report["targets"] = targets(report["errors"])
    for shape in shapes:
        report["speed"].append(measure_speed(shape, budget))
        timing.write_report(report, args.out, "block_fp8", markdown)
    timing.write_report(report, args.out, "block_fp8", markdown)
    for t in report["targets"]:
        print(f"target {t['what']}: {t['ratio']:.3f} <= {t['at_most']}: "
              f"{'met' if t['met'] else 'MISSED'}")
    return report


if __name__ == "__main__":
    main()
