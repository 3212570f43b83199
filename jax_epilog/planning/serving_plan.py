"""How a layer with a weight stored in FP8 runs (docs/serving.md): one of four ways.

- "fp8": the input quantized to e4m3 (an amax pass and a cast, or a static scale), one
  cuBLASLt FP8 GEMM with bias and activation in its epilog. Twice bf16's rate where the GEMM
  is compute-bound.
- "fp8_pallas": one Pallas kernel on CUDA (`float8.few_rows_fp8_kernel`) that quantizes the
  input as "fp8" does and multiplies it by the stored weight (both operands FP8), scale,
  bias and activation before its store; the input quantized in XLA and XLA's FP8 dot
  ("xla_fp8") on other platforms or where the shape does not fit it. Few rows share each
  weight, so the GEMM is bound by reading the weight.
- "xla_fp8": the input quantized as for "fp8" (in XLA) times the stored weight by XLA's own
  FP8 dot, scale, bias and activation in XLA's fusion after it (only where asked for).
- "weight_only": the 16-bit input times the FP8 weight converted to 16 bits inside XLA's GEMM
  (a convert XLA fuses into the GEMM's operand read), scale, bias and activation in XLA's
  fusion after it. Only the weight is rounded, so its error is smaller.

The choice depends on the rows alone: `JAX_EPILOG_SERVING` where set
(`runtime.settings.serving_override`); on a CUDA GPU, the way `python -m jax_epilog.tune
--serving` measured fastest there at the nearest rows (a serving entry of the user's or the
shipped decision table: the planning context's `serving_table`, `decisions.serving_decision`;
`explain` asks the reference GPU's); else the measured constants below, so
that every platform without such an entry makes the same choice and computes the same values.
"""

from __future__ import annotations

from typing import Optional

from jax_epilog.planning import context
from jax_epilog.planning.context import Choice, Context
from jax_epilog.runtime import settings

WAYS = tuple(way for way in settings.SERVING_WAYS if way != "auto")  # the ways themselves

#: The most rows a layer runs "fp8_pallas" with by default: none (the kernel only where
#: JAX_EPILOG_SERVING=fp8_pallas asks). With each layer quantizing its own input, as a model's
#: layers do, the kernel beat weight-only in one shape of few rows and lost in the others and
#: at 64 rows, K split or not; its early wins came from benchmarks whose layers shared one
#: input, which XLA quantized once for all (docs/serving.md,
#: benchmarks/results/serving/weight_only_sweep.md, benchmarks/results/serving/serving.md).
FP8_PALLAS_MAX_ROWS = 0

#: The most rows a layer runs weight-only with; above, our FP8 GEMM. Measured with each
#: layer's own input (benchmarks/serving_bench.py, benchmarks/results/serving/serving.md):
#: up to 64 rows reading the FP8 weight dominates, and weight-only beat XLA's FP8 dot, whose
#: input quantization is a pass of its own; from a few hundred rows the GEMM dominates and
#: our FP8 GEMM beats weight-only's 16-bit one.
WEIGHT_ONLY_MAX_ROWS = 64

#: Weight-only GEMMs over fewer rows are padded to this many: XLA's one-row dot is not the
#: tiled GEMM that streams the weight, and ran slower than the same GEMM over 16 rows
#: (docs/serving.md).
WEIGHT_ONLY_MIN_ROWS = 16


def serving_way(rows: int, ctx: Optional[Context] = None) -> Choice:
    """"fp8_pallas", "weight_only", "xla_fp8" or "fp8" for a served layer over `rows` rows (or the
    override), with why."""
    ctx = context.current() if ctx is None else ctx
    if ctx.serving_way is not None:
        return Choice(ctx.serving_way, f"forced_serving_way({ctx.serving_way!r})")
    override = settings.serving_override()
    if override is not None:
        return Choice(override, f"JAX_EPILOG_SERVING={override}")
    measured = ctx.serving_table(rows)
    if measured is not None and measured.choice in WAYS:
        entry = measured.entry
        return Choice(measured.choice, f"measured fastest at {entry.rows} rows "
                                       f"({entry.times}; the {measured.source} decision table)")
    if rows <= FP8_PALLAS_MAX_ROWS:
        return Choice("fp8_pallas", f"rows {rows} <= FP8_PALLAS_MAX_ROWS "
                                    f"({FP8_PALLAS_MAX_ROWS}): reading the weight bounds it")
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return Choice("weight_only", f"rows {rows} <= WEIGHT_ONLY_MAX_ROWS "
                                     f"({WEIGHT_ONLY_MAX_ROWS}): reading the weight bounds it")
    return Choice("fp8", f"rows {rows} > WEIGHT_ONLY_MAX_ROWS ({WEIGHT_ONLY_MAX_ROWS})")
