"""How a layer with a weight stored in FP8 runs (docs/serving.md): an FP8 GEMM or weight-only.

- "fp8": the input quantized to e4m3 (an amax pass and a cast), one cuBLASLt FP8 GEMM with
  bias and activation in its epilog. Twice bf16's rate where the GEMM is compute-bound.
- "weight_only": the 16-bit input times the FP8 weight converted to 16 bits inside XLA's GEMM
  (a convert XLA fuses into the GEMM's operand read), scale, bias and activation in XLA's
  fusion after it. Where few rows share each weight (decoding), the GEMM is bound by reading
  the weight, which is half the bytes either way, and this skips the input's two passes. Only
  the weight is rounded, so its error is smaller too.

The choice depends on the rows alone, so every platform makes the same one and computes the
same values. `JAX_EPILOG_SERVING` overrides it (`runtime.settings.serving_override`).
"""

from __future__ import annotations

from jax_epilog.planning.context import Choice
from jax_epilog.runtime import settings

WAYS = ("fp8", "weight_only")

#: The most rows a layer runs weight-only with. Measured on the H200 (docs/serving.md,
#: benchmarks/results/serving): at K 4096 x N 14336 and K 8192 x N 8192 weight-only ran
#: 0.98-1.12x XLA's bf16 GEMM at 1-64 rows, where the FP8 GEMM ran 0.58-1.05x; at 256 rows
#: weight-only ran 0.66-0.76x and the FP8 GEMM 0.99-1.06x.
WEIGHT_ONLY_MAX_ROWS = 64

#: Weight-only GEMMs over fewer rows are padded to this many. Measured on the H200
#: (docs/serving.md, 8 layers per call): XLA's weight-only GEMM of one row took 25-35 µs
#: at K4096 x N14336, K14336 x N4096 and K8192 x N8192, where 16 rows took 22-25 µs (its
#: one-row dot is not the tiled GEMM that streams the weight).
WEIGHT_ONLY_MIN_ROWS = 16


def serving_way(rows: int) -> Choice:
    """"fp8" or "weight_only" for a served layer over `rows` rows, with why."""
    override = settings.serving_override()
    if override is not None:
        return Choice(override, f"JAX_EPILOG_SERVING={override}")
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return Choice("weight_only", f"rows {rows} <= WEIGHT_ONLY_MAX_ROWS "
                                     f"({WEIGHT_ONLY_MAX_ROWS}): reading the weight bounds it")
    return Choice("fp8", f"rows {rows} > WEIGHT_ONLY_MAX_ROWS ({WEIGHT_ONLY_MAX_ROWS})")
