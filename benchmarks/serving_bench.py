"""Serving with weights stored in FP8 (docs/serving.md) against XLA's bf16 and Qwix's FP8.

Two parts, each a ratio measured in one process against XLA's bf16 (`xla_bf16`):

1. **One GEMM**, `gelu(x @ w + b)` (tanh GELU) at K x N = 4096 x 14336 (a Llama FFN
   up-projection) and 8192 x 8192 (and, with `--shapes`, 14336 x 4096: the down
   projection), for M (the rows: tokens of a batch) from 1 to 8192:
   - xla_bf16: `jax.nn.gelu(x @ w + b)` under `jax.jit`, bf16 weights;
   - ours_bf16: `jax_epilog.dense(x, w, b, activation="gelu")`, bf16 weights (the decode
     shapes' "never slower" check);
   - ours_fp8: the same with `w` stored in FP8 (`quantize_params`), as it runs by default
     (`planning.serving_plan`: weight-only up to 64 rows, our FP8 GEMM above);
   - ours_fp8_gemm: always the FP8 GEMM, the input's scale from its amax each call
     (`JAX_EPILOG_SERVING=fp8`);
   - ours_fp8_static: the FP8 GEMM with a static input scale (`calibrate`, no amax pass);
   - ours_fp8_channel: `w` stored with one scale per output channel (`quantize_params(...,
     granularity="channel")`), as it runs by default; ours_fp8_channel_gemm: always the FP8
     GEMM, which then scales rows (cuBLASLt's outer vector scaling);
   - ours_fp8_pallas: always the Pallas kernel of few rows where it fits
     (`JAX_EPILOG_SERVING=fp8_pallas`);
   - ours_xla_fp8: always XLA's FP8 dot (`JAX_EPILOG_SERVING=xla_fp8`);
   - ours_weight_only: always weight-only (`JAX_EPILOG_SERVING=weight_only`): the bf16 input
     times the FP8 weight converted inside XLA's GEMM;
   - xla_fp8: XLA's own FP8 dot on the same stored weight (the input quantized the same way,
     `lax.dot_general` of the FP8 operands to bf16, scales, bias and GELU after it), what a
     user could write without this package.
2. **A transformer MLP block** `gelu(x W1 + b1) W2 + b2`, D 4096, F 14336, Flax Linen models
   from one set of bf16 parameters: flax_bf16 (`nn.Dense`), ours_fp8
   (`jax_epilog.linen.MLP` on `quantize_params` of them), ours_fp8_static (the same,
   `calibrate`d: the first GEMM writes the second's FP8 input), ours_fp8_channel (per-channel
   weight scales) and qwix_fp8 (Qwix's PTQ, e4m3 weights and activations for every layer, the
   rule of its README).
3. **A Llama SwiGLU block** `down(silu(x gate) * (x up))`, no biases, the same D and F
   (Llama 3 8B's) and variants, ours `jax_epilog.linen.SwiGLU` (`--parts swiglu`; not in the
   default parts).

Every timed call runs `LAYERS` layers (or blocks), each with its own weights and its own
input, as a decode step runs a whole model per call: timing one small layer per call measures
the host's dispatch (tens of microseconds) rather than the kernels. Times are per layer.
(Until 2026-12-05 the layers of a call shared one input, so XLA quantized it once for all of
them and merged pairs of its FP8 dots: results before then flatter the ways that quantize the
input, most at decode sizes.)

Both harnesses of benchmarks/README.md: careful (inputs rotated past L2, the variants' rounds
interleaved, median) and user (the same inputs every call, each variant's own wall-clock loop,
one `block_until_ready` a round). Reported: ms, the ratio to xla_bf16 (or flax_bf16) in each
harness, the output error against bf16 (max |y - y_bf16| / max |y_bf16|), the weights' bytes.

    python benchmarks/serving_bench.py --out benchmarks/results/serving   # H200: ~3 min
    python benchmarks/serving_bench.py --smoke --out /tmp/serving         # any CPU
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import timing  # benchmarks/timing.py
import jax_epilog
import jax_epilog.linen
from jax_epilog.float8 import scaling
from jax_epilog.float8.weights import Fp8Weight

#: K x N: a Llama-8B FFN's up (and gate) and down projections, and a square one; the down
#: projection (the MLP block's second GEMM) only where `--shapes` asks.
GEMM_SHAPES = {"K4096xN14336": (4096, 14336), "K8192xN8192": (8192, 8192),
               "K14336xN4096": (14336, 4096)}
DEFAULT_SHAPES = ("K4096xN14336", "K8192xN8192")
GEMM_ROWS = (1, 16, 64, 256, 1024, 2048, 8192)
BLOCK = (4096, 14336)
BLOCK_ROWS = (16, 64, 256, 2048, 8192)
#: Layers (or blocks) per timed call, each with its own weights: 8 FP8 weights of
#: K4096 x N14336 are 470 MB, so no call finds its weights in the 50 MiB L2.
LAYERS = 8
SMOKE = dict(shapes={"K64xN96": (64, 96)}, rows=(1, 17), block=(64, 128), block_rows=(3,),
             layers=2)

#: Issue 37's targets: (part, variant, baseline, rows predicate, minimum ratio); the SwiGLU
#: block is held to the MLP block's.
TARGETS = (
    ("gemm", "ours_fp8", "xla_bf16", "M >= 2048", lambda m: m >= 2048, 1.8),
    ("gemm", "ours_fp8", "xla_bf16", "M <= 64", lambda m: m <= 64, 1.7),
    ("gemm", "ours_fp8", "xla_bf16", "M in 1-256", lambda m: m <= 256, 1.4),
    ("gemm", "ours_bf16", "xla_bf16", "M in 1-256 (never slower)", lambda m: m <= 256, 1.0),
    ("block", "ours_fp8", "flax_bf16", "M >= 2048", lambda m: m >= 2048, 1.6),
    ("block", "ours_fp8", "flax_bf16", "M <= 64", lambda m: m <= 64, 1.5),
    ("block", "ours_fp8", "qwix_fp8", "every M", lambda m: True, 1.3),
    ("swiglu", "ours_fp8", "flax_bf16", "M >= 2048", lambda m: m >= 2048, 1.6),
    ("swiglu", "ours_fp8", "flax_bf16", "M <= 64", lambda m: m <= 64, 1.5),
    ("swiglu", "ours_fp8", "qwix_fp8", "every M", lambda m: True, 1.3),
)


def normal(key: int, shape, scale: float = 1.0, dtype=jnp.bfloat16):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def xla_fp8_dense(x, stored: Fp8Weight, bias):
    """The stored weight through XLA's own FP8 dot: the input quantized as ours is, then
    `dot_general` of the two FP8 operands (XLA rewrites it to cuBLASLt's FP8 GEMM), the
    scales, bias and GELU after it."""
    x8, sx = scaling.quantize(x, scaling.amax(x), "float8_e4m3fn", 0)
    y = jax.lax.dot_general(x8, stored.data, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.bfloat16)
    return jax.nn.gelu(y * (sx * stored.scale).astype(jnp.bfloat16) + bias)


def stacked(fn, x_first: bool = True):
    """One jitted call of `fn` over every layer's weights in turn, each layer on its own input
    (`xs`, one array per layer): a decode step runs a whole model per call, so the host's
    dispatch (tens of microseconds) overlaps the kernels instead of being what is timed at
    decode sizes. Own inputs, since a model's layers do not share one: on one shared input
    XLA computed its FP8 quantization once for all 8 layers and merged pairs of its FP8 dots
    into one GEMM (compiled for an H200), which flattered every way that quantizes."""
    if x_first:
        return jax.jit(lambda xs, layers: [fn(x, *layer) for x, layer in zip(xs, layers,
                                                                             strict=True)])
    return jax.jit(lambda layers, xs: [fn(*layer, x) for layer, x in zip(layers, xs,
                                                                         strict=True)])


def layer_inputs(seed: int, shape, count: int) -> list:
    """`count` random inputs of `shape`, one per layer of a `stacked` call."""
    return [normal(seed + 1000 * i, shape) for i in range(count)]


def gemm_variants(k: int, n: int, count: int) -> tuple[dict, dict[str, int]]:
    """name: (jitted function, its weight arguments) for `count` layers of one GEMM shape,
    each with its own weight, and one layer's weight bytes."""
    ws = [normal(1 + i, (k, n), k ** -0.5) for i in range(count)]
    b = normal(100, (n,), 0.1)
    def store(granularity):
        return [jax_epilog.quantize_params({"kernel": w}, include=lambda path, leaf: True,
                                           granularity=granularity)["kernel"] for w in ws]
    stored, per_channel = store("tensor"), store("channel")
    dense = lambda x, w, b: jax_epilog.dense(x, w, b, activation="gelu")
    static = [jax_epilog.calibrate(lambda p, x: jax_epilog.dense(x, p, b, activation="gelu"),
                                   s, [normal(300, (256, k))]) for s in stored]
    bf16 = [(w, b) for w in ws]
    fp8 = [(s, b) for s in stored]
    variants = {
        "xla_bf16": (stacked(lambda x, w, b: jax.nn.gelu(x @ w + b)), (bf16,)),
        "ours_bf16": (stacked(dense), (bf16,)),
        "ours_fp8": (stacked(dense), (fp8,)),
        "ours_fp8_gemm": (Way("fp8", stacked(dense)), (fp8,)),
        "ours_fp8_static": (Way("fp8", stacked(dense)), ([(s, b) for s in static],)),
        "ours_fp8_pallas": (Way("fp8_pallas", stacked(dense)), (fp8,)),
        "ours_xla_fp8": (Way("xla_fp8", stacked(dense)), (fp8,)),
        "ours_weight_only": (Way("weight_only", stacked(dense)), (fp8,)),
        "ours_fp8_channel": (stacked(dense), ([(s, b) for s in per_channel],)),
        "ours_fp8_channel_gemm": (Way("fp8", stacked(dense)), ([(s, b) for s in per_channel],)),
        "xla_fp8": (stacked(xla_fp8_dense), (fp8,)),
    }
    return variants, {"bf16": ws[0].nbytes, "fp8": stored[0].nbytes}


class Way:
    """A jitted function compiled with `JAX_EPILOG_SERVING=way` (read when it is traced), so
    that one process can time each way of serving."""

    def __init__(self, way: str, jitted):
        self.way, self.jitted, self.compiled = way, jitted, {}

    def __call__(self, *args):
        key = jax.tree_util.tree_structure(args), tuple(jnp.shape(a) for a in
                                                        jax.tree_util.tree_leaves(args))
        if key not in self.compiled:
            before = os.environ.get("JAX_EPILOG_SERVING")
            os.environ["JAX_EPILOG_SERVING"] = self.way
            try:
                self.compiled[key] = self.jitted.lower(*args).compile()
            finally:
                if before is None:
                    del os.environ["JAX_EPILOG_SERVING"]
                else:
                    os.environ["JAX_EPILOG_SERVING"] = before
        return self.compiled[key](*args)

    def lower(self, *args):
        self(*args)
        return self.jitted.lower(*args)


_GEMM_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def gemm_kinds(fn, args) -> dict[str, int]:
    """The GEMMs of `fn`'s compiled program by kind: custom-call targets that are GEMMs
    (cuBLAS, cuBLASLt FP8, ours) and XLA's Triton GEMM fusions."""
    compiled = fn.compiled[next(iter(fn.compiled))] if isinstance(fn, Way) else \
        fn.lower(*args).compile()
    text = compiled.as_text()
    kinds: dict[str, int] = {}
    for target in _GEMM_TARGET.findall(text):
        if "gemm" in target or "matmul" in target:
            kinds[target] = kinds.get(target, 0) + 1
    triton = len(re.findall(r'"kind":"__triton_gemm"', text))
    if triton:
        kinds["__triton_gemm"] = triton
    return kinds


def block_variants(d: int, f: int, count: int, part: str = "block"
                   ) -> tuple[dict, dict[str, int]]:
    """name: (jitted apply, its variables) for `count` blocks of `part` ("block": the GELU
    MLP, "swiglu": Llama's), each from its own `init` and given to every variant, and one
    block's weight bytes."""
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
            if part == "swiglu":  # the parameters of jax_epilog.linen.SwiGLU
                layer = lambda name, n: nn.Dense(n, use_bias=False, name=name, **dense)
                return layer("down", d)(nn.silu(layer("gate", f)(x)) * layer("up", f)(x))
            h = nn.gelu(nn.Dense(f, name="layers_0", **dense)(x), approximate=True)
            return nn.Dense(d, name="layers_1", **dense)(h)

    flax_model = Block()
    keys = [jax.random.key(i) for i in range(count)]
    params = [flax_model.init(key, normal(4, (8, d)))["params"] for key in keys]
    ours = jax_epilog.linen.SwiGLU(f, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16) \
        if part == "swiglu" else jax_epilog.linen.MLP([f, d], activation="gelu",
                                                      dtype=jnp.bfloat16,
                                                      param_dtype=jnp.bfloat16)
    def store(granularity):  # the default rule, minus its size floor
        return [jax_epilog.quantize_params(p, include=lambda path, leaf: jnp.ndim(leaf) == 2,
                                           granularity=granularity) for p in params]
    ours_params, per_channel = store("tensor"), store("channel")
    variants = {
        "flax_bf16": (stacked(lambda p, x: flax_model.apply({"params": p}, x), False),
                      ([(p,) for p in params],)),
        "ours_fp8": (stacked(lambda p, x: ours.apply({"params": p}, x), False),
                     ([(p,) for p in ours_params],)),
        # Static input scales (the GELU block's first GEMM writes the second's FP8 input).
        "ours_fp8_static": (stacked(lambda p, x: ours.apply({"params": p}, x), False),
                            ([(jax_epilog.calibrate(lambda p, x: ours.apply({"params": p}, x),
                                                    p, [normal(5, (256, d))]),)
                              for p in ours_params],)),
        "ours_fp8_channel": (stacked(lambda p, x: ours.apply({"params": p}, x), False),
                             ([(p,) for p in per_channel],)),
    }
    weight_bytes = {"bf16": _bytes(params[0]), "ours_fp8": _bytes(ours_params[0])}
    try:
        import qwix
    except ImportError:
        print("qwix is not installed (pip install qwix): qwix_fp8 skipped", file=sys.stderr)
        return variants, weight_bytes
    rules = [qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn,
                         act_qtype=jnp.float8_e4m3fn)]
    ptq_model = qwix.quantize_model(flax_model, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), normal(4, (8, d)))["params"]
    ptq_params = [qwix.quantize_params(p, abstract) for p in params]
    variants["qwix_fp8"] = (stacked(lambda p, x: ptq_model.apply({"params": p}, x), False),
                            ([(p,) for p in ptq_params],))
    weight_bytes["qwix_fp8"] = _bytes(ptq_params[0])
    return variants, weight_bytes


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def measure_row(variants: dict, x_shape, baseline: str, x_first: bool,
                rounds: int) -> dict[str, Any]:
    """Both harnesses and the error against `baseline` for one input shape, times per layer
    (or block). `x_first`: the functions take `(x, layers)`, else `(layers, x)`; `layers`
    lists each layer's weights and `x` each layer's input (`stacked`)."""
    layers = len(next(iter(variants.values()))[1][0])
    xs = [layer_inputs(10 + i, x_shape, layers) for i in range(timing.input_copies(
        int(np.prod(x_shape)) * 2 * layers))]
    args = lambda weights, x: (x, *weights) if x_first else (*weights, x)
    careful = timing.time_interleaved(
        {name: (fn, [args(weights, x) for x in xs]) for name, (fn, weights) in variants.items()},
        rounds=rounds)
    user = {name: timing.time_calls(fn, [args(weights, xs[0])], rounds=rounds)
            for name, (fn, weights) in variants.items()}
    outputs = {name: np.asarray(jnp.stack(fn(*args(weights, xs[0]))).astype(jnp.float32))
               for name, (fn, weights) in variants.items()}
    kinds = {name: {kind: count // layers for kind, count in
                    gemm_kinds(fn, args(weights, xs[0])).items()}
             for name, (fn, weights) in variants.items()}
    want = outputs[baseline]
    row = {}
    for name in variants:
        row[name] = {
            "careful_ms": careful[name].seconds * 1e3 / layers,
            "user_ms": user[name].seconds * 1e3 / layers,
            "careful_ratio": careful[baseline].seconds / careful[name].seconds,
            "user_ratio": user[baseline].seconds / user[name].seconds,
            "error": float(np.max(np.abs(outputs[name] - want)) / np.max(np.abs(want))),
            "gemms": kinds[name],
        }
    return row


