"""The Llama-style SwiGLU block (issue 38): `jax_epilog.linen.SwiGLU` against stock bf16 and
Flax's own FP8, from the same weights.

Each variant is one training step of `x + mlp(rms_norm(x))`, mlp = `down(silu(gate(h)) *
up(h))` without biases, as a Flax linen model whose parameters are `norm/scale` and
`mlp/{gate,up,down}/kernel` (so every variant starts from flax_bf16's `init`):

- flax_bf16: three `nn.Dense(use_bias=False)` in bf16, `nn.RMSNorm`;
- flax_fp8_direct: the same with `dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp`, what a Flax
  user gets from one argument;
- ours_dense_fp8: three `jax_epilog.linen.Dense(use_bias=False, fp8=True)`, the way to build
  the block before `SwiGLU`;
- ours_swiglu_bf16: `jax_epilog.linen.SwiGLU` (no FP8);
- ours_swiglu_fp8: `SwiGLU(fp8=True)` (delayed scaling from the module's histories);
- ours_swiglu_fp8_current: `SwiGLU(fp8=Fp8(scaling="current"))`;
- ours_swiglu_fp8_block: `SwiGLU(fp8=Fp8(scaling="block"))`, DeepSeek-V3's block-scaled
  recipe (every row's widths are multiples of 128).

Rows (tokens, D, F): S1 (8192, 2048, 8192), S2 (16384, 4096, 14336), and EX (16384, 4096,
11008): the GPT example's `large` (16 × 1024 tokens, d_model 4096) with Llama's SwiGLU width
for a GELU MLP of 4·d_model (2/3 of 4·4096, rounded up to a multiple of 256). The step, calibration, harnesses and the gradient error are
`fp8_peer.py`'s (`fp8_peer.measure_models`): `jax.jit(jax.value_and_grad(mean(y²)))` over
every variable, the FP8 collection replaced by its gradient after each of 3 calibrating steps,
both harnesses of benchmarks/README.md (careful: rotated inputs; user: the same inputs), the
variants' rounds interleaved. Reported per row and variant: ms, the ratios against flax_bf16
and flax_fp8_direct, the compiled step's temporaries (`memory_analysis().temp_size_in_bytes`),
compile and first-step seconds, and the largest per-leaf gradient error against flax_bf16.
Then issue 38's block targets, met or MISSED.

    python benchmarks/swiglu_bench.py --out benchmarks/results          # H200
    python benchmarks/swiglu_bench.py --smoke --out /tmp/swiglu_smoke   # tiny shapes, any CPU
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import flax
from flax import linen
from flax.linen import fp8_ops

import fp8_peer
import timing
from jax_epilog import Fp8
from jax_epilog import linen as epilog_linen

DTYPE = fp8_peer.DTYPE
HARNESSES = fp8_peer.HARNESSES

#: name -> (tokens, D, F)
ROWS = {"S1": (8192, 2048, 8192), "S2": (16384, 4096, 14336), "EX": (16384, 4096, 11008)}
SMOKE_ROWS = {"T1": (129, 48, 80), "T2": (64, 32, 48)}


class ThreeDense(linen.Module):
    """SwiGLU from three bias-free dense layers `gate`, `up`, `down` (`dense(features, name)`
    makes each): what a user writes without a block."""

    hidden: int
    dense: Callable[..., linen.Module]

    @linen.compact
    def __call__(self, h):
        g = self.dense(self.hidden, name="gate")(h)
        u = self.dense(self.hidden, name="up")(h)
        return self.dense(h.shape[-1], name="down")(linen.silu(g) * u)


class Block(linen.Module):
    """`x + mlp(rms_norm(x))`, the residual MLP half of a Llama layer."""

    mlp: linen.Module

    @linen.compact
    def __call__(self, x):
        return x + self.mlp(linen.RMSNorm(dtype=DTYPE, name="norm")(x))


def flax_dense(dot_general_cls=None):
    extra = {} if dot_general_cls is None else {"dot_general_cls": dot_general_cls}
    return lambda features, name: linen.Dense(features, use_bias=False, dtype=DTYPE, name=name,
                                              **extra)


def ours_dense(features, name):
    return epilog_linen.Dense(features, use_bias=False, dtype=DTYPE, fp8=True, name=name)


VARIANTS: dict[str, Callable[[int], linen.Module]] = {
    "flax_bf16": lambda f: Block(ThreeDense(f, flax_dense())),
    "flax_fp8_direct": lambda f: Block(ThreeDense(f, flax_dense(fp8_ops.Fp8DirectDotGeneralOp))),
    "ours_dense_fp8": lambda f: Block(ThreeDense(f, ours_dense)),
    "ours_swiglu_bf16": lambda f: Block(epilog_linen.SwiGLU(f, dtype=DTYPE)),
    "ours_swiglu_fp8": lambda f: Block(epilog_linen.SwiGLU(f, dtype=DTYPE, fp8=True)),
    "ours_swiglu_fp8_current": lambda f: Block(epilog_linen.SwiGLU(
        f, dtype=DTYPE, fp8=Fp8(scaling="current"))),
    "ours_swiglu_fp8_block": lambda f: Block(epilog_linen.SwiGLU(
        f, dtype=DTYPE, fp8=Fp8(scaling="block")))}


def describe(model: linen.Module) -> str:
    mlp = model.mlp
    if isinstance(mlp, epilog_linen.SwiGLU):
        return f"jax_epilog.linen.SwiGLU(fp8={mlp.fp8!r})"
    sample = mlp.dense(1, "probe")
    if isinstance(sample, epilog_linen.Dense):
        return "3 × jax_epilog.linen.Dense(use_bias=False, fp8=True)"
    op = getattr(sample, "dot_general_cls", None)
    return "3 × nn.Dense(use_bias=False" + (f", dot_general_cls=fp8_ops.{op.__name__})"
                                            if op else ")")


def step_flops(tokens: int, d: int, f: int) -> int:
    """The step's GEMM FLOPs: 3 GEMMs (2·tokens·D·F each) forward, twice that backward."""
    return 3 * 3 * 2 * tokens * d * f


