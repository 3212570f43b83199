"""A stock Flax model served in FP8 by one call (`jax_epilog.serve_fp8`, docs/stock_models.md)
against the same model from this package's layers, bf16, and Qwix.

The model: a transformer MLP block `down(gelu(up(x)))` of `nnx.Linear` layers with biases
(the example GPT's stock MLP), D 4096, F 14336, `LAYERS` blocks per timed call, each with its
own weights and input (serving_bench.py's `stacked`: a decode step runs a whole model per
call). Every variant starts from the same bf16 parameters:

- stock_bf16: the stock block as it is (XLA's bf16 GEMMs);
- stock_fp8: `serve_fp8(block, rules=".*")`: its kernels stored in FP8 once, each layer the
  served way the rows choose, the bias in the GEMM's epilog (GELU stays between the layers,
  where the stock block applies it);
- ours_fp8: `jax_epilog.nnx.MLP` on `quantize_params` of the same parameters (bias and GELU
  both in the first GEMM's epilog): the route's ceiling;
- qwix_fp8: Qwix's PTQ of the stock block, e4m3 weights and activations (if Qwix is
  installed);
- qwix_epilog: `qwix.quantize_model(block, EpilogProvider(rules))`, our route through Qwix's
  provider interface (if Qwix is installed).

Rows (tokens per call) from 1 to 2048, decode sizes first. Both harnesses of
benchmarks/README.md; ratios to stock_bf16, the output error against it, and the targets of
issue 62 as ratios (each the worst decode row's, the lower of the two harnesses): stock_fp8's
speed >= 0.97x ours_fp8's and >= 1.3x qwix_fp8's, and qwix_epilog (the same route through
Qwix's provider) >= 0.97x stock_fp8's.

    python benchmarks/stock_serving_bench.py --out benchmarks/results/stock_serving   # GPU
    python benchmarks/stock_serving_bench.py --quick --out /tmp/stock_serving       # ~2 min
    python benchmarks/stock_serving_bench.py --smoke --out /tmp/stock_serving       # any CPU

`--quick` measures the decode rows alone (`QUICK_ROWS`, what the targets read) in 5 rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

import timing  # benchmarks/timing.py
from serving_bench import (  # benchmarks/serving_bench.py
    _bytes, measure_row, normal, stacked, targets_table, variant_cells)
import jax_epilog
import jax_epilog.nnx

BLOCK = (4096, 14336)
ROWS = (1, 16, 64, 256, 2048)
LAYERS = 8
SMOKE = dict(block=(64, 136), rows=(1, 17, 129), layers=2)
DECODE_ROWS = 64
QUICK_ROWS, QUICK_ROUNDS = (1, 16, 64), 5

#: (variant, baseline, minimum ratio at rows <= DECODE_ROWS).
TARGETS = (("stock_fp8", "ours_fp8", 0.97), ("stock_fp8", "qwix_fp8", 1.3),
           ("stock_fp8", "stock_bf16", 1.0), ("qwix_epilog", "stock_fp8", 0.97))


class StockMLP(nnx.Module):
    """The example GPT's stock MLP: `nnx.Linear` up, tanh GELU, `nnx.Linear` down, stored as
    `layers` (the state of `jax_epilog.nnx.MLP`)."""

    def __init__(self, d: int, f: int, rngs: nnx.Rngs):
        dense = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(d, f, **dense), nnx.Linear(f, d, **dense)])

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x), approximate=True))


def _applied(models: list) -> tuple[Any, list]:
    """(jitted `stacked` call, its per-layer arguments) of NNX `models` (one graph)."""
    graphdef = nnx.graphdef(models[0])
    fn = stacked(lambda state, x: nnx.merge(graphdef, state)(x), x_first=False)
    return fn, ([(nnx.state(m),) for m in models],)


def variants(d: int, f: int, count: int) -> tuple[dict, dict[str, int]]:
    """name: (jitted call, its arguments) for `count` blocks, and each variant's weight bytes
    of one block."""
    stock = [StockMLP(d, f, nnx.Rngs(i)) for i in range(count)]
    for block in stock:  # random biases: a zero bias would hide one that is dropped
        for layer in block.layers:
            layer.bias[...] = normal(7, layer.bias.shape, 0.5)
    served = [jax_epilog.serve_fp8(block, rules=".*") for block in stock]
    ours = []
    for block in stock:
        mlp = jax_epilog.nnx.MLP(d, [f, d], activation="gelu", dtype=jnp.bfloat16,
                                 param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        nnx.update(mlp, nnx.state(block, nnx.Param))
        nnx.update(mlp, jax_epilog.quantize_params(
            nnx.state(mlp, nnx.Param), include=lambda path, leaf: jnp.ndim(leaf) == 2))
        ours.append(mlp)
    out = {"stock_bf16": _applied(stock), "stock_fp8": _applied(served),
           "ours_fp8": _applied(ours)}
    sizes = {name: _bytes(nnx.state(models[0])) for name, models in
             (("stock_bf16", stock), ("stock_fp8", served), ("ours_fp8", ours))}
    try:
        import qwix
        from jax_epilog.layers.qwix_serving import EpilogProvider
    except ImportError:
        print("qwix is not installed (pip install qwix): qwix_fp8 and qwix_epilog skipped",
              file=sys.stderr)
        return out, sizes
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn,
                                   act_qtype=jnp.float8_e4m3fn)]
    sample = normal(4, (8, d))
    for name, provider in (("qwix_fp8", lambda: qwix.PtqProvider(rules)),
                           ("qwix_epilog", lambda: EpilogProvider(rules))):
        models = [qwix.quantize_model(block, provider(), sample) for block in stock]
        out[name] = _applied(models)
        sizes[name] = _bytes(nnx.state(models[0]))
    return out, sizes


def targets(rows: list[dict]) -> list[dict]:
    found = []
    for variant, baseline, minimum in TARGETS:
        ratios = [min(r[baseline]["careful_ms"] / r[variant]["careful_ms"],
                      r[baseline]["user_ms"] / r[variant]["user_ms"])
                  for r in rows if r["M"] <= DECODE_ROWS and variant in r and baseline in r]
        if ratios:
            found.append({"target": f"{variant} >= {minimum}x {baseline} at M <= "
                                    f"{DECODE_ROWS}", "worst": min(ratios),
                          "met": min(ratios) >= minimum})
    return found


def render(report: dict) -> str:
    rows = report["rows"]
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    lines = ["# A stock Flax model served in FP8 by one call", "",
             timing.provenance(report["meta"]), "",
             f"MLP block D{report['block'][0]} F{report['block'][1]}, {report['layers']} "
             "blocks per call. Ratios are stock_bf16's time over the variant's, careful "
             "harness (user harness in brackets); error: max |y - y_bf16| / max |y_bf16|.",
             "", "| M | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        lines.append(f"| {r['M']} | " + " | ".join(variant_cells(r, names)) + " |")
    lines += ["", "GEMMs per block: " + "; ".join(
        f"{n} {rows[-1][n]['gemms']}" for n in names), "",
        "Weight bytes per block: " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in report["weight_bytes"].items()), ""]
    return "\n".join(lines + targets_table(report["targets"])
                     + timing.footnotes(report["meta"], [])) + "\n"


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any CPU")
    parser.add_argument("--quick", action="store_true",
                        help=f"the decode rows the targets read ({','.join(map(str, QUICK_ROWS))}"
                             f"), {QUICK_ROUNDS} rounds (each unless given)")
    parser.add_argument("--rounds", type=int, default=None, help="default 7")
    parser.add_argument("--rows", type=lambda text: tuple(int(r) for r in text.split(",")),
                        help=f"rows per call (default {','.join(map(str, ROWS))})")
    args = parser.parse_args(argv)
    grid = SMOKE if args.smoke else dict(block=BLOCK, rows=ROWS, layers=LAYERS)
    if args.quick:
        grid = {**grid, "rows": tuple(r for r in grid["rows"] if r <= DECODE_ROWS)
                if args.smoke else QUICK_ROWS}
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else 7)
    d, f = grid["block"]
    calls, sizes = variants(d, f, grid["layers"])
    report: dict[str, Any] = {"meta": timing.run_metadata(), "block": (d, f),
                              "layers": grid["layers"], "weight_bytes": sizes, "rows": []}
    for m in args.rows or grid["rows"]:
        row = measure_row(calls, (m, d), "stock_bf16", False, args.rounds)
        report["rows"].append({"M": m, "baseline": "stock_bf16", **row})
        print(m, {n: round(v["careful_ratio"], 2) for n, v in row.items()}, flush=True)
    report["targets"] = targets(report["rows"])
    timing.write_report(report, args.out, "stock_serving", render)
    for t in report["targets"]:
        print(f"{t['target']}: worst {t['worst']:.3f} {'met' if t['met'] else 'MISSED'}")
    return report


if __name__ == "__main__":
    main()
