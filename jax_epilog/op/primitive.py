"""The rules of the two primitives (the outer/inner pattern of JAX's cuDNN attention and
TransformerEngine), all registered here; the primitives and a call's parameters are declared in
`call.py`.

- `epilog_matmul_p`, the OUTER primitive, is what a user's jaxpr contains: abstract evaluation,
  the one batching rule, the readable error under differentiation, and a lowering that hands the
  call to the SPMD partitioner (`sharding.partitioned`), which places one local call per device.
- `kernel_p`, the INNER primitive, is one device's call; it appears only inside that lowering.
  It lowers to the cuBLASLt custom call on CUDA and to the reference elsewhere (`lowering.py`).

Both work on the kernel's normalised operands (rank 3, batch first; `ffi/README.md`):
`a (batch, M, K)` [or `(batch, K, M)` transposed], `b (batch|1, K, N)` [or `(batch|1, N, K)`],
then the epilog's inputs. The public `jax_epilog.matmul` reshapes user arrays into this form.
Shapes and dtypes of every input and output come from `epilogs.TABLE`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch as _jax_dispatch
from jax.core import ShapedArray
from jax.interpreters import ad, batching, mlir

from jax_epilog.op import block_scales, lowering

from jax_epilog.op import reference

from jax_epilog.op import sharding
from jax_epilog.op.call import (Params, array_shape, epilog_matmul_p, kernel_p, names_of,
                   plain_product, problem_of, result_dtype_of)
from jax_epilog.op.epilogs import ARRAYS, Epilog, array_dtype, is_fp8


def _abstract_eval(a, b, *args, epilog, transpose_a, transpose_b, allow_tf32, backend,
                   result_dtype=None, result_amax=False, has_c=False, fast_accumulation=False,
                   block_scaling=None):
    del allow_tf32, backend
    epilog = Epilog(epilog)
    params = dict(epilog=epilog, result_dtype=result_dtype, result_amax=result_amax,
                  has_c=has_c)
    out = result_dtype_of(params, a.dtype)
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
    operand_names, output_names = names_of(params, a.dtype)
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
    shardings = sharding.result_shardings(
        Params(epilog, transpose_a, transpose_b, False, result_dtype=result_dtype,
               result_amax=result_amax, has_c=has_c, fast_accumulation=fast_accumulation,
               block_scaling=block_scaling), (a, b, *args))
    if shardings is None:
        return [ShapedArray(shape, dtype) for shape, dtype in avals]
    return [ShapedArray(shape, dtype, sharding=s) for (shape, dtype), s in zip(avals, shardings)]


for _p in (epilog_matmul_p, kernel_p):
    _p.multiple_results = True
    _p.def_abstract_eval(_abstract_eval)


@functools.cache
def _compiled(**params):
    return jax.jit(functools.partial(epilog_matmul_p.bind, **params))


def _impl(*args, **params):
    """Eager calls run the op jitted alone, as JAX runs its own primitives."""
    return _compiled(**params)(*args)


epilog_matmul_p.def_impl(_impl)

# The outer primitive lowers to the SPMD partitioner's call of the inner one (`sharding.py`).
# That lowering runs the partitioner's callback, which needs the devices, as JAX declares for
# `custom_partitioning_p` itself (JAX's cuDNN attention and TransformerEngine do the same).
mlir.register_lowering(epilog_matmul_p, sharding.lower_partitioned)
_jax_dispatch.prim_requires_devices_during_lowering.add(epilog_matmul_p)
# The inner one: the reference everywhere, the cuBLASLt custom call on CUDA (`lowering.py`).
mlir.register_lowering(kernel_p, lowering.lower_reference)
mlir.register_lowering(kernel_p, lowering.lower_cuda, platform="cuda")


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


batching.primitive_batchers[epilog_matmul_p] = _batch_rule


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


ad.primitive_jvps[epilog_matmul_p] = _no_autodiff
