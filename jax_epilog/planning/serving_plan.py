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

from jax_epilog.planning import context
from jax_epilog.planning.context import Choice
from jax_epilog.runtime import settings

WAYS = ("fp8", "fp8_pallas", "xla_fp8", "weight_only")

#: The most rows a layer runs "fp8_pallas" with by default. Measured on the H200
#: (docs/serving.md, benchmarks/results/serving/weight_only_sweep.md; 8 layers per call,
#: K 4096 x N 14336, ratios to XLA's bf16 GEMM with GELU, careful harness (user's)),
#: 2026-12-05: at 1 row the kernel ran 1.62 (1.56), XLA's weight-only GEMM 1.52 (1.52), XLA's
#: FP8 dot 1.43 (1.36); at 16 rows 1.68 (1.63), 1.52 (1.50) and 1.67 (1.71). Those layers
#: shared one input, so XLA quantized it once per call where a model's layers each quantize
#: theirs (three kernels a layer for XLA's FP8 dot; the kernel now quantizes inside). With
#: each layer's own input (an H100, 2026-12-05, the kernel quantizing) it ran 1.67 (1.60)
#: against weight-only's 1.53 (1.51) at 16 rows of K 4096 x N 14336, but 1.24 (1.22)
#: against 1.58 (1.57) at K 14336 x N 4096 and 0.47-0.65 at 64 rows. With K split there
#: (an H100, 2026-12-06) 1.52-1.55 against weight-only's 1.64 at 16 rows, 1.46-1.50 against
#: 1.47 at 1 row, 0.70-0.85 against 1.50 at 64: it stays 0 (the kernel only where
#: JAX_EPILOG_SERVING=fp8_pallas asks).
FP8_PALLAS_MAX_ROWS = 0

#: The most rows a layer runs weight-only with; above, our FP8 GEMM. Measured with each
#: layer's own input (benchmarks/serving_bench.py, ratios to XLA's bf16 GEMM with GELU, careful
#: harness (user's)), 2026-12-05: at 64 rows weight-only ran 1.31 (1.34) where XLA's FP8 dot
#: ran 1.24 (1.28) on the H200 (K 14336 x N 4096), and on an H100 1.47 (1.44) against 1.30
#: (1.15) (K 4096 x N 14336) and 1.48 (1.48) against 1.29 (1.31) (K 14336 x N 4096); at 256
#: rows weight-only ran 0.54-0.83 and our FP8 GEMM 1.08-1.17. XLA's FP8 dot ("xla_fp8"), the
#: default for 17-64 rows until then, was chosen from benchmarks whose layers shared one
#: input, which XLA quantized once for all of them.
WEIGHT_ONLY_MAX_ROWS = 64

#: Weight-only GEMMs over fewer rows are padded to this many. Measured on the H200
#: (docs/serving.md, 8 layers per call): XLA's weight-only GEMM of one row took 25-35 µs
#: at K4096 x N14336, K14336 x N4096 and K8192 x N8192, where 16 rows took 22-25 µs (its
#: one-row dot is not the tiled GEMM that streams the weight).
WEIGHT_ONLY_MIN_ROWS = 16


def serving_way(rows: int) -> Choice:
    """"fp8_pallas", "weight_only", "xla_fp8" or "fp8" for a served layer over `rows` rows (or the
    override), with why."""
    override = settings.serving_override()
    if override is not None:
        return Choice(override, f"JAX_EPILOG_SERVING={override}")
    measured = context.current().serving_table(rows)
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
