"""`jax_epilog.matmul`: the public op (SPEC §1), its argument checks and its gradient.

The user's arrays are checked here, once, with errors that name the argument, and reshaped
(never copied) into the kernel's rank-3 form: a 2-D `b` shared by every leading index of `a`
folds those indices into M, so the whole call is one GEMM; otherwise leading dims become one
strided batch. What each epilog reads and writes comes from `epilogs.TABLE`.

The forward epilogs are differentiable through one `jax.custom_vjp` (`_forward`). Its forward
keeps what the backward needs: ReLU's output (its derivative is y > 0, 0 at 0, as
`jax.nn.relu`'s), or the mask where the call returns it (RELU_AUX*: 1 at 0), GELU's
pre-activation. Its backward (`activation_gradient`, which the layers use too, then dA and
`_weight_gradient`) is two more `matmul` calls in the operands' dtype, the bias gradient from the
weight-gradient GEMM (BGRADB, or BGRADA for a transposed b). Where every GEMM of the step runs
XLA's way on this GPU and nothing needs the custom VJP (no aux output, alpha and beta Python
numbers), JAX differentiates the plain expression instead (`planner`'s `step_runs_xla`): XLA
compiles it as a user's own. `reference_matmul` is the same function running the reference
directly; plain JAX differentiates it, which is what the custom VJP is tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.op import manual_axes, planner, primitive
from jax_epilog.op.epilogs import (ACTIVATIONS, Epilog, is_fp8)
from jax_epilog.op.arguments import keyword_hints, prepare, shape_results
from jax_epilog.op import lowering  # noqa: F401  (registers the inner primitive's rules)
from jax_epilog.op.call import Params, epilog_matmul_p
from jax_epilog.runtime import context
from jax_epilog.runtime.settings import Backend
from jax_epilog.op.reference import epilog_matmul as reference_kernel

def _kernel(params: Params, a, b, *inputs):
    """The primitive's outputs, typed as varying over the operands' manual axes."""
    operands = (a, b, *inputs)
    if params.block_scaling:  # bound whole (`primitive._lower`), so typed under Auto axes
        outputs = manual_axes.in_auto_axes(
            lambda *xs: tuple(epilog_matmul_p.bind(*xs, **params._asdict())), operands,
            lambda *xs: tuple(s.spec for s in primitive.result_shardings(params, xs)))
    else:
        outputs = epilog_matmul_p.bind(*operands, **params._asdict())
    axes = manual_axes.varying_axes(operands)  # which the primitive's type leaves out
    return tuple(manual_axes.vary(o, axes) for o in outputs) if axes else tuple(outputs)


class _Scalars(NamedTuple):
    """alpha and beta where the caller passed Python numbers (None where they are arrays):
    known at trace time, they have nothing to differentiate and cost the backward nothing."""

    alpha: Optional[float]
    beta: Optional[float]


def _python_number(x, default=None) -> Optional[float]:
    if x is None:
        return default
    is_number = isinstance(x, (int, float)) and not isinstance(x, (bool, np.bool_, np.ndarray))
    return float(x) if is_number else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _forward(params: Params, scalars: _Scalars, a, b, *inputs):
    return _kernel(params, a, b, *inputs)


def _keeps_output(epilog: Epilog) -> bool:
    """Whether the backward reads ReLU's derivative off the output (y > 0), as XLA's own
    gradient of `relu(x @ w + b)` does: the caller holds y anyway, so no mask is written. Where
    the call returns the mask (RELU_AUX*), the backward uses it."""
    return epilog.activation == "relu" and not epilog.aux_output


def _forward_epilog(epilog: Epilog) -> Epilog:
    """The epilog the training forward runs: with the residual the backward needs (the
    pre-activation for GELU), or as called where ReLU's output is the residual."""
    return epilog if _keeps_output(epilog) or not epilog.activation else epilog.with_aux


def _forward_fwd(params: Params, scalars: _Scalars, a, b, *inputs):
    epilog = params.epilog
    outputs = _kernel(params._replace(epilog=_forward_epilog(epilog)), a, b, *inputs)
    residual = outputs[0] if _keeps_output(epilog) else outputs[1] if epilog.activation else None
    visible = outputs if epilog.aux_output or not epilog.activation else outputs[:1]
    bias = inputs[0] if epilog.has_bias else None
    c_args = tuple(inputs[-3:]) if params.has_c else None  # (c, alpha, beta)
    return visible, (a, b, residual, bias, c_args)


