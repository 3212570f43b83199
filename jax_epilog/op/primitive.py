"""The outer primitive `epilog_matmul_p`, what a user's jaxpr holds, and every rule of it in
this one module, as TransformerEngine's `BasePrimitive` and JAX's cuDNN attention keep theirs:
abstract evaluation (`abstract_eval`, which the inner primitive shares), the eager
implementation, the lowering through XLA's SPMD partitioner (`_lower`: the partitioning rule
`_partition` and the Shardy rule `_sharding_rule`), the one batching rule, and the readable error
under differentiation (the op is differentiated by `matmul`'s custom VJP). They are registered
together at the end. The inner primitive `kernel_p`, one device's call, appears only inside
this lowering; its rules are in `lowering.py`. The primitives and a call's parameters are
declared in `call.py`, the mesh layout of a call in `sharding.py`.

Both primitives work on the kernel's normalised operands (rank 3, batch first; `ffi/README.md`):
`a (batch, M, K)` [or `(batch, K, M)` transposed], `b (batch|1, K, N)` [or `(batch|1, N, K)`],
then the epilog's inputs. The public `jax_epilog.matmul` reshapes user arrays into this form.
Shapes and dtypes of every input and output come from `epilogs.TABLE`.

Under `jax.jit` with sharded operands the lowering hands the call to XLA's partitioner
(`custom_partitioning`), which runs one local GEMM per device instead of gathering operands:

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

A block-scaled call (whose scales are tiles of a and b, not scalars) is bound whole: under a
mesh XLA gathers its operands and every device runs the whole GEMM. A sharded call cannot be
serialised with `jax.export` (the partitioner calls back into Python); single-device exports
contain the kernel alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch as _jax_dispatch
from jax.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from jax_epilog.op import block_scales, epilogs, manual_axes, reference, sharding
from jax_epilog.op.call import (Params, array_shape, epilog_matmul_p, kernel_p, names_of,
                                plain_product, problem_of)
from jax_epilog.op.epilogs import ARRAYS, AUX_DIM_COLUMNS, Epilog, array_dtype, is_fp8


# --- abstract evaluation and the eager implementation --------------------------------------

def abstract_eval(a, b, *args, epilog, transpose_a, transpose_b, allow_tf32, backend,
                   result_dtype=None, result_amax=False, has_c=False, fast_accumulation=False,
                   block_scaling=None):
    del allow_tf32, backend
    epilog = Epilog(epilog)
    out = jnp.dtype(result_dtype or a.dtype)  # as `call.result_dtype_of`
    # `matmul` has already given readable errors; these guard direct binds.
    if a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"epilog_matmul: expects rank-3 operands, got {a.shape} and {b.shape}")
    if a.dtype != b.dtype and not (is_fp8(a.dtype) and is_fp8(b.dtype)):
        raise TypeError(f"epilog_matmul: a and b dtypes differ ({a.dtype} vs {b.dtype})")
    if out != a.dtype and not is_fp8(a.dtype):
        raise TypeError(f"epilog_matmul: result dtype {out} needs FP8 operands, got {a.dtype}")
    if fast_accumulation and not is_fp8(a.dtype):
        raise ValueError(f"epilog_matmul: fast_accumulation needs FP8 operands, got {a.dtype}")
    p = problem_of(a.shape, b.shape, transpose_a, transpose_b)
    b_k = b.shape[2] if transpose_b else b.shape[1]
    if b_k != p.k or b.shape[0] not in (1, p.batch):
        raise ValueError(f"epilog_matmul: b {b.shape} does not fit a {a.shape}")
    operand_names = epilogs.operand_names(epilog, a.dtype, out, has_c)
    output_names = epilogs.result_names(epilog, result_amax)
    if len(args) != len(operand_names) - 2:
        raise ValueError(f"epilog_matmul: {epilog.name} takes {operand_names[2:]}, "
                         f"got {len(args)} inputs")
    if block_scaling and (not is_fp8(a.dtype) or p.batch != 1 or b.shape[0] != 1):
        raise ValueError(f"epilog_matmul: block scales need FP8 operands of batch 1, got "
                         f"{a.dtype} {a.shape} and {b.shape}")
    # Block-scaled calls: the scale operands are arrays of their tiles (`block_scales`).
    blocks = dict(zip(("scale_a", "scale_b"), zip(block_scaling or (), (p.m, p.n))))
    bias_batch = 1
    for name, x in zip(operand_names[2:], args):
        bias_batch = x.shape[0] if name == "bias" else bias_batch
        expected = (block_scales.scale_shape(*blocks[name], p.k) if name in blocks
                    else array_shape(name, p, bias_batch))
        if tuple(x.shape) != expected or bias_batch not in (1, p.batch):
            raise ValueError(f"epilog_matmul: {name} has shape {x.shape}, expected {expected}")
        if ARRAYS[name].dtype == "float32" and x.dtype != jnp.float32:
            raise TypeError(f"epilog_matmul: {name} must be float32, got {x.dtype}")
        if name == "c" and x.dtype != array_dtype("c", out):
            raise TypeError(f"epilog_matmul: c must be {array_dtype('c', out)}, got {x.dtype}")
    avals = [((p.batch, p.m, p.n), out)] + [
        (array_shape(name, p), array_dtype(name, out)) for name in output_names[1:]]
    shardings = result_shardings(
        Params(epilog, transpose_a, transpose_b, False, result_dtype=result_dtype,
               result_amax=result_amax, has_c=has_c, fast_accumulation=fast_accumulation,
               block_scaling=block_scaling), (a, b, *args))
    if shardings is None:
        return [ShapedArray(shape, dtype) for shape, dtype in avals]
    return [ShapedArray(shape, dtype, sharding=s) for (shape, dtype), s in zip(avals, shardings)]


def result_shardings(params: Params, operands) -> tuple | None:
    """Under a mesh with Explicit axes (`jax.make_mesh`'s default, `jax.set_mesh`), where the
    types of the operands say how they are split: the shardings of y and of the aux results,
    as the partitioner will lay them out (`mesh_layout`; K's axes summed away, a dimension that
    cannot split kept whole). None where no operand has an explicitly sharded dimension: the
    results then take the default, as with Auto axes, where the partitioner alone decides."""
    operands = [getattr(x, "aval", x) for x in operands]  # (tracers or their types)
    specs = [getattr(getattr(x, "sharding", None), "spec", None) for x in operands]
    if not any(entry is not None for spec in specs if spec is not None for entry in spec):
        return None
    mesh = next(x.sharding.mesh for x, spec in zip(operands, specs) if spec is not None)
    lay = sharding.mesh_layout(params, mesh, operands)
    _, result_names = names_of(params, operands[0].dtype)
    dims = [("batch", "m", "n"), *(ARRAYS[name].dims for name in result_names[1:])]
    return tuple(NamedSharding(mesh, lay.spec(d)) for d in dims)


@functools.cache
def _compiled(**params):
    return jax.jit(functools.partial(epilog_matmul_p.bind, **params))


def _impl(*args, **params):
    """Eager calls run the op jitted alone, as JAX runs its own primitives."""
    return _compiled(**params)(*args)


# --- the lowering: one local call per device, placed by XLA's SPMD partitioner -------------

def _lower(ctx, *args, **params):
    params = Params(**params)
    if params.block_scaling:  # bound whole (see the module doc)
        fn = functools.partial(_bind, params)
    else:
        shapes = tuple(tuple(x.shape) for x in ctx.avals_in)
        fn = _partitioned_op(params, shapes, jnp.dtype(ctx.avals_in[0].dtype).name)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


@functools.cache
def _partitioned_op(params: Params, shapes: tuple, dtype: str):
    op = custom_partitioning(functools.partial(_bind, params))
    op.def_partition(partition=functools.partial(_partition, params),
                     sharding_rule=functools.partial(_sharding_rule, params, shapes, dtype))
    return op


def _bind(params: Params, *operands):
    return tuple(kernel_p.bind(*operands, **params._asdict()))


def _partition(params: Params, mesh, arg_shapes, result_shape):
    del result_shape
    lay = sharding.mesh_layout(params, mesh, arg_shapes)
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


def _local_kernel(params: Params, lay: sharding.MeshLayout, a, b, *args):
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
    block = sharding.n_block(params)
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


# --- batching: a vmapped axis is folded into the batch axis ---------------------------------
# (V, batch, ...) -> (V * batch, ...): one strided-batched GEMM. Operands that may be shared
# (b, bias: batch 1, stride 0; the FP8 scales, scalars) stay shared when they are not mapped;
# anything else that is not mapped is broadcast along V.
#
# An FP8 call folds the same way when its scales are not mapped and it returns no amax. A
# mapped scale (one per example) cannot be one GEMM's scale, and `result_amax` must be one
# amax per example, where a folded GEMM gives one for all: those calls run one GEMM for all
# examples too, the plain product in float32 with unit scales (`plain_product`), and then the
# reference's `finish` (scales, epilog, amax, cast) vmapped over the examples, elementwise work
# that XLA fuses. Never a loop over examples. A call with a C matrix (SPEC §6) whose alpha or
# beta is mapped does the same with the exact float32 product (one batched dot).

_SHAREABLE = ("b", "bias")


def _fold_batch_axis(x, bdim, name: str, size: int, batch: int):
    if ARRAYS.get(name, None) is not None and ARRAYS[name].dims == ():
        return x  # a scale shared by every example (mapped scales do not fold)
    if bdim is None:
        if name in _SHAREABLE and x.shape[0] == 1:
            return x
        x = jnp.broadcast_to(x[None], (size, *x.shape))
    else:
        x = jnp.moveaxis(x, bdim, 0)
    if x.shape[1] != batch:  # a shared operand of a mapped call: give every batch its copy
        x = jnp.broadcast_to(x, (size, batch, *x.shape[2:]))
    return x.reshape(size * batch, *x.shape[2:])


def _batch_rule(args, dims, **params):
    if params.get("block_scaling"):
        raise NotImplementedError(
            "jax_epilog.matmul with block scales under jax.vmap is not supported: a block-"
            "scaled call is one 2-D GEMM; fold the mapped axis into the rows of a instead")
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    names, _ = names_of(params, args[0].dtype)
    a, a_dim = args[0], dims[0]
    batch = a.shape[0] if a_dim is None else a.shape[1 if a_dim == 0 else 0]
    scale_mapped = any(d is not None for name, d in zip(names, dims)
                       if ARRAYS.get(name) is not None and ARRAYS[name].dims == ())
    if scale_mapped or params.get("result_amax", False):
        return _batch_unfolded(args, dims, size, batch, Params(**params))
    folded = [_fold_batch_axis(x, d, name, size, batch) for x, d, name in zip(args, dims, names)]
    outs = epilog_matmul_p.bind(*folded, **params)
    outs = [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]
    return outs, [0] * len(outs)


def _batch_unfolded(args, dims, size: int, batch: int, params: Params):
    """A vmapped call with per-example scales, alpha or beta, or an amax (see above)."""
    a, b = (_fold_batch_axis(x, d, name, size, batch)
            for x, d, name in zip(args[:2], dims[:2], ("a", "b")))
    if is_fp8(a.dtype):
        product = plain_product(epilog_matmul_p, params, a, b)
    else:  # per-example alpha/beta (SPEC §6): the float32 product, exact, as one batched dot
        product = reference.product(a, b, params.transpose_a, params.transpose_b,
                                     params.allow_tf32, jnp.float32)
    product = product.reshape(size, batch, *product.shape[1:])
    finish = functools.partial(reference.finish, epilog=params.epilog,
                               transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                               result_dtype=params.result_dtype,
                               result_amax=params.result_amax, has_c=params.has_c)
    outs = jax.vmap(finish, in_axes=(0, *dims))(product, *args)
    return list(outs), [0] * len(outs)


def _no_autodiff(primals, tangents, *, epilog, **params):
    del tangents, params
    epilog = Epilog(epilog)
    if is_fp8(primals[0].dtype):
        raise TypeError(
            "jax_epilog.matmul with FP8 operands is not differentiable; for FP8 training use "
            "jax_epilog.dense / jax_epilog.mlp with fp8= (or the Flax modules' fp8= "
            "argument), which quantize in the forward and backward passes for you.")
    if epilog.is_backward:
        raise TypeError(
            f"jax_epilog.matmul with epilog={epilog.name} is itself a gradient computation and "
            "cannot be differentiated; differentiate the forward computation instead "
            "(jax_epilog.dense / jax_epilog.mlp, or matmul with a forward epilog).")
    raise TypeError("epilog_matmul is differentiated through jax_epilog.matmul's custom_vjp; "
                    "bind it through jax_epilog.matmul.")


# --- registration: every rule of the outer primitive ----------------------------------------

epilog_matmul_p.multiple_results = True
epilog_matmul_p.def_abstract_eval(abstract_eval)
epilog_matmul_p.def_impl(_impl)
mlir.register_lowering(epilog_matmul_p, _lower)
# The lowering runs the partitioner's callback, which needs the devices, as JAX declares for
# `custom_partitioning_p` itself (JAX's cuDNN attention and TransformerEngine do the same).
_jax_dispatch.prim_requires_devices_during_lowering.add(epilog_matmul_p)
batching.primitive_batchers[epilog_matmul_p] = _batch_rule
ad.primitive_jvps[epilog_matmul_p] = _no_autodiff
