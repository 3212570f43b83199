"""SwiGLU's fused FP8 passes (`float8.fused` says how the engine is chosen): the passes around
the FP8 block's GEMMs (`layers.swiglu`), each a CUDA kernel reading its 16-bit input once, with
its plain-JAX formulation as the reference.

- Forward, from `[g u]` `(M, 2F)` (the gate/up GEMM's result): `swiglu_amaxes`, the amaxes of
  h = silu(g)·u (float32), g and u in one read; then `swiglu_quantize`, h, and for the
  backward g and u, in FP8 on the scales those amaxes (or h's history) give.
  `swiglu_forward` is the two with the layers' scaling in between.
- Backward, from dh `(M, F)` and the saved g8, u8: `swiglu_grad_amax`, the amax of
  `[dg du]` (dg = dh·u·silu'(g), du = dh·silu(g), each rounded to dh's dtype), then
  `swiglu_grad_quantize`, `[dg du]` in FP8 and its transposed copy (the weight gradient's
  operand). `swiglu_gradient` is the two with the current scale in between.

Two reads of the 16-bit tensor per direction, as XLA's fusions make them: the scale of a
quantized tensor needs its amax first. The kernels evaluate silu as g / (1 + exp(-g)) with the
GPU's `expf`; XLA's logistic may round its last bit differently, so the kernels' FP8 bytes
match XLA's except for the rare value that sits on a rounding boundary (the GPU tests bound
how many). `[dg du]`'s amax is that of the rounded gradients themselves, where XLA's
formulation (`swiglu._gradient_bound`) takes a bound equal to it up to that rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_epilog.float8.fused import INPUT_DTYPES, check_matrix, check_scalar, custom_call, \
    runs_kernel
from jax_epilog.float8.recipe import check_margin, fp8_format
from jax_epilog.float8.scaling import delayed_scale_amax, multiplier, reduce_amax
from jax_epilog.layers import gating
from jax_epilog.op.amaxes import amax
from jax_epilog.op.reference import saturating_cast
from jax_epilog.runtime import targets


def _gate_up(gu):
    """F for `gu` `(M, 2F)`, checked."""
    check_matrix("gu", gu, INPUT_DTYPES + ("float32",))
    if gu.shape[1] % 2:
        raise ValueError(f"gu: expected [g u], shape (M, 2F), got {gu.shape}")
    return gu.shape[1] // 2


def _halves(gu, hidden):
    return gu[:, :hidden].astype(jnp.float32), gu[:, hidden:].astype(jnp.float32)


# --- forward --------------------------------------------------------------------------------

def swiglu_amaxes_reference(gu):
    hidden = gu.shape[1] // 2
    g, u = _halves(gu, hidden)
    return jnp.stack([amax(gating.hidden(gu, hidden)), amax(g), amax(u)])


def swiglu_amaxes(gu):
    """float32 `(3,)`: the amaxes of h = silu(g)·u (float32), g and u, from `gu` = `[g u]`
    `(M, 2F)`."""
    _gate_up(gu)
    if not runs_kernel(gu):
        return swiglu_amaxes_reference(gu)
    return custom_call(targets.SWIGLU_AMAXES, (jax.ShapeDtypeStruct((3,), jnp.float32),), (gu,),
                       lambda gu: (swiglu_amaxes_reference(gu),))[0]


def swiglu_quantize_reference(gu, q, dtype, keep: bool = True):
    hidden = gu.shape[1] // 2
    h8 = saturating_cast(gating.hidden(gu, hidden) * q[0], dtype)
    if not keep:
        return (h8,)
    g, u = _halves(gu, hidden)
    return h8, saturating_cast(g * q[1], dtype), saturating_cast(u * q[2], dtype)


def swiglu_quantize(gu, q, dtype="float8_e4m3fn", keep: bool = True):
    """`(h8, g8, u8)` (`(h8,)` without `keep`), each `(M, F)` in the FP8 `dtype`: h = silu(g)·u,
    g and u of `gu` = `[g u]` `(M, 2F)` times their multipliers `q` (float32 `(3,)`: h's,
    g's, u's), rounded and saturated as the layers quantize."""
    hidden = _gate_up(gu)
    dtype = fp8_format("dtype", dtype)
    q = check_scalar("q", q, 3)
    if not runs_kernel(gu):
        return swiglu_quantize_reference(gu, q, dtype, keep)
    results = [jax.ShapeDtypeStruct((gu.shape[0], hidden), dtype)] * (3 if keep else 1)
    return custom_call(targets.SWIGLU_QUANTIZE, results, (gu, q),
                       lambda gu, q: swiglu_quantize_reference(gu, q, dtype, keep))


def swiglu_forward(gu, dtype, margin: int = 0, h_history=None, amax_axes=None,
                   keep: bool = True):
    """`(h8, h_scale, h_amax, g8, g_scale, u8, u_scale)` from `[g u]`, as the FP8 block's
    forward quantizes them (`swiglu._fp8_forward`): h on delayed scaling from `h_history` where
    given, else on its own amax; g and u on their own amaxes (None without `keep`). Every amax
    is over `amax_axes` (`scaling.reduce_amax`)."""
    dtype = fp8_format("dtype", dtype)
    check_margin(margin)
    amaxes = reduce_amax(swiglu_amaxes(gu), amax_axes)
    h_amax = amaxes[0]
    h_scale_amax = h_amax if h_history is None else delayed_scale_amax(h_history, h_amax)
    q = jnp.stack([multiplier(a, dtype, margin) for a in (h_scale_amax, amaxes[1], amaxes[2])])
    h8, *kept = swiglu_quantize(gu, q, dtype, keep)
    g8, u8 = kept if keep else (None, None)
    scales = 1.0 / q
    return h8, scales[0], h_amax, g8, scales[1] if keep else None, u8, \
        scales[2] if keep else None


# --- backward -------------------------------------------------------------------------------

def _grad_operands(dh, g8, u8, g_scale, u_scale):
    check_matrix("dh", dh, INPUT_DTYPES + ("float32",))
    for name, v8 in (("g8", g8), ("u8", u8)):
        fp8_format(f"{name}.dtype", getattr(v8, "dtype", None))
        if jnp.shape(v8) != dh.shape:
            raise ValueError(f"{name}: expected dh's shape {dh.shape}, got {jnp.shape(v8)}")
    if g8.dtype != u8.dtype:
        raise ValueError(f"u8: expected g8's dtype {g8.dtype}, got {u8.dtype}")
    return check_scalar("g_scale", g_scale), check_scalar("u_scale", u_scale)


def _gradients(dh, g8, u8, scales):
    """`[dg du]` in dh's dtype (`gating.hidden_gradient`) from the saved FP8 g and u."""
    g = g8.astype(jnp.float32) * scales[0]
    u = u8.astype(jnp.float32) * scales[1]
    return gating.hidden_gradient(dh, g, u, dh.dtype)