# The backward's GEMMs are `matmul` calls, so `backend="auto"` picks cuBLASLt's epilog or XLA's
# GEMM per problem, as for any call, and 16-bit operands stay 16-bit (float32 accumulation inside
# the GEMM, as XLA's own transpose of a dot). The layers' backward GEMMs are `layers.gemms`'.

def activation_gradient(dy, residual, activation: Optional[str], extra=None):
    """dZ from dY = d act(Z), elementwise (the mask for ReLU, gelu'(Z) for GELU), in dY's
    dtype, computed in float32 in one pass; `extra` (a cotangent of Z itself) adds on."""
    if activation is None and extra is None:
        return dy
    dz = dy.astype(jnp.float32)
    if activation is not None:
        dz = ACTIVATIONS[activation].derivative(dz, residual, dy.shape[-1])
    if extra is not None:
        dz = dz + extra.astype(jnp.float32)
    return dz.astype(dy.dtype)


def _weight_gradient(h, dz, bias_gradient: bool, transpose_h: bool, transpose_result: bool,
                     gemm: dict):
    """(dB, dbias or None) for Z = op(h) @ B: dB = op(h)ᵀ dZ (K, N), or with `transpose_result`
    dBᵀ = dZᵀ op(h) (N, K) for a b stored transposed. `h` is (R, K), or (K, R) with
    `transpose_h`. The bias gradient, dZ summed over the rows, comes from the same GEMM
    (BGRADB, or BGRADA for the transposed result: the summed operand is then A)."""
    if transpose_result:
        epilog, name = Epilog.BGRADA, "bgrada"
        out = matmul(dz, h, transpose_a=True, transpose_b=transpose_h,
                     epilog=epilog if bias_gradient else Epilog.DEFAULT, **gemm)
    else:
        epilog, name = Epilog.BGRADB, "bgradb"
        out = matmul(h, dz, transpose_a=not transpose_h,
                     epilog=epilog if bias_gradient else Epilog.DEFAULT, **gemm)
    return (out[0], out[1][name]) if bias_gradient else (out, None)


