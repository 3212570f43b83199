"""FP8: the recipe (`recipe`: `Fp8`, `Fp8History`), per-tensor scaling and quantization
(`scaling`: amaxes, scales, saturating casts, delayed scaling's histories and calibration) and
block quantization (`blocks`: 1×128 tiles and 128×128 blocks, the DeepSeek-V3 recipe).
How a layer stack runs the recipe is `layers.fp8_step`.

Imports `op` only: which layers run FP8 is `planning.stack_plan`'s choice, made from the
recipe (`stack_plan.fp8_layers`), so the recipe imports no planner.
"""
