"""How a call partitions under `jax.jit` with sharded operands (SPMD).

The outer primitive's lowering wraps the inner one in `jax.experimental.custom_partitioning`
with a Shardy sharding rule, so XLA's partitioner runs one local GEMM per device instead of
gathering the operands:

- batch or M sharded (data parallel): local GEMMs, no collective. Bias gradients that sum over M
  (`drelu_bgrad`, `dgelu_bgrad`) get a psum over M's mesh axes.
- N sharded (column parallel: `b`, the bias and the epilog's aux arrays split alike): local
  GEMMs, no collective. A ReLU bit mask packs 128 columns into 16 bytes and the GELU buffer pads
  N to 8, so N stays sharded only when every shard holds whole 128 (8) column blocks; otherwise
  N is replicated.
- K sharded (row parallel): local partial products and a psum over K's mesh axes (float32).
  Epilogs linear in the product (DEFAULT, BGRADA, BGRADB) run in the kernel before the psum;
  every other epilog needs the whole sum first, so the kernel computes the plain partial
  product and the epilog is applied after the psum by the reference's `finish`. With FP8
  operands the partial products are float32 with unit scales, and `finish` applies the scales;
  an FP8 result or an amax is never linear in K.
- A C matrix (SPEC §6) is sharded like y (batch, M, N); alpha and beta are replicated scalars.
  With K sharded, beta · C is added once, by `finish` after the psum, never per shard.
- FP8 scales are replicated scalars; `result_amax` is a pmax over the mesh axes that split
  batch, M or N.

A dimension that does not divide evenly over its mesh axes, or a mesh axis already used by
another dimension, is replicated instead. Which axes each array has comes from
`epilogs.ARRAYS`. A sharded call cannot be serialised with `jax.export` (the partitioner calls
back into Python); single-device exports contain the kernel alone.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_epilog.op import manual_axes, reference
from jax_epilog.op.epilogs import ARRAYS, AUX_DIM_COLUMNS, Epilog, is_fp8
from jax_epilog.op.call import Params, kernel_p, names_of, plain_product, problem_of


def lower_partitioned(ctx, *args, **params):
    """The outer primitive's lowering: `partitioned` lowered in its place."""
    fn = functools.partial(partitioned, Params(**params))
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def partitioned(params: Params, *operands):
    """The inner primitive on `operands`, partitioned by XLA's SPMD partitioner. A block-scaled
    call (whose scales are tiles of a and b, not scalars) is bound whole: under a mesh XLA
    gathers its operands and every device runs the whole GEMM."""
    if params.block_scaling:
        return _bind(params, *operands)
    shapes = tuple(tuple(x.shape) for x in operands)
    return _partitioned_op(params, shapes, jnp.dtype(operands[0].dtype).name)(*operands)


@functools.cache
def _partitioned_op(params: Params, shapes: tuple, dtype: str):
    op = custom_partitioning(functools.partial(_bind, params))
    op.def_partition(partition=functools.partial(_partition, params),
                     sharding_rule=functools.partial(_sharding_rule, params, shapes, dtype))
    return op


def _bind(params: Params, *operands):
    return tuple(kernel_p.bind(*operands, **params._asdict()))


def _arrays(params: Params) -> tuple[str, ...]:
    epilog = params.epilog
    return epilog.input_names + epilog.output_names


def _n_block(params: Params) -> int:
    """Columns a shard of N must hold whole, for the epilog's aux arrays to split with N."""
    return max([1] + [AUX_DIM_COLUMNS.get(d, 1) for name in _arrays(params)
                      for d in ARRAYS[name].dims])


# --- the layout: which mesh axes split each of the GEMM's dimensions ---------------------------

class _Layout(NamedTuple):
    batch: tuple[str, ...]
    m: tuple[str, ...]
    n: tuple[str, ...]
    k: tuple[str, ...]
    b_batch: tuple[str, ...]
    bias_batch: tuple[str, ...]

    def spec(self, dims) -> PartitionSpec:
        axes = {"mask_bytes": self.n, "gelu_cols": self.n}
        return PartitionSpec(*(getattr(self, d, None) or axes.get(d) or None for d in dims))