def _forward_bwd(params: Params, scalars: _Scalars, saved, cotangents):
    a, b, residual, bias, c_args = saved
    epilog = params.epilog
    # The pre-activation, when it was an output too, has a cotangent of its own.
    extra = cotangents[1][..., :cotangents[0].shape[-1]] if (
        epilog.activation == "gelu" and epilog.aux_output) else None
    if _keeps_output(epilog):  # jax.nn.relu's derivative: 0 at 0
        dz = jnp.where(residual > 0, cotangents[0], jnp.zeros_like(cotangents[0]))
    else:
        dz = activation_gradient(cotangents[0], residual, epilog.activation, extra)
    gemm = dict(precision=jax.lax.Precision.DEFAULT if params.allow_tf32 else
                jax.lax.Precision.HIGHEST, backend=params.backend)
    ta, tb = params.transpose_a, params.transpose_b
    batch = dz.shape[0]
    # The bias gradient comes from the weight-gradient GEMM where that GEMM sums the same rows:
    # a bias shared by the batch with a shared b (one GEMM over every row), or a batched b.
    shared_b = b.shape[0] == 1
    fused_dbias = bias is not None and (not shared_b or bias.shape[0] == 1)

    # dA = dZ op(b)ᵀ, in a's stored layout: (batch, M, K), or (batch, K, M) with transpose_a.
    if not ta:
        da = matmul(dz, b[0] if shared_b else b, transpose_b=not tb, **gemm)
    elif not shared_b:
        da = matmul(b, dz, transpose_a=tb, transpose_b=True, **gemm)
    elif batch == 1:  # dAᵀ = op(b) dZᵀ: one GEMM that writes a's layout
        da = matmul(b[0], dz[0], transpose_a=tb, transpose_b=True, **gemm)[None]
    else:  # a shared b under a batched, transposed a: XLA transposes the result
        da = jnp.swapaxes(matmul(dz, b[0], transpose_b=not tb, **gemm), 1, 2)

    # dB = op(a)ᵀ dZ, in b's stored layout: (·, K, N), or (·, N, K) with transpose_b.
    if shared_b:  # every row of every batch contributes: one GEMM over all of them
        if batch == 1:
            h, transpose_h = a[0], ta
        else:  # a batched, transposed a has no contiguous rows: XLA transposes it first
            rows = jnp.swapaxes(a, 1, 2) if ta else a
            h, transpose_h = rows.reshape(batch * rows.shape[1], rows.shape[2]), False
        # Explicit sizes, not -1: any of them may be 0.
        dz_rows = dz.reshape(batch * dz.shape[1], dz.shape[2])
        db, dbias = _weight_gradient(h, dz_rows, fused_dbias, transpose_h, tb, gemm)
        db = db[None]
        dbias = None if dbias is None else dbias[None]
    else:
        db, dbias = _weight_gradient(a, dz, fused_dbias, ta, tb, gemm)
        if dbias is not None and bias.shape[0] == 1:
            dbias = jnp.sum(dbias, axis=0, keepdims=True, dtype=jnp.float32).astype(bias.dtype)
    if bias is not None and dbias is None:  # a per-batch bias with a shared b
        dbias = jnp.sum(dz, axis=1, dtype=jnp.float32).astype(bias.dtype)

    grads = [da, db]
    if bias is not None:
        grads.append(dbias)
    if c_args is not None:  # Z = alpha · P + beta · C (+ bias): dP = alpha · dZ
        grads += _c_gradients(scalars, c_args, a, da, dz)
        alpha = c_args[1] if scalars.alpha is None else scalars.alpha
        if scalars.alpha != 1.0:
            grads[0], grads[1] = (_scaled(g, alpha) for g in grads[:2])
    return tuple(grads)


def _c_gradients(scalars: _Scalars, c_args, a, da, dz) -> list:
    """[dC, d alpha, d beta] for Z = alpha · P + beta · C (+ bias), `da` being dZ op(b)ᵀ in a's
    layout before the alpha scale: d alpha = sum(dZ ⊙ P) = sum(da ⊙ a), no extra product."""
    c, alpha, beta = c_args
    if scalars.beta == 1.0 and c.dtype == dz.dtype:
        dc = dz
    else:
        beta_value = beta if scalars.beta is None else scalars.beta
        dc = (dz.astype(jnp.float32) * beta_value).astype(c.dtype)  # one fused pass
    zero = jnp.zeros((), jnp.float32)
    dalpha = zero if scalars.alpha is not None else jnp.sum(
        da.astype(jnp.float32) * a.astype(jnp.float32))
    dbeta = zero if scalars.beta is not None else jnp.sum(
        dz.astype(jnp.float32) * c.astype(jnp.float32))
    return [dc, dalpha, dbeta]


def _scaled(g, alpha):
    return (g * jnp.asarray(alpha, jnp.float32)).astype(g.dtype)


_forward.defvjp(_forward_fwd, _forward_bwd)


def _users_expression(params: Params, a, b, *inputs):
    """The plain path of a call with a 2-D b, a bias of shape (N,) if any and no c, written as
    its user would write it: `op(a) @ op(b) + bias`, then the activation, on the caller's own
    operands. XLA then compiles exactly the user's program: the same call through
    `_reference`'s rank-3 form (a (1, M, K) product, a (1, N) bias, a weight gradient
    contracting two axes) ran behind the user's GELU step
    (benchmarks/results/never_slower_matmul)."""
    if params.transpose_a:
        a = jnp.swapaxes(a, -1, -2)
    reduced = params.allow_tf32 or a.dtype != jnp.float32  # XLA's way, as `_reference`'s
    precision = jax.lax.Precision.DEFAULT if reduced else jax.lax.Precision.HIGHEST
    z = jnp.matmul(a, b.T if params.transpose_b else b, precision=precision,
                   preferred_element_type=a.dtype)
    epilog = params.epilog
    if epilog.has_bias:
        z = z + inputs[0].astype(z.dtype)
    return ACTIVATIONS[epilog.activation].plain(z) if epilog.activation else z