def swiglu_grad_amax_reference(dh, g8, u8, scales):
    return amax(_gradients(dh, g8, u8, scales))


def swiglu_grad_amax(dh, g8, u8, g_scale, u_scale):
    """float32: the amax of `[dg du]` (dh's dtype) for dh `(M, F)` and the saved `g8`, `u8`
    with their dequantization scales."""
    scales = jnp.stack([*_grad_operands(dh, g8, u8, g_scale, u_scale), jnp.float32(0)])
    if not runs_kernel(dh):
        return swiglu_grad_amax_reference(dh, g8, u8, scales)
    return custom_call(targets.SWIGLU_GRAD_AMAX, (jax.ShapeDtypeStruct((), jnp.float32),),
                       (dh, g8, u8, scales),
                       lambda *a: (swiglu_grad_amax_reference(*a),))[0]


def swiglu_grad_quantize_reference(dh, g8, u8, scales, dtype):
    dgu8 = saturating_cast(_gradients(dh, g8, u8, scales).astype(jnp.float32) * scales[2], dtype)
    return dgu8, dgu8.T


def swiglu_grad_quantize(dh, g8, u8, g_scale, u_scale, q, dtype="float8_e5m2"):
    """`(dgu8, dgu8ᵀ)`: `[dg du]` `(M, 2F)` times the multiplier `q` (float32 scalar), rounded
    and saturated to the FP8 `dtype`, and its transposed copy `(2F, M)`."""
    scales = jnp.stack([*_grad_operands(dh, g8, u8, g_scale, u_scale), check_scalar("q", q)])
    dtype = fp8_format("dtype", dtype)
    if not runs_kernel(dh):
        return swiglu_grad_quantize_reference(dh, g8, u8, scales, dtype)
    rows, hidden = dh.shape
    results = (jax.ShapeDtypeStruct((rows, 2 * hidden), dtype),
               jax.ShapeDtypeStruct((2 * hidden, rows), dtype))
    return custom_call(targets.SWIGLU_GRAD_QUANTIZE, results, (dh, g8, u8, scales),
                       lambda *a: swiglu_grad_quantize_reference(*a, dtype))


def swiglu_gradient(dh, g8, g_scale, u8, u_scale, dtype, margin: int = 0, amax_axes=None):
    """`(dgu8, dgu8ᵀ, scale, amax)`: `[dg du]` quantized on current scaling (its amax over
    `amax_axes`) and its transposed copy, as the FP8 block's backward needs them."""
    dtype = fp8_format("dtype", dtype)
    check_margin(margin)
    dgu_amax = reduce_amax(swiglu_grad_amax(dh, g8, u8, g_scale, u_scale), amax_axes)
    q = multiplier(dgu_amax, dtype, margin)
    dgu8, dgu8t = swiglu_grad_quantize(dh, g8, u8, g_scale, u_scale, q, dtype)
    return dgu8, dgu8t, 1.0 / q, dgu_amax
