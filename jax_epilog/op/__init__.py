"""The op: `matmul` and what it is made of.

- `epilogs`: the one table of epilog facts (inputs, outputs, shapes, dtypes, what a bias
  gradient sums); `activations`: ReLU, GELU and the bit mask exactly as cuBLASLt computes them;
- `arguments`: `matmul`'s argument checks and the reshape into the kernel's rank-3 form;
- `block_scales`: block-scaled FP8's `BlockScales`, their layouts and their checks;
- `call`: a call as the primitives see it (`Params`, `Problem`) and the two primitives;
- `primitive`: their rules (abstract eval, batching, the differentiation error, registration);
- `sharding`: the outer primitive's lowering, partitioned per device (`custom_partitioning`);
- `lowering`: the inner primitive's lowerings, carrying out the planner's plan;
- `planner`: the planner the op asks how a call runs (`planning` registers its own);
- `padding`: zero padding of unaligned K and N around the kernel;
- `reference`: the one plain-JAX reference of the semantics;
- `matmul`: the public op and its custom VJP; `manual_axes`: `shard_map`'s varying axes.

Imports `runtime` only: nothing here imports `float8`, `planning`, `layers` or `tools`.
"""