def _reference(params: Params, a, b, *inputs, exact: bool = True):
    """The call's outputs by the reference: exact, or in XLA's way (the plain expression, for
    JAX's own autodiff where `planner`'s `step_runs_xla`)."""
    return reference_kernel(a, b, *inputs, epilog=params.epilog, exact=exact,
                            transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                            allow_tf32=params.allow_tf32, result_dtype=params.result_dtype,
                            result_amax=params.result_amax, has_c=params.has_c,
                            fast_accumulation=params.fast_accumulation,
                            block_scaling=params.block_scaling)


@keyword_hints
def matmul(a, b, c=None, *, alpha=None, beta=None, epilog=Epilog.DEFAULT,
           epilog_inputs: Optional[Mapping[str, Any]] = None,
           transpose_a: bool = False, transpose_b: bool = False, precision=None,
           backend: Backend = "auto", quantization_scales: Optional[Mapping[str, Any]] = None,
           preferred_element_type=None, result_amax: bool = False,
           fast_accumulation: bool = False):
    """`a @ b` with a cuBLASLt epilog fused into the same kernel (SPEC §1, §5, §6).

    Args:
      a: `(..., M, K)`, or `(..., K, M)` with `transpose_a`; float16, bfloat16 or float32, or
        FP8 (float8_e4m3fn / float8_e5m2, with `quantization_scales`).
      b: `(K, N)` shared by every leading index of `a`, or `(..., K, N)` with the same leading
        dims (`(…, N, K)` with `transpose_b`); same dtype as `a` (FP8: both FP8, not both e5m2).
      c: optional, y's shape `(..., M, N)` and dtype (with FP8 operands the 16/32-bit result's;
        an FP8 result with c is refused): the result is R = epilog(alpha · a@b + beta · c), the
        bias (if any) added after beta · c (SPEC §6, docs/c_alpha_beta.md).
      alpha, beta: with c only; beta is required, alpha defaults to 1. Python numbers or
        float32 0-d arrays (traced values work under `jit`; arrays are differentiable).
      epilog: an `Epilog`, its value, its name (e.g. ``"relu_aux_bias"``), or nvmath-python's
        `MatmulEpilog` member of that name.
      epilog_inputs: ``{"bias": (N,) | (..., N)}`` for the bias epilogs,
        ``{"relu_aux": mask}`` for DRELU*, ``{"gelu_aux": pre_activation}`` for DGELU*.
        Floating inputs have y's dtype (bfloat16 when y is FP8).
      transpose_a, transpose_b: read the operand transposed (no copy is made for 16/32-bit
        operands; FP8 kernels need (M, K) and (N, K) operands, which the CUDA lowering
        arranges by a transpose XLA fuses into the operand's producer).
      precision: for float32, `jax.lax.Precision.HIGHEST` is full float32; DEFAULT / HIGH may
        use TF32. Ignored for 16-bit and FP8 dtypes (accumulation is float32; for FP8 see
        `fast_accumulation`).
      backend: on CUDA, "cublaslt" runs the cuBLASLt kernel, "xla" XLA's own GEMM and fusions
        of the same computation, "auto" the faster of the two for this problem on this GPU, as
        measured (`jax_epilog.planning.decisions`; FP8 problems without a measurement run cuBLASLt).
        Other platforms always run the reference.
      quantization_scales: FP8 operands only, and required with them: ``{"a": sa, "b": sb}``
        (float32 0-d arrays or Python floats; traced values work under `jit`), plus ``"d": sd``
        (default 1) for an FP8 result. The product is P = (sa·a) @ (sb·b).
      preferred_element_type: FP8 operands only: y's dtype, float16, bfloat16 (the default),
        float32, float8_e4m3fn or float8_e5m2. An FP8 y is sd·R rounded and saturated to the
        format's largest finite value (NaN stays NaN).
      result_amax: FP8 operands only: also return ``aux["result_amax"]``, float32 max |R| taken
        before the d scale and the cast.
      fast_accumulation: FP8 operands only (a `ValueError` otherwise; for float32,
        `precision` chooses TF32): run cuBLASLt's FP8 fast accumulation mode
        (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``, nvmath-python's
        `MatmulOptions.fast_accumulation`, what XLA uses for FP8 dots at DEFAULT precision):
        the kernel's partial sums are not periodically promoted to float32, which is faster
        and less accurate, so values may differ from the float32-accumulating reference by
        the accumulation's rounding (more with a longer K). Default False: the products
        accumulate in float32 (SPEC §5). The reference (CPU and other platforms, and the
        CUDA fallbacks) computes the exact float32 formula, so the option changes nothing
        there; `backend="xla"` asks XLA's own FP8 GEMM for the same (DEFAULT precision, which
        XLA runs with fast accumulation, where it is HIGHEST otherwise).

    Returns:
      `y` of shape `(..., M, N)`, or `(y, aux)` where the epilog has auxiliary outputs
      (`relu_aux`, `gelu_aux`, `drelu_bgrad`, `dgelu_bgrad`, `bgrada`, `bgradb`) or
      `result_amax` is asked for.

    Differentiable (reverse mode) for the forward epilogs with 16/32-bit operands; the backward
    epilogs are gradients themselves and FP8 calls are not differentiable: both raise a
    `TypeError` under `jax.grad` (FP8 training: `dense` / `mlp` with ``fp8=``).
    """
    call = prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision, backend,
                    quantization_scales, preferred_element_type, result_amax, c, alpha, beta,
                    fast_accumulation)
    operands = (call.a, call.b, *call.inputs)
    axes = manual_axes.varying_axes(operands)  # inside shard_map
    if axes:
        operands = tuple(manual_axes.vary(x, axes) for x in operands)
    if call.params.epilog.is_backward or is_fp8(call.a.dtype):  # not differentiable
        return shape_results(call, _kernel(call.params, *operands))
    scalars = (_Scalars(1.0, None) if c is None else  # (no c: prepare refused alpha and beta)
               _Scalars(_python_number(alpha, 1.0), _python_number(beta)))
    # Traced alpha and beta keep the custom VJP: the plain expression scales in the operands'
    # 16-bit dtype, so JAX would sum their gradients in 16 bits (d alpha then far off on odd
    # shapes), where `_c_gradients` sums in float32.
    # Epilogs that return the ReLU mask or the GELU pre-activation keep the custom VJP too:
    # their gradient follows the mask (1 at 0), whichever GEMMs run.
    constant_scalars = c is None or None not in scalars
    # The plan may run the training step as the plain expression under JAX's autodiff (every
    # GEMM of the step runs XLA's way on this CUDA GPU, `planning.call_plan.plan_matmul_step`):
    # XLA then compiles it as it compiles a user's own, the never-slower rule of the layers.
    p = call.params
    if constant_scalars and not p.epilog.aux_output and planner.current().step_runs_xla(
            context.current(), p, call.a.shape, call.b.shape, call.a.dtype,
            _forward_epilog(p.epilog)):
        own = [a, b, *(dict(epilog_inputs or {}).values())]  # as the caller passed them
        if c is None and scalars.alpha == 1.0 and jnp.ndim(b) == 2 and \
                all(jnp.ndim(x) == 1 for x in own[2:]):
            return _users_expression(call.params, *(manual_axes.vary(jnp.asarray(x), axes)
                                                    for x in own))
        return shape_results(call, _reference(call.params, *operands, exact=False))
    return shape_results(call, _forward(call.params, scalars, *operands))


@keyword_hints
def reference_matmul(a, b, c=None, *, alpha=None, beta=None, epilog=Epilog.DEFAULT,
                     epilog_inputs=None, transpose_a=False, transpose_b=False, precision=None,
                     quantization_scales=None, preferred_element_type=None, result_amax=False,
                     fast_accumulation=False):
    """`matmul` computed by the plain-JAX reference on any device (same checks, same results;
    `fast_accumulation` is checked and, as on every reference path, changes nothing)."""
    call = prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision, "auto",
                    quantization_scales, preferred_element_type, result_amax, c, alpha, beta,
                    fast_accumulation)
    return shape_results(call, _reference(call.params, call.a, call.b, *call.inputs))
