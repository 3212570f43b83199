"""How `epilog_matmul_p` partitions under `jax.jit` with sharded operands (SPMD).

The kernel call is wrapped in `jax.experimental.custom_partitioning` with a Shardy sharding
rule, so XLA's partitioner runs one local GEMM per device instead of gathering the operands:

- batch or M sharded (data parallel): local GEMMs, no collective. The bias gradients that sum
  over M (`drelu_bgrad`, `dgelu_bgrad`) get a psum over M's mesh axes.
- N sharded (column parallel: `b`, the bias and the epilog's aux arrays split alike): local
  GEMMs, no collective. A ReLU bit mask packs 128 columns into 16 bytes and the GELU buffer pads
  N to 8, so N stays sharded only when every shard holds whole 128 (8) column blocks; otherwise
  N is replicated.
- K sharded (row parallel): local partial products and a psum over K's mesh axes (float32).
  The epilogs that are linear in the product (DEFAULT, BGRADA, BGRADB) run in the kernel before
  the psum; every other epilog needs the whole sum first, so the kernel computes the plain
  partial product and the epilog (bias, activation, mask, bias gradient) is applied after the
  psum by the reference's elementwise functions.

A dimension that does not divide evenly over its mesh axes, or a mesh axis already used by
another dimension, is replicated instead. Under `shard_map` (every axis manual) and on one
device the wrapper disappears and the kernel is called directly. `custom_partitioning` has no
vmap rule, so the wrapper carries one (`custom_vmap`) that folds the mapped axis into the
kernel's batch axis, as the primitive's own batching rule does. A sharded call cannot be
serialised with `jax.export` (the partitioner calls back into Python); single-device exports
contain the kernel alone and are unaffected.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad
from jax.sharding import NamedSharding, PartitionSpec

from . import reference
from .epilogs import Epilog
from .primitive import epilog_matmul_p, fold_batch_axis, problem_of

# The epilogs whose every output is a sum over K of local terms: a psum of local results is exact.
_LINEAR_IN_K = (Epilog.DEFAULT, Epilog.BGRADA, Epilog.BGRADB)
_SUM_OVER_M = (Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD)
_RELU_BLOCK, _GELU_BLOCK = 128, 8  # columns per mask block (16 bytes) / per GELU pad


class _Call(NamedTuple):
    """Static description of one kernel call: its parameters and operand shapes (hashable)."""

    params: tuple  # (epilog, transpose_a, transpose_b, allow_tf32)
    shapes: tuple  # shapes of a, b, then the epilog's inputs

    @property
    def epilog(self) -> Epilog:
        return Epilog(self.params[0])

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(zip(("epilog", "transpose_a", "transpose_b", "allow_tf32"), self.params))


def partitioned_kernel(config, a, b, *inputs) -> tuple:
    """The kernel's outputs for normalised operands, partitioned under SPMD (see module doc).

    `config` is `matmul.KernelConfig` (epilog, transpose_a, transpose_b, allow_tf32).
    """
    call = _Call(tuple(config), tuple(tuple(x.shape) for x in (a, b, *inputs)))
    return _op(call)(a, b, *inputs)


@functools.cache
def _op(call: _Call):
    partitioned = custom_partitioning(functools.partial(_bind, call))
    partitioned.def_partition(partition=functools.partial(_partition, call),
                              sharding_rule=functools.partial(_sharding_rule, call))

    @jax.custom_batching.custom_vmap
    def op(*operands):
        return partitioned(*operands)

    @op.def_vmap
    def _vmap_rule(axis_size, in_batched, *operands):
        names = ("a", "b", *call.epilog.input_names)
        batch = operands[0].shape[1] if in_batched[0] else operands[0].shape[0]
        folded = [fold_batch_axis(x, 0 if mapped else None, name, axis_size, batch)
                  for x, mapped, name in zip(operands, in_batched, names)]
        outs = partitioned_kernel(call.params, *folded)
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, (True,) * len(outs)

    # Differentiating the kernel is an error the primitive words (matmul differentiates
    # through its own custom_vjp); custom_partitioning's own message would be obscure.
    guarded = jax.custom_jvp(op)
    guarded.defjvp(lambda primals, tangents:
                   ad.primitive_jvps[epilog_matmul_p](primals, tangents, **call.kwargs))
    return guarded


def _bind(call: _Call, *operands):
    return tuple(epilog_matmul_p.bind(*operands, **call.kwargs))


# --- the layout: which mesh axes split each of the GEMM's dimensions ---------------------------

class _Layout(NamedTuple):
    batch: tuple[str, ...]
    m: tuple[str, ...]
    n: tuple[str, ...]
    k: tuple[str, ...]
    b_batch: tuple[str, ...]
    bias_batch: tuple[str, ...]


def _axes(sharding, dim: int) -> tuple[str, ...]:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _n_block(epilog: Epilog) -> int:
    """Columns a shard of N must hold whole, for the epilog's aux arrays to split with N."""
    if "relu_aux" in (epilog.aux_input, epilog.aux_output):
        return _RELU_BLOCK
    if "gelu_aux" in (epilog.aux_input, epilog.aux_output):
        return _GELU_BLOCK
    return 1


