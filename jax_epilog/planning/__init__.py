"""Planning: every choice of how a call or a layer stack runs, made once, by pure functions of
what is known when it is traced or lowered, with the rule or table entry behind it.

- `context`: what choices depend on beyond the call (`Context`), and `gemm_backend`, the one
  place ``backend="auto"`` becomes "cublaslt" or "xla";
- `call_plan`: one call's plan (`plan_call`: kernel, layout, padding, XLA or the reference)
  and a differentiated call's step (`plan_matmul_step`), and the planner the op asks
  (`PLANNER`, registered in `op.planner` on `import jax_epilog`);
- `stack_plan`: a `dense`/`mlp` stack's plan (`plan_stack`: FP8 per layer, each GEMM's
  epilog and backend, fused or plain);
- `block_plan`: what runs without a stack's plan (a SwiGLU block, a block-scaled FP8 stack,
  layers of weights stored in FP8) and why, told to `explain`; `serving_plan`: the way a
  layer of a stored FP8 weight runs; `attention_plan`: how a decode step reads an FP8 KV
  cache and how it is laid out (its own table, `tables/attention/decode.json`);
- `table_format`: the measured decision tables' entries and files (shipped in `tables/`, or
  the user's from `python -m jax_epilog.tune`); `decisions`: how they decide (the nearest
  measured entry, the rules without one).

Imports `runtime` and `op` (and may import `float8`, the recipe it plans with, which sits
below it); nothing here imports `layers` or `tools`.
"""