def run(rows: dict[str, tuple[int, int, int]], budget_seconds: float, out: Path,
        max_seconds: float = math.inf, only=None) -> dict[str, Any]:
    started, slowest = time.perf_counter(), 0.0
    names = [n for n in VARIANTS if only is None or n in only or n == "flax_bf16"]
    budget = timing.Budget(budget_seconds, len(HARNESSES) * len(rows),
                           rounds=len(names) * fp8_peer.ROUNDS)
    report: dict[str, Any] = {
        "benchmark": "swiglu", "metadata": {**timing.run_metadata(), "flax": flax.__version__},
        "method": {"rounds": fp8_peer.ROUNDS, "budget_seconds": budget_seconds,
                   "calibration_steps": fp8_peer.CALIBRATION_STEPS,
                   "block": "x + down(silu(gate(h)) * up(h)), h = RMSNorm(x); no biases",
                   "step": "fp8_peer.py's: value_and_grad of mean(y**2) over all variables",
                   "grad_error": "per parameter leaf, max|g - g_flax_bf16| / max|g_flax_bf16|"},
        "rows": {}, "errors": [], "skipped": []}
    for name, (tokens, d, f) in rows.items():
        row_started = time.perf_counter()
        if row_started - started + slowest > max_seconds:
            report["skipped"].append(name)
            print(f"skipped {name}: the run would pass --max-s {max_seconds:.0f}",
                  file=sys.stderr, flush=True)
            continue
        try:
            models = {n: VARIANTS[n](f) for n in names}
            report["rows"][name] = {
                "tokens": tokens, "d": d, "f": f,
                **fp8_peer.measure_models(name, models, (tokens, d), 4 * 3 * d * f,
                                          step_flops(tokens, d, f), budget, describe),
                "wall_seconds": time.perf_counter() - row_started}
        except Exception as e:  # noqa: BLE001  (out of memory: the next row may fit)
            report["errors"].append({"name": name, "error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc(limit=8)})
        slowest = max(slowest, time.perf_counter() - row_started)
        report["targets"] = targets(report["rows"])
        timing.write_report(report, out, "swiglu", markdown)
    report["targets"] = targets(report["rows"])
    report["elapsed_seconds"] = time.perf_counter() - started
    timing.write_report(report, out, "swiglu", markdown)
    return report


# --- targets (issue 38, the SwiGLU block) ---------------------------------------------------

FAST_RATIO = 1.10  # >= 1.10x Flax FP8's step
TEMP_VS_FLAX_FP8 = 0.9  # temporaries <= 0.9x Flax FP8's (and <= stock bf16's)


def _value(row, name, key, harness=None) -> Optional[float]:
    v = row["variants"].get(name, {})
    return (v.get(harness, {}) if harness else v).get(key)


def targets(rows: dict[str, dict]) -> list[dict[str, Any]]:
    found = []
    for name, row in rows.items():
        ours = "ours_swiglu_fp8"
        ratio = _value(row, ours, "ratio_vs_flax_fp8_direct", "careful")
        if ratio is not None:
            found.append({"target": f"{name}: step >= {FAST_RATIO}x Flax FP8's", "value": ratio,
                          "user": _value(row, ours, "ratio_vs_flax_fp8_direct", "user"),
                          "met": ratio >= FAST_RATIO})
        temp, peer, bf16 = (_value(row, n, "temp_mib") for n in (ours, "flax_fp8_direct",
                                                                  "flax_bf16"))
        if None not in (temp, peer, bf16):
            found.append({"target": f"{name}: temporaries <= {TEMP_VS_FLAX_FP8}x Flax FP8's "
                                    f"and <= bf16's", "value": temp / peer,
                          "met": temp <= TEMP_VS_FLAX_FP8 * peer and temp <= bf16})
        error, peer_error = (_value(row, n, "grad_error_max") for n in (ours, "flax_fp8_direct"))
        if None not in (error, peer_error):
            found.append({"target": f"{name}: gradient error <= Flax FP8's ({peer_error:.4f})",
                          "value": error, "met": error <= peer_error})
    return found


def markdown(report: dict[str, Any]) -> str:
    lines = ["# SwiGLU block: jax_epilog.linen.SwiGLU against bf16 and Flax's FP8", "",
             timing.provenance(report["metadata"], f"flax {report['metadata']['flax']}"), "",
             "| row (tokens, D, F) | variant | careful ms | vs flax_bf16 | vs flax_fp8 | user vs "
             "flax_fp8 | temp MiB | compile s (first step s) | grad error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in report["rows"].items():
        shape = f"{name} ({row['tokens']}, {row['d']}, {row['f']})"
        for variant, v in row["variants"].items():
            careful, user = v.get("careful", {}), v.get("user", {})
            cells = [careful.get("seconds") and 1e3 * careful["seconds"],
                     careful.get("ratio_vs_flax_bf16"), careful.get("ratio_vs_flax_fp8_direct"),
                     user.get("ratio_vs_flax_fp8_direct")]
            lines.append(f"| {shape} | {variant} | " + " | ".join(
                fp8_peer._cell(c) for c in cells) + f" | {fp8_peer._cell(v['temp_mib'], '.0f')} | "
                f"{v['compile_seconds']:.1f} ({v['first_step_seconds']:.1f}) | "
                f"{v['grad_error_max']:.4f} |")
        for variant, error in row.get("variant_errors", {}).items():
            lines.append(f"| {shape} | {variant} | failed: {error} |")
    models = {n: v["model"] for row in report["rows"].values() for n, v in row["variants"].items()}
    lines += ["", "Variants:", ""] + [f"- {n}: `{m}`" for n, m in models.items()]
    lines += ["", "## Targets (issue 38)", ""]
    lines += [f"- {fp8_peer._target_line(t)}" for t in report.get("targets", [])]
    if report["skipped"]:
        lines.append(f"- skipped (--max-s): {', '.join(report['skipped'])}")
    lines += [f"- {e['name']} failed: {e['error']}" for e in report["errors"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rows", help=f"comma-separated: {', '.join(ROWS)} (default: all)")
    parser.add_argument("--variants", help=f"comma-separated, of: {', '.join(VARIANTS)} "
                                           "(default: all; flax_bf16 is always measured)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds over which the timed rounds are spread (default 90; "
                             "smoke 5)")
    parser.add_argument("--max-s", type=float, default=420.0,
                        help="wall-clock bound of the whole run: rows that would end later "
                             "are skipped (default 420)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    args = parser.parse_args(argv)
    table = SMOKE_ROWS if args.smoke else ROWS
    wanted = fp8_peer._names(args.rows, list(table), "rows", parser) or list(table)
    only = fp8_peer._names(args.variants, list(VARIANTS), "variants", parser)
    budget = args.budget_s if args.budget_s is not None else (5.0 if args.smoke else 90.0)
    report = run({n: table[n] for n in wanted}, min(budget, args.max_s), args.out, args.max_s,
                 only)
    for t in report["targets"]:
        print(fp8_peer._target_line(t))
    print(f"wrote {args.out}/swiglu.json, swiglu.md ({len(report['errors'])} errors)")
    return report


if __name__ == "__main__":
    main()