def _layout(call: _Call, mesh, arg_shapes) -> _Layout:
    kw = call.kwargs
    a, b = arg_shapes[0], arg_shapes[1]
    p = problem_of(a.shape, b.shape, kw["transpose_a"], kw["transpose_b"])
    m_dim, k_dim = (2, 1) if kw["transpose_a"] else (1, 2)
    bk_dim, n_dim = (2, 1) if kw["transpose_b"] else (1, 2)
    bias = arg_shapes[2] if call.epilog.has_bias else None
    n_axes = _axes(b.sharding, n_dim) or (_axes(bias.sharding, 1) if bias is not None else ())
    # A sharded copy wins over a replicated one: slicing a replicated operand is free,
    # gathering a sharded one is not.
    wanted = [("batch", _axes(a.sharding, 0), p.batch, 1), ("m", _axes(a.sharding, m_dim), p.m, 1),
              ("n", n_axes, p.n, _n_block(call.epilog)),
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


def _spec(*dims: tuple[str, ...]) -> PartitionSpec:
    return PartitionSpec(*(d if d else None for d in dims))


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    del result_shape
    kw = call.kwargs
    epilog = call.epilog
    lay = _layout(call, mesh, arg_shapes)
    a_spec = _spec(lay.batch, lay.k, lay.m) if kw["transpose_a"] else _spec(lay.batch, lay.m, lay.k)
    b_spec = _spec(lay.b_batch, lay.n, lay.k) if kw["transpose_b"] else \
        _spec(lay.b_batch, lay.k, lay.n)
    input_specs = {"bias": _spec(lay.bias_batch, lay.n), "relu_aux": _spec(lay.batch, lay.m, lay.n),
                   "gelu_aux": _spec(lay.batch, lay.m, lay.n)}
    arg_specs = [a_spec, b_spec, *(input_specs[name] for name in epilog.input_names)]
    result_specs = [_spec(lay.batch, lay.m, lay.n)]
    if epilog.aux_output:
        result_specs.append(_spec(lay.batch, lay.m, lay.n))
    if epilog in _SUM_OVER_M:
        result_specs.append(_spec(lay.batch, lay.n))
    elif epilog == Epilog.BGRADA:
        result_specs.append(_spec(lay.batch, lay.m))
    elif epilog == Epilog.BGRADB:  # one row per batch, also for a shared b
        result_specs.append(_spec(lay.batch, lay.n))

    def local(*operands):
        return _local_kernel(call, lay, *operands)

    def named(specs):
        return tuple(NamedSharding(mesh, s) for s in specs)

    return mesh, local, named(result_specs), named(arg_specs)


def _psum_float32(x, axes):
    return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)


def _local_kernel(call: _Call, lay: _Layout, a, b, *inputs):
    """One device's share: the kernel on local blocks, plus the reductions the layout needs."""
    epilog = call.epilog
    kw = call.kwargs
    if lay.k and epilog not in _LINEAR_IN_K:
        product = epilog_matmul_p.bind(a, b, **{**kw, "epilog": int(Epilog.DEFAULT)})[0]
        summed = jax.lax.psum(product.astype(jnp.float32), lay.k)
        outputs = reference.apply_epilog(summed, *inputs, epilog=epilog, dtype=a.dtype)
    else:
        outputs = [_psum_float32(o, lay.k) if lay.k else o
                   for o in epilog_matmul_p.bind(a, b, *inputs, **kw)]
    if lay.m and epilog in _SUM_OVER_M:
        outputs[-1] = _psum_float32(outputs[-1], lay.m)
    return tuple(outputs)


# --- the Shardy rule: how shardings propagate through the call ---------------------------------

def _sharding_rule(call: _Call, mesh, operand_types, result_types):
    """Einsum-like factors of every operand and result (see `custom_partitioning`).

    With a ReLU mask, N is written as (blocks, 128 columns) and the mask's bytes as (blocks,
    16 bytes), so a sharding of N travels to the mask and back; when N is not a whole number of
    blocks (of 8 columns for the GELU buffer) the aux array's columns stay replicated.
    """
    del mesh, operand_types, result_types
    kw = call.kwargs
    epilog = call.epilog
    a_shape, b_shape = call.shapes[0], call.shapes[1]
    p = problem_of(a_shape, b_shape, kw["transpose_a"], kw["transpose_b"])
    factor_sizes: dict[str, int] = {}
    need_replication: tuple[str, ...] = ()
    block = _n_block(epilog)
    if block == _RELU_BLOCK and p.n % block == 0 and p.n > block:  # (a factor of 1 is invalid)
        factor_sizes = dict(nblocks=p.n // block, ncols=block, nbytes=block // 8)
        n, aux = "(nblocks ncols)", "(nblocks nbytes)"
    elif block == 1 or p.n % block == 0:  # no aux array, or the GELU buffer is N wide
        n = aux = "n"
    else:
        n, aux = "n", "auxcols"
        need_replication = ("auxcols",)
    batch_of = {p.batch: "batch"}
    b_batch = batch_of.get(b_shape[0], "single")
    a = "batch k m" if kw["transpose_a"] else "batch m k"
    b = f"{b_batch} {n} k" if kw["transpose_b"] else f"{b_batch} k {n}"
    inputs = {"bias": lambda shape: f"{batch_of.get(shape[0], 'single')} {n}",
              "relu_aux": lambda shape: f"batch m {aux}",
              "gelu_aux": lambda shape: f"batch m {aux}"}
    operands = [a, b, *(inputs[name](shape)
                        for name, shape in zip(epilog.input_names, call.shapes[2:]))]
    results = [f"batch m {n}"]
    if epilog.aux_output:
        results.append(f"batch m {aux}")
    if epilog in _SUM_OVER_M:
        results.append(f"batch {n}")
    elif epilog == Epilog.BGRADA:
        results.append("batch m")
    elif epilog == Epilog.BGRADB:
        results.append(f"batch {n}")
    rule = f"{', '.join(operands)} -> {', '.join(results)}"
    return rule, dict(reduction_factors=("k",), need_replication_factors=need_replication,
                      **factor_sizes)