def _axes(sharding, dim: int) -> tuple[str, ...]:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _layout(params: Params, mesh, arg_shapes) -> _Layout:
    a, b = arg_shapes[0], arg_shapes[1]
    p = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b)
    m_dim, k_dim = (2, 1) if params.transpose_a else (1, 2)
    bk_dim, n_dim = (2, 1) if params.transpose_b else (1, 2)
    bias = arg_shapes[2] if params.epilog.has_bias else None
    n_axes = _axes(b.sharding, n_dim) or (_axes(bias.sharding, 1) if bias is not None else ())
    # A sharded copy wins over a replicated one: slicing a replicated operand is free,
    # gathering a sharded one is not.
    wanted = [("batch", _axes(a.sharding, 0), p.batch, 1), ("m", _axes(a.sharding, m_dim), p.m, 1),
              ("n", n_axes, p.n, _n_block(params)),
              ("k", _axes(a.sharding, k_dim) or _axes(b.sharding, bk_dim), p.k, 1)]
    used: set[str] = set()
    chosen = {}
    for name, axes, size, block in wanted:
        axes = tuple(ax for ax in axes if ax not in used)
        shards = math.prod(mesh.shape[ax] for ax in axes)
        if size % (shards * block):  # uneven shards or split blocks: keep this dim whole
            axes = ()
        used.update(axes)
        chosen[name] = axes
    b_batch = chosen["batch"] if b.shape[0] == p.batch else ()
    bias_batch = chosen["batch"] if bias is not None and bias.shape[0] == p.batch else ()
    return _Layout(b_batch=b_batch, bias_batch=bias_batch, **chosen)


def result_shardings(params: Params, operands) -> tuple | None:
    """Under a mesh with Explicit axes (`jax.make_mesh`'s default, `jax.set_mesh`), where the
    types of the operands say how they are split: the shardings of y and of the aux results,
    as the partitioner will lay them out (`_layout`; K's axes summed away, a dimension that
    cannot split kept whole). None where no operand has an explicitly sharded dimension: the
    results then take the default, as with Auto axes, where the partitioner alone decides."""
    operands = [getattr(x, "aval", x) for x in operands]  # (tracers or their types)
    specs = [getattr(getattr(x, "sharding", None), "spec", None) for x in operands]
    if not any(entry is not None for spec in specs if spec is not None for entry in spec):
        return None
    mesh = next(x.sharding.mesh for x, spec in zip(operands, specs) if spec is not None)
    lay = _layout(params, mesh, operands)
    _, result_names = names_of(params, operands[0].dtype)
    dims = [("batch", "m", "n"), *(ARRAYS[name].dims for name in result_names[1:])]
    return tuple(NamedSharding(mesh, lay.spec(d)) for d in dims)


def _partition(params: Params, mesh, arg_shapes, result_shape):
    del result_shape
    lay = _layout(params, mesh, arg_shapes)
    operand_names, result_names = names_of(params, arg_shapes[0].dtype)
    a_spec = lay.spec(("batch", "k", "m") if params.transpose_a else ("batch", "m", "k"))
    b_spec = lay.spec(("b_batch", "n", "k") if params.transpose_b else ("b_batch", "k", "n"))
    arg_specs = [a_spec, b_spec, *(lay.spec(ARRAYS[name].dims) for name in operand_names[2:])]
    result_specs = [lay.spec(("batch", "m", "n")),
                    *(lay.spec(ARRAYS[name].dims) for name in result_names[1:])]

    def local(*operands):
        return _local_kernel(params, lay, *operands)

    def named(specs):
        return tuple(NamedSharding(mesh, s) for s in specs)

    return mesh, manual_axes.per_device(mesh, local), named(result_specs), named(arg_specs)


def _psum_float32(x, axes):
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def _linear_in_k(params: Params, dtype) -> bool:
    """Whether partial products over K may run the whole call and be added: the epilog is
    linear and so is the store (no FP8 result's scale and saturation, no amax)."""
    fp8_result = params.result_dtype is not None and is_fp8(params.result_dtype)
    del dtype
    return (params.epilog.linear_in_k and not fp8_result and not params.result_amax
            and not params.has_c)  # beta · C must be added once, after the psum


