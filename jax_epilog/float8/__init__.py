"""FP8: the recipe (`recipe`: `Fp8`, `Fp8History`) and per-tensor scaling and quantization
(`scaling`: amaxes, scales, saturating casts, delayed scaling's histories and calibration).
How a layer stack runs the recipe is `layers.fp8_step`.

Imports `op` and `planning` (which layers run FP8 is `planning.stack_plan`'s choice).
"""
