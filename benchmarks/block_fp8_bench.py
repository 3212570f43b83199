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

Training step (row M1: 4 ReLU layers 4096 wide, batch 65536; `jax.value_and_grad` of a
squared error, as benchmarks/fp8_bench.py times it, whose `measure` this reuses: both
harnesses, temporaries from XLA's memory analysis, GEMM counts, the difference from XLA):

- xla_bf16: the plain JAX stack under XLA (what users have);
- ours_fp8: `mlp(..., fp8=True)`, our per-tensor recipe (current scaling, functional);
- ours_fp8_stateful: the same with `fp8_state=`, as the Flax modules run `fp8=True` (delayed
  scaling, timed warm);
- ours_fp8_block: `mlp(..., fp8=Fp8(scaling="block", layers="all"))`, the block-scaled
  recipe (x and dZ quantized by `blocks.BOTH_COPIES`' default, "pallas");
- ours_fp8_block_xla, ours_fp8_block_separate: the same with `BOTH_COPIES` "xla" and
  "xla_separate" (the previous formulation) (`--step-variants` picks a subset).

Quantization (`--parts quantize`): M1's x (65536×4096 bf16) into both its 1×128 copies
(`quantize_1x128_both`: x8 along K, xᵀ8 along the tokens, their scales), each kernel of
`blocks.BOTH_COPIES_CHOICES` in one process, both harnesses: xla_separate (two
`quantize_1x128` calls: XLA transposes the 16-bit x, the previous formulation), xla (amaxes
from x as it lies, the 1-byte copy transposed) and pallas (one Pallas/Triton kernel, one read
of x). Each row says whether its bytes equal xla_separate's, its GB/s (x read once, both
copies and scales written once) and how many kernels its compiled module launches.

Error, against the float32 product (HIGHEST precision) of the unquantized operands: the output
y = x Wᵀ, and the weight gradient dW = dYᵀ x (dY a random gradient): per-tensor (e4m3 x and
W, e5m2 dY, as the per-tensor recipe quantizes gradients) against block-scaled (e4m3 all:
x and dY in 1×128 tiles along the contraction, W in 128×128 blocks; for dW, xᵀ and dYᵀ in
1×128 tiles along the tokens: `quantize_1x128(..., transposed=True)`), on ordinary data
(standard normal) and on outlier data (0.1% of x's channels ×1000), and a sweep of the
outliers' factor (×1 ... ×1e5). Relative Frobenius errors; the issue's targets (block ≤ 0.25×
per-tensor on outliers, ≤ 1× on ordinary data) are printed met/MISSED. The errors are the
same math on any platform (the CPU runs the exact reference), so `--parts errors` on a CPU
gives them too (with `--error-shape`, smaller).

    python benchmarks/block_fp8_bench.py --out benchmarks/results/block_fp8   # H200
    python benchmarks/block_fp8_bench.py --parts step --out /tmp/m1           # M1 only
    python benchmarks/block_fp8_bench.py --parts quantize --out /tmp/q        # x's copies only
    python benchmarks/block_fp8_bench.py --parts errors --error-shape 1024,1024,4096 --out /tmp/e
    python benchmarks/block_fp8_bench.py --smoke --out /tmp/smoke              # any CPU

Writes `<out>/block_fp8.json` and `<out>/block_fp8.md`. A variant whose compilation warned
that cuBLASLt runs no kernel (the reference ran) is marked FALLBACK.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import fp8_bench
import timing
import jax_epilog
from jax_epilog import Fp8, quantize_1x128, quantize_128x128
from jax_epilog.float8 import blocks
from jax_epilog.float8.blocks import dequantize
from jax_epilog.runtime.targets import MATMUL, MATMUL_BLOCK
from jax_epilog.tools.grid import NETWORKS, Workload

ROUNDS = 7
HARNESSES = ("careful", "user")
SHAPES = [(8192, 4096, 4096), (65536, 4096, 4096)]  # (M, N, K)
ERROR_SHAPE = (8192, 4096, 4096)
SMOKE_SHAPES = [(256, 128, 256)]
SMOKE_ERROR_SHAPE = (256, 128, 1024)
OUTLIER_SHARE, OUTLIER_FACTOR = 0.001, 1000.0
OUTLIER_FACTORS = (1.0, 1e2, 1e3, 1e4, 1e5)  # the sweep; OUTLIER_FACTOR is the targets' one
QUANTIZE_SHAPE, SMOKE_QUANTIZE_SHAPE = (65536, 4096), (256, 256)  # x (tokens, K): M1's
PARTS = ("speed", "step", "errors", "quantize")


def _block_stack(both_copies: str):
    """The block-scaled stack with x and dZ quantized by `both_copies` (a
    `blocks.BOTH_COPIES_CHOICES` kernel): set while the stack is traced, which fixes it for
    its backward too."""
    stack = fp8_bench.epilog_stack(Fp8(scaling="block", layers="all"))

    def run(*args):
        saved, blocks.BOTH_COPIES = blocks.BOTH_COPIES, both_copies
        try:
            return stack(*args)
        finally:
            blocks.BOTH_COPIES = saved
    return run


# The training step, in fp8_bench's form (`fp8_bench.measure`).
STEP_VARIANTS = {"xla_bf16": fp8_bench.VARIANTS["xla_bf16"],
                 "ours_fp8": fp8_bench.VARIANTS["ours_fp8"],
                 # fp8=True as the Flax modules run it: with a state, so delayed scaling
                 "ours_fp8_stateful": fp8_bench.VARIANTS["ours_fp8_stateful"],
                 # every layer: on M1 the same as "auto", and the smoke row is FP8 too
                 "ours_fp8_block": _block_stack("pallas"),  # the default: XLA's off CUDA
                 "ours_fp8_block_xla": _block_stack("xla"),
                 "ours_fp8_block_separate": _block_stack("xla_separate")}
STEP_ROW = Workload("M1", *NETWORKS["M1"], "relu", None, False)
SMOKE_STEP_ROW = Workload("S1", 256, (128, 256, 128), "relu", None, False)
# (variant, against, at least) on the step's speed in both harnesses; temporaries at most.
STEP_TARGETS = (("ours_fp8_block", "xla_bf16", 1.35), ("ours_fp8_block", "ours_fp8", 0.9),
                ("ours_fp8_block", "ours_fp8_stateful", 0.9))
STEP_TEMP_TARGET = ("ours_fp8_block", "xla_bf16", 1.0)


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


def _entry_kernels(hlo: str) -> int:
    """How many kernels a compiled module's entry computation launches: its fusions, custom
    calls (cuBLAS, Triton), copies and transposes."""
    entry = hlo[hlo.index("ENTRY"):].split("\n}", 1)[0]
    return sum(1 for line in entry.splitlines()
               if any(f" {op}(" in line for op in ("fusion", "custom-call", "copy", "transpose")))


def _same_bytes(a, b) -> bool:
    return all(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def measure_quantize(shape: tuple[int, int], budget: timing.Budget) -> dict[str, Any]:
    """x (tokens, K) bf16 into both its 1×128 copies, each `blocks.BOTH_COPIES_CHOICES`
    kernel (ratios against xla_separate, the previous formulation)."""
    rows, k = shape
    arg_sets = [(jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16),)
                for seed in range(timing.input_copies(rows * k * 2))]
    moved = rows * k * (2 + 1 + 1) + 2 * 4 * rows * k // blocks.BLOCK  # read x; write the rest
    record: dict[str, Any] = {"shape": list(shape), "bytes_moved": moved, "variants": {}}
    compiled, base = {}, "xla_separate"
    for kernel in sorted(blocks.BOTH_COPIES_CHOICES, key=lambda c: c != base):
        lowered = jax.jit(functools.partial(blocks.quantize_1x128_both, kernel=kernel)).lower(
            *arg_sets[0])
        compiled[kernel] = lowered.compile()
        outputs = jax.block_until_ready(compiled[kernel](*arg_sets[0]))
        reference = outputs if kernel == base else reference
        record["variants"][kernel] = {
            "ran": "Pallas (Triton)" if "triton" in lowered.as_text() else "XLA",
            "same_bytes_as_xla_separate": _same_bytes(outputs, reference),
            "kernels": _entry_kernels(compiled[kernel].as_text()),
            "temp_mib": _temp_mib(compiled[kernel])}
        del outputs
    for harness in HARNESSES:
        runs = {name: (c, arg_sets if harness == "careful" else arg_sets[:1])
                for name, c in compiled.items()}
        times = timing.time_interleaved(runs, rounds=ROUNDS, round_seconds=budget.round_seconds())
        for name, t in times.items():
            result = record["variants"][name].setdefault(harness, t.as_dict())
            result["gb_per_s"] = moved / t.seconds / 1e9
            result[f"ratio_vs_{base}"] = times[base].seconds / t.seconds
    return record


def _relative_error(y, exact):
    diff = jnp.linalg.norm((y.astype(jnp.float32) - exact).ravel())
    return diff / jnp.linalg.norm(exact.ravel())


def _exact(a, b):
    """a @ bᵀ in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


@jax.jit
def _errors(x, w, dy, ordinary):
    """Relative errors of y = x Wᵀ and dW = dYᵀ x, per-tensor and block-scaled FP8; and of
    the ordinary channels' share (`ordinary`: 1 for each of x's ordinary channels, 0 for an
    outlier's): y's part from those channels, (x·ordinary) Wᵀ, from the dequantized operands,
    and dW's columns of those channels. The whole tensors' errors are dominated by the
    outliers' terms, which both recipes round alike; the shares say whether the other
    channels survive."""
    def f32(a8, b8, sa, sb, **kw):
        return jax_epilog.matmul(a8, b8, quantization_scales={"a": sa, "b": sb},
                                 preferred_element_type=jnp.float32, **kw)

    y, dw = _exact(x, w), _exact(dy.T, x.T)  # dW (N, K)
    y_share = _exact(x * ordinary, w)
    x8, sx = jax_epilog.quantize(x)
    w8, sw = jax_epilog.quantize(w)
    g8, sg = jax_epilog.quantize(dy, "float8_e5m2")
    tensor = (f32(x8, w8, sx, sw, transpose_b=True), f32(g8, x8, sg, sx, transpose_a=True),
              _exact(x8.astype(jnp.float32) * sx * ordinary, w8.astype(jnp.float32) * sw))
    xb8, sxb = quantize_1x128(x)
    wb8, swb = quantize_128x128(w)
    gt8, sgt = quantize_1x128(dy, transposed=True)  # dYᵀ (N, M), tiles along M
    xt8, sxt = quantize_1x128(x, transposed=True)   # xᵀ (K, M), tiles along M
    block = (f32(xb8, wb8, sxb, swb, transpose_b=True), f32(gt8, xt8, sgt, sxt, transpose_b=True),
             _exact(dequantize(xb8, sxb) * ordinary, dequantize(wb8, swb)))
    errors = {}
    for kind, (y_q, dw_q, share_q) in (("tensor", tensor), ("block", block)):
        errors[f"y_{kind}"] = _relative_error(y_q, y)
        errors[f"dw_{kind}"] = _relative_error(dw_q, dw)
        errors[f"y_ordinary_{kind}"] = _relative_error(share_q, y_share)
        errors[f"dw_ordinary_{kind}"] = _relative_error(dw_q * ordinary, dw * ordinary)
    return errors


def _error_data(shape: tuple[int, int, int]):
    """(ordinary x, W, dY, the outlier channels of x)."""
    m, n, k = shape
    keys = jax.random.split(jax.random.key(1), 3)
    w = jax.random.normal(keys[1], (n, k), jnp.float32) / np.sqrt(k)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32)
    ordinary = jax.random.normal(keys[0], (m, k), jnp.float32)
    count = max(1, round(OUTLIER_SHARE * k))
    channels = np.random.default_rng(0).choice(k, count, replace=False)
    return ordinary, w, dy, channels


def measure_errors(shape: tuple[int, int, int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the errors on ordinary data and with the outliers ×`OUTLIER_FACTOR`, the sweep: the
    errors with the outlier channels × each of `OUTLIER_FACTORS`)."""
    ordinary, w, dy, channels = _error_data(shape)
    share = jnp.ones((shape[2],), jnp.float32).at[channels].set(0.0)

    def errors(factor):
        x = ordinary if factor is None else ordinary.at[:, channels].multiply(factor)
        return {key: float(v) for key, v in _errors(x, w, dy, share).items()}

    sweep = [{"factor": f, **errors(f)} for f in OUTLIER_FACTORS]
    at_target = next((e for e in sweep if e["factor"] == OUTLIER_FACTOR), None)
    report = {"shape": list(shape), "outlier_channels": len(channels),
              "ordinary": errors(None),
              "outliers": {k: v for k, v in (at_target or errors(OUTLIER_FACTOR)).items()
                           if k != "factor"}}
    return report, sweep


def measure_step(w: Workload, budget: timing.Budget, variants=tuple(STEP_VARIANTS)
                 ) -> dict[str, Any]:
    """The training step's row (`fp8_bench.measure` over `variants`, of `STEP_VARIANTS`;
    xla_bf16, the base of the ratios, always)."""
    variants = ("xla_bf16",) + tuple(v for v in variants if v != "xla_bf16")
    return {"row": w.name, "batch": w.batch, "widths": list(w.widths),
            **fp8_bench.measure(w, variants, budget, STEP_VARIANTS)}


def step_targets(step: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's speed and memory targets on the step, where it was measured: speed met
    when reached in both harnesses and neither side fell back to the reference."""
    rows, v = [], step["variants"]
    for variant, against, least in STEP_TARGETS:
        if variant not in v or against not in v:
            continue
        careful, user = (v[against][h]["seconds"] / v[variant][h]["seconds"] for h in HARNESSES)
        fell_back = bool(v[variant]["fallbacks"] or v[against]["fallbacks"])
        rows.append({"what": f"{step['row']} step {variant} / {against} speed (careful, user)",
                     "ratio": min(careful, user), "careful": careful, "user": user,
                     "at_least": least, "met": min(careful, user) >= least and not fell_back})
    variant, against, most = STEP_TEMP_TARGET
    temps = tuple(v[name]["temp_mib"] if name in v else None for name in (variant, against))
    if None not in temps and temps[1]:
        rows.append({"what": f"{step['row']} step {variant} / {against} temporaries",
                     "ratio": temps[0] / temps[1], "at_most": most,
                     "met": temps[0] / temps[1] <= most})
    return rows


def targets(errors: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for data, least in (("outliers", 0.25), ("ordinary", 1.0)):
        for what in ("y", "dw"):
            e = errors[data]
            ratio = e[f"{what}_block"] / e[f"{what}_tensor"]
            rows.append({"what": f"{data} {what} error block/per-tensor", "ratio": ratio,
                         "at_most": least, "met": ratio <= least})
    return rows


def _target_line(t: dict[str, Any]) -> str:
    bound = f"at least {t['at_least']}" if "at_least" in t else f"at most {t['at_most']}"
    both = f" ({t['careful']:.3f}, {t['user']:.3f})" if "careful" in t else ""
    return f"{t['what']}: {t['ratio']:.3f}{both} ({bound}): {'met' if t['met'] else 'MISSED'}"


def _speed_lines(report: dict[str, Any]) -> list[str]:
    lines = ["| M×N×K | variant | ran | careful ms | TFLOP/s | ×bf16 | ×tensor_fp8 | user ms "
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
    return lines


def _step_lines(step: dict[str, Any]) -> list[str]:
    lines = ["", f"## Training step {step['row']} (batch {step['batch']}, widths "
             f"{'→'.join(map(str, step['widths']))}, ReLU)", "",
             "| variant | careful ms | ×xla_bf16 | user ms | ×xla_bf16 | temporaries MiB | "
             "GEMMs cuBLASLt FP8/other · XLA FP8/other | max diff vs xla_bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in step["variants"].items():
        c, u = v.get("careful", {}), v.get("user", {})
        temp = "–" if v["temp_mib"] is None else f"{v['temp_mib']:.0f}"
        lines.append(f"| {name} | {c.get('seconds', 0) * 1e3:.2f} | "
                     f"{c.get('ratio_vs_xla_bf16', 0):.3f} | {u.get('seconds', 0) * 1e3:.2f} | "
                     f"{u.get('ratio_vs_xla_bf16', 0):.3f} | {temp} | "
                     f"{fp8_bench._gemm_cell(v)} | {v['relative_diff_vs_xla_bf16']:.3g} |")
    return lines


def _quantize_lines(q: dict[str, Any]) -> list[str]:
    lines = ["", f"## Quantization of x ({'×'.join(map(str, q['shape']))} bf16) into both "
             "1×128 copies", "",
             "| kernel | ran | same bytes as xla_separate | kernels | careful ms | GB/s | "
             "×xla_separate | user ms | ×xla_separate |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in q["variants"].items():
        c, u = v.get("careful", {}), v.get("user", {})
        lines.append(f"| {name} | {v['ran']} | {'yes' if v['same_bytes_as_xla_separate'] else 'NO'} "
                     f"| {v['kernels']} | {c.get('seconds', 0) * 1e3:.3f} | "
                     f"{c.get('gb_per_s', 0):.0f} | {c.get('ratio_vs_xla_separate', 0):.3f} | "
                     f"{u.get('seconds', 0) * 1e3:.3f} | {u.get('ratio_vs_xla_separate', 0):.3f} |")
    return lines


def _error_lines(e: dict[str, Any], sweep: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"## Error against float32 ({'×'.join(map(str, e['shape']))}, "
             f"{e['outlier_channels']} outlier channels ×{OUTLIER_FACTOR:g})", "",
             "| data | y per-tensor | y block | dW per-tensor | dW block |", "|---|---|---|---|---|"]
    for data in ("ordinary", "outliers"):
        d = e[data]
        lines.append(f"| {data} | {d['y_tensor']:.3e} | {d['y_block']:.3e} | "
                     f"{d['dw_tensor']:.3e} | {d['dw_block']:.3e} |")
    lines += ["", "### The outliers' factor swept", "",
              "Whole tensors, then the ordinary channels' share (y from the ordinary channels, "
              "dW's ordinary columns); each cell per-tensor / block (block ÷ per-tensor).", "",
              "| factor | y | dW | y, ordinary share | dW, ordinary columns |",
              "|---|---|---|---|---|"]
    for d in sweep:
        cells = [f"{d[what + '_tensor']:.3g} / {d[what + '_block']:.3g} "
                 f"({d[what + '_block'] / d[what + '_tensor']:.3f})"
                 for what in ("y", "dw", "y_ordinary", "dw_ordinary")]
        lines.append(f"| ×{d['factor']:g} | {' | '.join(cells)} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    meta = report["metadata"]
    lines = ["# Block-scaled FP8 against per-tensor FP8 and bf16", "",
             timing.provenance(meta), ""]
    if report.get("speed"):
        lines += _speed_lines(report)
    if report.get("quantize"):
        lines += _quantize_lines(report["quantize"])
    if report.get("step"):
        lines += _step_lines(report["step"])
    if report.get("errors"):
        lines += _error_lines(report["errors"], report["sweep"])
    lines += ["", "## Targets", ""]
    lines += [f"- {_target_line(t)}" for t in report["targets"]]
    return "\n".join(lines + timing.footnotes(meta, [])) + "\n"


def _shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.split(","))
    return m, n, k


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any CPU")
    parser.add_argument("--max-s", type=float, default=240.0)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--step-variants", default=",".join(STEP_VARIANTS),
                        help=f"comma-separated, of {', '.join(STEP_VARIANTS)} (default: all)")
    parser.add_argument("--error-shape", type=_shape, default=None,
                        help="M,N,K of the error study (default "
                             f"{','.join(map(str, ERROR_SHAPE))})")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; expected some of "
                     f"{', '.join(PARTS)}")
    step_variants = [v.strip() for v in args.step_variants.split(",") if v.strip()]
    if sorted(set(step_variants) - set(STEP_VARIANTS)):
        parser.error(f"--step-variants: unknown {sorted(set(step_variants) - set(STEP_VARIANTS))}"
                     f"; expected some of {', '.join(STEP_VARIANTS)}")
    shapes, error_shape, step_row, quantize_shape = (
        (SMOKE_SHAPES, SMOKE_ERROR_SHAPE, SMOKE_STEP_ROW, SMOKE_QUANTIZE_SHAPE) if args.smoke
        else (SHAPES, ERROR_SHAPE, STEP_ROW, QUANTIZE_SHAPE))
    error_shape = args.error_shape or error_shape
    shapes = shapes if "speed" in parts else []
    measurements = len(HARNESSES) * (len(shapes) + ("step" in parts) + ("quantize" in parts))
    budget = timing.Budget(args.max_s, max(1, measurements),
                           rounds=len(VARIANTS) * ROUNDS)
    report: dict[str, Any] = {"benchmark": "block_fp8", "metadata": timing.run_metadata(),
                              "speed": [], "targets": []}
    if "errors" in parts:
        report["errors"], report["sweep"] = measure_errors(error_shape)
        report["targets"] += targets(report["errors"])
        timing.write_report(report, args.out, "block_fp8", markdown)
    for shape in shapes:
        report["speed"].append(measure_speed(shape, budget))
        timing.write_report(report, args.out, "block_fp8", markdown)
    if "quantize" in parts:
        report["quantize"] = measure_quantize(quantize_shape, budget)
        timing.write_report(report, args.out, "block_fp8", markdown)
    if "step" in parts:
        report["step"] = measure_step(step_row, budget, step_variants)
        report["targets"] += step_targets(report["step"])
    timing.write_report(report, args.out, "block_fp8", markdown)
    for t in report["targets"]:
        print(f"target {_target_line(t)}")
    return report


if __name__ == "__main__":
    main()