def targets(report: dict) -> list[dict]:
    rows = []
    for part, variant, baseline, label, where, minimum in TARGETS:
        ratios = [min(r[baseline]["careful_ms"] / r[variant]["careful_ms"],
                      r[baseline]["user_ms"] / r[variant]["user_ms"])
                  for r in report.get(part, ()) if where(r["M"]) and variant in r and baseline in r]
        if ratios:
            rows.append({"target": f"{part}: {variant} >= {minimum}x {baseline} at {label}",
                         "worst": min(ratios), "met": min(ratios) >= minimum})
    return rows


def variant_cells(row: dict, names) -> list[str]:
    """A report row's cell per variant: both harnesses' ratios, the time and the error."""
    return [f"{row[n]['careful_ratio']:.2f} ({row[n]['user_ratio']:.2f}) "
            f"{row[n]['careful_ms']:.3f} ms, err {row[n]['error']:.3f}" for n in names]


def targets_table(targets) -> list[str]:
    """The targets' section of a report: each target's worst row and whether it is met."""
    return ["## Targets (worst row, the lower of the two harnesses)", "",
            "| target | worst | met |", "|---|---|---|"] + [
        f"| {t['target']} | {t['worst']:.2f} | {'yes' if t['met'] else 'MISSED'} |"
        for t in targets]


