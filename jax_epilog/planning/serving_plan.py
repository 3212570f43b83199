"""How a layer with a weight stored in FP8 runs (docs/serving.md): one of three ways.

- "fp8": the input quantized to e4m3 (an amax pass and a cast, or a static scale), one
  cuBLASLt FP8 GEMM with bias and activation in its epilog. Twice bf16's rate where the GEMM
  is compute-bound.
- "xla_fp8": the same quantized input times the stored weight by XLA's own FP8 dot, scale,
  bias and activation in XLA's fusion after it. At 17-64 rows XLA's autotuned choice of
  kernel streams the weight faster than our GEMM's heuristic choice does.
- "weight_only": the 16-bit input times the FP8 weight converted to 16 bits inside XLA's GEMM
  (a convert XLA fuses into the GEMM's operand read), scale, bias and activation in XLA's
  fusion after it. Where very few rows share each weight, the GEMM is bound by reading the
  weight, which is half the bytes either way, and this skips the input's two passes. Only
  the weight is rounded, so its error is smaller too. On CUDA it is one Pallas kernel
  (`float8.weight_only_kernel`) where the shape fits it.
- "weight_only_xla": weight-only as XLA's GEMM and fusion on every platform (what
  "weight_only" runs where the kernel does not fit; chosen only by `JAX_EPILOG_SERVING`).

The choice depends on the rows alone, so every platform makes the same one and computes the
same values. `JAX_EPILOG_SERVING` overrides it (`runtime.settings.serving_override`).
"""

from __future__ import annotations

from jax_epilog.planning.context import Choice
from jax_epilog.runtime import settings

WAYS = ("fp8", "xla_fp8", "weight_only", "weight_only_xla")

#: The most rows a layer runs weight-only with, and the most it runs XLA's FP8 dot with.
#: Measured on the H200 (docs/serving.md, benchmarks/results/serving; 8 layers per call, K
#: 4096 x N 14336, ratios to XLA's bf16 GEMM, careful harness (user's)): at 1 and 16 rows
#: weight-only ran 1.53 (1.32) and 1.50 (1.49), XLA's FP8 dot 1.36 (1.07) and 1.70 (1.39);
#: at 64 rows weight-only 1.25 (1.21), XLA's FP8 dot 1.55 (1.54), our FP8 GEMM 1.25 (1.21);
#: at 256 rows our FP8 GEMM 1.87 (2.12), XLA's FP8 dot 1.29 (1.54).
WEIGHT_ONLY_MAX_ROWS = 16
XLA_FP8_MAX_ROWS = 64

#: On CUDA, where the shape fits (`weight_only_kernel.fits`): whether the "weight_only" way
#: runs its Pallas kernel (`float8.weight_only_kernel`) rather than XLA's GEMM and fusion, and
#: whether the "xla_fp8" way runs the FP8 Pallas GEMM of few rows
#: (`float8.few_rows_fp8_kernel`) rather than XLA's FP8 dot and fusion. The arithmetic is the
#: same either way (the sums in another order).
PALLAS_WEIGHT_ONLY = True
PALLAS_FEW_ROWS_FP8 = False

#: Weight-only GEMMs over fewer rows are padded to this many. Measured on the H200
#: (docs/serving.md, 8 layers per call): XLA's weight-only GEMM of one row took 25-35 µs
#: at K4096 x N14336, K14336 x N4096 and K8192 x N8192, where 16 rows took 22-25 µs (its
#: one-row dot is not the tiled GEMM that streams the weight).
WEIGHT_ONLY_MIN_ROWS = 16


def serving_way(rows: int) -> Choice:
    """"fp8", "xla_fp8" or "weight_only" for a served layer over `rows` rows, with why."""
    override = settings.serving_override()
    if override is not None:
        return Choice(override, f"JAX_EPILOG_SERVING={override}")
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        return Choice("weight_only", f"rows {rows} <= WEIGHT_ONLY_MAX_ROWS "
                                     f"({WEIGHT_ONLY_MAX_ROWS}): reading the weight bounds it")
    if rows <= XLA_FP8_MAX_ROWS:
        return Choice("xla_fp8", f"rows {rows} <= XLA_FP8_MAX_ROWS ({XLA_FP8_MAX_ROWS}): "
                                 f"XLA's autotuned FP8 dot streams the weight fastest")
    return Choice("fp8", f"rows {rows} > XLA_FP8_MAX_ROWS ({XLA_FP8_MAX_ROWS})")
