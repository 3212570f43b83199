"""The op: `matmul` and what it is made of.

- `epilogs`: the one table of epilog facts (inputs, outputs, shapes, dtypes, what a bias
  gradient sums); `activations`: ReLU, GELU and the bit mask exactly as cuBLASLt computes them;
- `arguments`: `matmul`'s argument checks and the reshape into the kernel's rank-3 form;
- `block_scales`: block-scaled FP8's `BlockScales`, their layouts and their checks;
- `call`: a call as the primitives see it (`Params`, `Problem`) and the two primitives;
- `primitive`: every rule of the outer primitive (abstract eval, eager call, the lowering
  partitioned per device with its partitioning and Shardy rules, batching, the error under
  differentiation);
- `lowering`: every rule of the inner primitive (its lowerings, carrying out the planner's plan);
- `sharding`: which mesh axes split a call's dimensions, and its results' shardings;
- `planner`: the planner the op asks how a call runs (`planning` registers its own);
- `padding`: zero padding of unaligned K and N around the kernel;
- `reference`: the one plain-JAX reference of the semantics;
- `matmul`: the public op and its custom VJP; `manual_axes`: `shard_map`'s varying axes.

Imports `runtime` only: nothing here imports `float8`, `planning`, `layers` or `tools`.
"""