def render(report: dict) -> str:
    lines = ["# Serving with weights stored in FP8", "",
             timing.provenance(report["meta"]), "",
             "Ratios are the baseline's time over the variant's, careful harness (user harness "
             "in brackets); error: max |y - y_bf16| / max |y_bf16|.", ""]
    for part, title in (("gemm", "One GEMM, gelu(x @ w + b)"),
                        ("block", "MLP block gelu(x W1 + b1) W2 + b2"),
                        ("swiglu", "SwiGLU block down(silu(x gate) * (x up))")):
        if not report.get(part):
            continue
        names = [n for n in report[part][0] if isinstance(report[part][0][n], dict)]
        lines += [f"## {title}", "", "| shape | M | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for r in report[part]:
            cells = " | ".join(variant_cells(r, names))
            lines.append(f"| {r['shape']} | {r['M']} | {cells} |")
        lines += ["", "Weight bytes: " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in report["weight_bytes"][part].items()), ""]
    return "\n".join(lines + targets_table(report["targets"])
                     + timing.footnotes(report["meta"], [])) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any CPU")
    parser.add_argument("--parts", default="gemm,block",
                        help="comma-separated: gemm, block, swiglu")
    parser.add_argument("--rounds", type=int, default=7)
    rows = lambda text: tuple(int(r) for r in text.split(","))
    parser.add_argument("--rows", type=rows, help="the GEMM's rows, e.g. 1,16,2048 "
                        f"(default {','.join(map(str, GEMM_ROWS))})")
    parser.add_argument("--block-rows", type=rows, help="the block's rows "
                        f"(default {','.join(map(str, BLOCK_ROWS))})")
    parser.add_argument("--shapes", type=lambda text: text.split(","),
                        help=f"the GEMM's shapes, of {','.join(GEMM_SHAPES)} (default "
                             f"{','.join(DEFAULT_SHAPES)})")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.shapes or ()) - set(GEMM_SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(GEMM_SHAPES)}")
    shapes = {name: GEMM_SHAPES[name] for name in args.shapes or DEFAULT_SHAPES}
    grid = SMOKE if args.smoke else dict(shapes=shapes, rows=args.rows or GEMM_ROWS,
                                         block=BLOCK, block_rows=args.block_rows or BLOCK_ROWS,
                                         layers=LAYERS)
    report: dict[str, Any] = {"meta": timing.run_metadata(), "gemm": [], "block": [],
                              "weight_bytes": {}}
    parts = args.parts.split(",")
    if "gemm" in parts:
        for shape, (k, n) in grid["shapes"].items():
            variants, report["weight_bytes"]["gemm"] = gemm_variants(k, n, grid["layers"])
            for m in grid["rows"]:
                row = measure_row(variants, (m, k), "xla_bf16", True, args.rounds)
                report["gemm"].append({"shape": shape, "M": m, "baseline": "xla_bf16", **row})
                print(shape, m, {n: round(v["careful_ratio"], 2) for n, v in row.items()},
                      flush=True)
    for part in ("block", "swiglu"):
        if part not in parts:
            continue
        d, f = grid["block"]
        report[part] = []
        variants, report["weight_bytes"][part] = block_variants(d, f, grid["layers"], part)
        for m in grid["block_rows"]:
            row = measure_row(variants, (m, d), "flax_bf16", False, args.rounds)
            report[part].append({"shape": f"D{d} F{f}", "M": m, "baseline": "flax_bf16",
                                 **row})
            print(part, m, {n: round(v["careful_ratio"], 2) for n, v in row.items()},
                  flush=True)
    report["targets"] = targets(report)
    timing.write_report(report, args.out, "serving", render)
    return report


if __name__ == "__main__":
    main()