def _local_kernel(params: Params, lay: _Layout, a, b, *args):
    """One device's share: the kernel on local blocks, plus the reductions the layout needs."""
    _, result_names = names_of(params, a.dtype)
    if lay.k and not _linear_in_k(params, a.dtype):
        product = plain_product(kernel_p, params, a, b)
        summed = jax.lax.psum(product.astype(jnp.float32), lay.k)
        outputs = list(reference.finish(
            summed, a, b, *args, epilog=params.epilog, transpose_a=params.transpose_a,
            transpose_b=params.transpose_b, result_dtype=params.result_dtype,
            result_amax=params.result_amax, has_c=params.has_c))
        # (an operand's sum over K, BGRADA/BGRADB, is local: add the shards')
        for i, name in enumerate(result_names[1:], start=1):
            if ARRAYS[name].sums in ("a", "b"):
                outputs[i] = _psum_float32(outputs[i], lay.k)
    else:
        outputs = [_psum_float32(o, lay.k) if lay.k else o
                   for o in kernel_p.bind(a, b, *args, **params._asdict())]
    for i, name in enumerate(result_names[1:], start=1):
        if lay.m and ARRAYS[name].sums == "y":
            outputs[i] = _psum_float32(outputs[i], lay.m)
        if name == "result_amax" and lay.batch + lay.m + lay.n:
            outputs[i] = jax.lax.pmax(outputs[i], lay.batch + lay.m + lay.n)
    return tuple(outputs)


# --- the Shardy rule: how shardings propagate through the call ---------------------------------

def _sharding_rule(params: Params, shapes: tuple, dtype: str, mesh, operand_types,
                   result_types):
    """Einsum-like factors of every operand and result (see `custom_partitioning`).

    With a ReLU mask, N is written as (blocks, 128 columns) and the mask's bytes as (blocks,
    16 bytes), so a sharding of N travels to the mask and back; when N is not a whole number of
    blocks (of 8 columns for the GELU buffer) the aux array's columns stay replicated.
    """
    del mesh, operand_types, result_types
    operand_names, result_names = names_of(params, dtype)
    p = problem_of(shapes[0], shapes[1], params.transpose_a, params.transpose_b)
    factor_sizes: dict[str, int] = {}
    need_replication: tuple[str, ...] = ()
    block = _n_block(params)
    n = aux = "n"
    if block == AUX_DIM_COLUMNS["mask_bytes"] and p.n % block == 0 and p.n > block:
        factor_sizes = dict(nblocks=p.n // block, ncols=block, nbytes=block // 8)
        n, aux = "(nblocks ncols)", "(nblocks nbytes)"  # (a factor of size 1 is invalid)
    elif block > 1 and (block == AUX_DIM_COLUMNS["mask_bytes"] or p.n % block):
        aux = "auxcols"
        need_replication = ("auxcols",)
    factors = {"batch": "batch", "m": "m", "n": n, "mask_bytes": aux, "gelu_cols": aux}

    def term(dims, shape):
        def factor(d, size):
            if d in ("bias_batch", "b_batch"):
                return "batch" if size == p.batch else "single"
            return factors.get(d, d)
        return " ".join(factor(d, size) for d, size in zip(dims, shape))

    b_dims = ("b_batch", "n", "k") if params.transpose_b else ("b_batch", "k", "n")
    operands = [term(("batch", "k", "m") if params.transpose_a else ("batch", "m", "k"), shapes[0]),
                term(b_dims, shapes[1]),
                *(term(ARRAYS[name].dims, shape)
                  for name, shape in zip(operand_names[2:], shapes[2:]))]
    results = [term(("batch", "m", "n"), (p.batch, p.m, p.n)),
               *(term(ARRAYS[name].dims, (p.batch,) * 3) for name in result_names[1:])]
    rule = f"{', '.join(operands)} -> {', '.join(results)}"
    return rule, dict(reduction_factors=("k",), need_replication_factors=need_replication,
                      **factor_sizes)
