"""An FP8 layer stack's training step (SPEC §5): one custom VJP that scales, quantizes, runs
each GEMM with its epilog and updates the amax histories, as `stack_plan.plan_stack` planned it.

`dense(..., fp8=...)` and `mlp(..., fp8=...)` run each chosen layer's three GEMMs with FP8
operands, per-tensor scaling: *current* scaling, a tensor's scale from its own amax in the
same step, or delayed scaling (below), which takes the scales of the layer inputs and of the
tensors a GEMM writes from amax histories, the state `fp8_state=`. `Fp8()`'s
`scaling="auto"` is delayed scaling where the layers are given a state (the Flax modules
always are) and current scaling where not (`Fp8.resolved`, asked by `stack_plan.plan_stack`).
One `jax.custom_vjp` covers the whole stack, as `functional.fused_stack` does:

- Forward, layer i: the input h and the kernel W are quantized to the forward format (e4m3),
  `q = largest / 2**margin / amax`, a saturating cast of `q·x`. The amax is one XLA reduction
  of the tensor in the compute dtype, in the same jitted expression as the cast, so XLA fuses
  it with what already reads the tensor (`quantize_scaled`). Sharded, an amax is an
  all-reduce, so the amaxes that wait for no GEMM (the input's, every kernel's, the weight
  terms of the cold bounds) are taken first, as one vector (`_early_amaxes`), one
  collective. Then ONE `matmul` with FP8 operands, the bias/ReLU/GELU epilog, the
  dequantization scales `1/q` and the result in the compute dtype. No GEMM is asked for
  `result_amax`: cuBLASLt 13.1 gives the amax only with an FP8 result (docs/fp8.md has the
  table of what it answered), and the layers' results are 16/32-bit.
- Residuals: h in FP8 (`(M, K)`; the weight gradient's K-major h8ᵀ is made in the
  backward) and its scale, W
  in FP8 and its scale, the 1-bit ReLU mask (the GELU pre-activation); never a 16/32-bit copy
  of an FP8 layer's input, which is where FP8 saves memory. Under `backward="auto"` a ReLU
  layer followed by an FP8 layer keeps no mask: the next layer's `h8 > 0` is its derivative
  (`stack_plan.relu_from_next_input`).
- Backward: dZ is quantized to the gradient format (e5m2), its amax one XLA reduction fused
  with the cast (and, for the last layer, with its bias gradient: a sum of dZ, FP8 GEMMs have
  no BGRADB). dW = h8ᵀ dZ8 (e4m3 × e5m2) and dZ_{i-1} = dZ8 W8ᵀ with DRELU_BGRAD /
  DGELU_BGRAD for the previous layer (e5m2 × e4m3), which also gives its bias gradient, both
  with results in the compute dtype. Under `backward="auto"` that GEMM runs XLA's way
  (`stack_plan.fp8_gemm_backend`: measured faster than cuBLASLt's FP8 DRELU_BGRAD), or,
  for a ReLU whose derivative comes from h8 (`stack_plan.relu_from_next_input`), is a plain FP8 GEMM
  followed by XLA fusions. With JAX_EPILOG_FUSED_PASSES `cuda` (or `auto`) dZ's cast is the
  library's cast-transpose kernel, which writes dZ8ᵀ in the same pass (`float8.fused`).
- Compute dtype float32: cuBLASLt 13.1 has no FP8 kernel with a float32 result for any epilog
  but DEFAULT and DRELU (no bias, no BGRAD). Those layers keep FP8, and under "auto" their
  other GEMMs run XLA's way (XLA's FP8 GEMM to float32, the epilog as fusions;
  `stack_plan.fp8_gemm_backend`) instead of the reference fallback. The default, bf16 compute, runs
  every GEMM as a kernel.

Which layers run FP8: `Fp8(layers="all")` every one; `"auto"` (what `fp8=True` means) on a
CUDA GPU whose decision tables hold a measured training step of the stack in FP8
(`python -m jax_epilog.tune --fp8`), every layer where that beat bf16 and none where it did not;
elsewhere only the layers whose GEMM is large enough for FP8 to pay for its quantization passes
(`stack_plan.fp8_pays`, from the shapes alone). `stack_plan.quantized_layers` decides. The other layers
are the bf16 (compute dtype) layers of `layers/functional.py`, inside the same custom VJP.

On a CPU the FP8 `matmul` runs the exact reference (FP8 values widened to float32, float32
sums), so the layer computes exactly the quantized math; against the unquantized layer it
differs by FP8 rounding (about 2**-4 relative per e4m3 value, 2**-3 per e5m2 one). On Hopper
the FP8 GEMMs accumulate with less than float32 precision (~2e-4 of the largest value at
K≈96 on random data; integer-valued data is exact), and since every scale comes from the
amax of the previous layer's result, such a difference can move later FP8 roundings by a
quantum: compare GPU and CPU per GEMM or on data whose quantization is exact.

Every choice above (which layers, where each FP8 tensor comes from, each GEMM's epilog and
backend) is made by `stack_plan.plan_stack`; this module carries the plan out
(`jax_epilog.explain` prints it).

Delayed scaling (`Fp8(scaling="delayed")`, the state `fp8_state=`, one `Fp8History` of amax
histories per layer, whose gradient is its next value): a scale known before the GEMM lets
the GEMM write the FP8 tensor and its amax itself (cuBLASLt's FP8 result with `result_amax`),
so the 16-bit tensor, its amax pass and its cast pass never exist. That is done where cuBLASLt
has the kernel and the math allows it: a forward GEMM followed by an FP8 layer writes that
layer's e4m3 input (`stack_plan.writes_fp8_result`), and the data-gradient GEMM below an FP8 ReLU layer
writes its e5m2 gradient, ReLU's derivative then applied to the FP8 bits
(`stack_plan.writes_fp8_gradient`). Every FP8 layer's input takes its scale from its history too;
the other tensors keep current scaling, their amaxes recorded in the state all the same.

Delayed scaling calibrates itself, tensor by tensor (`delayed_amax`): while a history is cold
(largest value 0, as in a fresh `init_state`, or not finite), the amax its scale comes from is
this step's instead. A tensor XLA quantizes takes its own (`quantize_delayed`: a `where`,
not a conditional, which on a GPU would make the host wait); one a GEMM writes takes a bound
on the GEMM's result from amaxes already known (`result_bound`), rounded up to a power of
two. The program is the delayed one either way.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_epilog.float8 import fused
from jax_epilog.float8.recipe import Fp8History
from jax_epilog.float8.scaling import (calibrates, bound_axes, bound_terms, delayed_amax,
                                       multiplier, quantize_scaled, record, reduce_amax,
                                       reduced_amaxes, result_bound)
from jax_epilog.layers import gemms as layer_gemms
from jax_epilog.layers.gemms import LAYER_INPUT_NAME, data_gradient, layer_forward, weight_gradient
from jax_epilog.op import barrier, manual_axes
from jax_epilog.op.epilogs import Epilog
from jax_epilog.op.matmul import activation_gradient, matmul
from jax_epilog.planning.stack_plan import Layer, StackPlan, weight_grad_gives_bias_grad

def matmul8(a8, sa, b8, sb, dtype, backend, fast: bool, *, epilog=Epilog.DEFAULT,
             inputs=None, result_scale=None, **transposes):
    """(y in `dtype`, aux dict) of one FP8 GEMM, `(sa·a8) @ (sb·b8)` with `epilog`, asking
    `matmul` for `backend` (the plan's `requested`), with fast accumulation if `fast`. With
    `result_scale` (the quantization multiplier of an FP8 `dtype`), y is FP8 and
    `aux["result_amax"]` its amax: cuBLASLt gives an amax only with an FP8 result
    (docs/fp8.md); a 16/32-bit y's amax is the caller's XLA reduction."""
    scales = {"a": sa, "b": sb}
    if result_scale is not None:
        scales["d"] = result_scale
    out = matmul(a8, b8, epilog=epilog, epilog_inputs=inputs,
                 backend=backend,
                 quantization_scales=scales, preferred_element_type=dtype,
                 result_amax=result_scale is not None, fast_accumulation=fast, **transposes)
    return out if isinstance(out, tuple) else (out, {})



def positive(x8):
    """`x8 > 0` for an FP8 array, as integer compares of its bits (measured faster than XLA's
    float compare of FP8 values: docs/fp8.md). Positive values are the bit patterns
    from 1 (the smallest subnormal) up to the largest finite value, or +Inf where the format
    has one; +0, negative values and NaN are not."""
    dtype = jnp.dtype(x8.dtype)
    largest = np.array(np.inf, dtype)
    if not np.isinf(largest.astype(np.float32)):  # no Inf (e4m3fn): its largest finite value
        largest = np.array(jnp.finfo(dtype).max, dtype)
    bits = jax.lax.bitcast_convert_type(x8, jnp.uint8)
    return (bits >= 1) & (bits <= largest.view(np.uint8))


# --- the custom VJP over a stack --------------------------------------------------------------

class Saved(NamedTuple):
    """What the backward keeps of one layer: its input (`(M, K)`, FP8 with `input_scale`, or
    in the compute dtype with None), its kernel (likewise, `(K, N)`), its activation's
    residual, and an FP8 input's amax (for the next state)."""

    input: Any
    input_scale: Any
    kernel: Any
    kernel_scale: Any
    residual: Any
    input_amax: Any = None


def _planned_forward(planned: StackPlan, x, params, state, keep_residuals: bool):
    """(y, the residuals) of the stack's forward as `planned` says, every scale as its
    config's `scaling` says (`_forward` chooses the plan)."""
    stack, fp8 = planned.stack, planned.fp8
    mode = "step" if keep_residuals else "forward"
    early = _early_amaxes(planned, x, params)
    h, saved = x, []
    h8 = None  # the current layer's FP8 input (scale, amax), when the layer before wrote it
    for i, (layer, (kernel, bias)) in enumerate(zip(stack.layers, params)):
        own = planned.layers[i]
        keep = keep_residuals and not own.relu_from_next_input
        if not own.fp8:
            layer_input = h
            h, residual = layer_forward(stack, layer, h, kernel, bias, keep)
            saved.append(Saved(layer_input, None, kernel, None, residual))
            continue
        if h8 is not None:
            h8, h_scale, h_amax = h8
        else:
            h8, h_scale, h_amax = quantize_scaled(
                h, fp8.forward, fp8.margin, state[i].input if fp8.delayed else None,
                fp8.amax_reduction_axes, early.get(("input", i)))
        w8, w_scale, _ = quantize_scaled(kernel, fp8.forward, fp8.margin,
                                         x_amax=early[("kernel", i)])
        gemm = planned.gemm(i, "forward", mode)
        epilog, fp8_result = gemm.epilog, own.writes_fp8_result
        q_next = multiplier(delayed_amax(state[i + 1].input, result_bound(
            h_amax, early[("bound", i)])), fp8.forward, fp8.margin) if fp8_result else None
        out, aux = matmul8(h8, h_scale, w8, w_scale, fp8.forward if fp8_result else x.dtype,
                            gemm.requested, fp8.fast("forward"), epilog=epilog,
                            inputs={"bias": bias} if layer.has_bias else None,
                            result_scale=q_next)
        residual = aux.get(epilog.aux_output) if epilog.aux_output else None
        # Kept as h8 (M, K), as the forward GEMM read it: the previous layer's ReLU derivative
        # reads it elementwise (`relu_from_next_input`); the weight gradient's K-major h8ᵀ is
        # made in the backward, from this one byte per element.
        saved.append(Saved(h8, h_scale, w8, w_scale, residual, h_amax))
        if fp8_result:
            h, h8 = None, (out, 1.0 / q_next,
                           reduce_amax(aux["result_amax"], fp8.amax_reduction_axes))
        else:
            h, h8 = out, None
    return h, tuple(saved)


def _together(axes, named: dict) -> dict:
    """{key: amax} for `named` {key: array, or a list of arrays (their amaxes a vector)}, every
    amax taken and reduced over `axes` in one collective (`reduced_amaxes`)."""
    arrays = [a for value in named.values() for a in (value if isinstance(value, list)
                                                      else [value])]
    if not arrays:
        return {}
    vector, start, taken = reduced_amaxes(arrays, axes), 0, {}
    for key, value in named.items():
        n = len(value) if isinstance(value, list) else 1
        taken[key] = vector[start:start + n] if isinstance(value, list) else vector[start]
        start += n
    return taken


def _early_amaxes(planned: StackPlan, x, params) -> dict:
    """The forward's amaxes that wait for no GEMM, in one collective where they are sharded:
    the stack input's ("input", 0) if the first layer is FP8, each FP8 kernel's ("kernel", i),
    and the weight-only terms of a GEMM-written input's cold-history bound ("bound", i):
    TransformerEngine too reduces its amaxes together rather than one per tensor."""
    named = {("input", 0): x} if planned.layers[0].fp8 else {}
    for i, (own, layer, (kernel, bias)) in enumerate(zip(planned.layers, planned.stack.layers,
                                                          params)):
        if own.fp8:
            named[("kernel", i)] = kernel
        if own.writes_fp8_result:
            named[("bound", i)] = bound_terms(kernel, 0, bias if layer.has_bias else None)
    return _together(planned.fp8.amax_reduction_axes, named)


def _forward(planned: StackPlan, x, params, state, keep_residuals: bool):
    """`_planned_forward`, its residuals then named for remat policies."""
    if planned.fp8.delayed and state is not None and calibrates():
        # Checked before the calibration, which picks between a history's scale (the same on
        # every device) and an unreduced amax's (not): every amax varies over the axes the
        # stack does, less those it is reduced over, and the next state must not.
        reduced = bound_axes(planned.fp8.amax_reduction_axes)
        _check_recordable(planned, [a for a in manual_axes.varying_axes([x]) if a not in reduced],
                          state)
    h, saved = _planned_forward(planned, x, params, state, keep_residuals)
    named = lambda value, name: None if value is None else checkpoint_name(value, name)
    return h, tuple(s._replace(input=named(s.input, LAYER_INPUT_NAME),
                               residual=named(s.residual, layer_gemms.residual_name(
                                   layer.activation)))
                    for s, layer in zip(saved, planned.stack.layers))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_stack(planned: StackPlan, x, params, state):
    return _forward(planned, x, params, state, keep_residuals=False)[0]


def _fp8_stack_fwd(planned: StackPlan, x, params, state):
    y, saved = _forward(planned, x, params, state, keep_residuals=True)
    return y, (saved, state)


def _fp8_stack_bwd(planned: StackPlan, residuals, dy):
    saved, state = residuals
    return _planned_backward(planned, saved, state, dy)


def _planned_backward(planned: StackPlan, saved, state, dy):
    stack, fp8 = planned.stack, planned.fp8
    stack_layers = stack.layers
    fast_data, fast_weight = fp8.fast("data gradient"), fp8.fast("weight gradient")
    dz = activation_gradient(dy, saved[-1].residual, stack_layers[-1].activation)
    gemm = dict(precision=stack.precision, backend=stack.backward)
    dbias = None  # the current layer's bias gradient, when the step above has given it
    dz8 = None  # the current layer's (dZ8, scale), when the step above has written it
    grads, gradient_amaxes = [], {}
    # The backward's amaxes that wait for no GEMM, in one collective: the top gradient's (if
    # the top layer is FP8) and the weight-only term of each GEMM-written gradient's bound.
    named = {("gradient", len(saved) - 1): dz} if planned.layers[-1].fp8 else {}
    for i in range(1, len(saved)):
        if planned.layers[i].fp8 and planned.layers[i - 1].writes_fp8_gradient:
            named[("bound", i)] = bound_terms(saved[i].kernel, 1)
    early = _together(fp8.amax_reduction_axes, named)
    for i in reversed(range(len(stack_layers))):
        s = saved[i]
        previous = stack_layers[i - 1] if i else None
        previous_residual = saved[i - 1].residual if i else None
        need_bias_grad = weight_grad_gives_bias_grad(stack_layers, i)
        if not planned.layers[i].fp8:
            dkernel, own_dbias = weight_gradient(s.input, dz, bias_gradient=need_bias_grad,
                                                 **gemm)
            below = previous or Layer(None, False)
            dz, next_dbias = data_gradient(dz, s.kernel, activation=below.activation,
                                           has_bias=below.has_bias, residual=previous_residual,
                                           **gemm)
        else:
            below_plan = planned.layers[i - 1] if i else None
            data = planned.gemm(i, "data gradient")
            dz8t = None  # dZ8ᵀ, where the fused pass writes it with dZ8 (float8/fused.py)
            if dz8 is None and fused.uses_cuda():
                dz8, dz8t, dz_scale, gradient_amaxes[i] = fused.quantize_transpose(
                    dz, fp8.gradient, fp8.margin, amax_axes=fp8.amax_reduction_axes,
                    x_amax=early.get(("gradient", i)))
            elif dz8 is None:
                # Current scaling for gradients in 16 bits (`Fp8.scaling`).
                dz8, dz_scale, gradient_amaxes[i] = quantize_scaled(
                    dz, fp8.gradient, fp8.margin, amax_axes=fp8.amax_reduction_axes,
                    x_amax=early.get(("gradient", i)))
            else:  # written by the step above (`writes_fp8_gradient`); its bias gradient too
                dz8, dz_scale = dz8
            # Memory (docs/fp8.md, "Memory"): dZ8ᵀ and h8ᵀ, the weight gradient's K-major
            # operands, are made from dZ8 and h8 after the barrier (so the 16-bit dZ is dead by
            # then), and the data gradient's GEMM, whose 16-bit result is the largest buffer
            # here, waits for the weight gradient (so both transposes are dead by then).
            # FP8 GEMMs have no BGRADB: the bias gradient is a sum of dZ, which XLA fuses with
            # dZ's amax above (both read dZ once); before the barrier, so dZ dies there.
            own_dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(dy.dtype) \
                if need_bias_grad else None
            dz8, h8, own_dbias, dz8t = barrier.flat_barrier(dz8, s.input, own_dbias, dz8t)
            dkernel, _ = matmul8(h8.T, s.input_scale, dz8.T if dz8t is None else dz8t,
                                  dz_scale, dy.dtype,
                                  planned.gemm(i, "weight gradient").requested, fast_weight,
                                  transpose_b=True)
            dz8, dkernel = barrier.flat_barrier(dz8, dkernel)
            if below_plan is not None and below_plan.writes_fp8_gradient:
                # The previous layer's dZ8 straight from the GEMM (delayed scale, its amax),
                # ReLU's derivative h8 > 0 applied to its bits, the bias gradient its sum.
                # |dZ Wᵀ| <= amax(dZ) · max row sum |W|: the bound a cold history takes
                bound = result_bound(gradient_amaxes[i], early[("bound", i)]) * s.kernel_scale
                q = multiplier(delayed_amax(state[i - 1].gradient, bound), fp8.gradient,
                               fp8.margin)
                p8, aux = matmul8(dz8, dz_scale, s.kernel, s.kernel_scale, fp8.gradient,
                                   data.requested, fast_data, transpose_b=True, result_scale=q)
                gradient_amaxes[i - 1] = reduce_amax(aux["result_amax"],
                                                     fp8.amax_reduction_axes)
                bits = jnp.where(positive(h8), jax.lax.bitcast_convert_type(p8, jnp.uint8),
                                 jnp.zeros((), jnp.uint8))
                dz8 = jax.lax.bitcast_convert_type(bits, p8.dtype)
                next_dbias = (jnp.sum(dz8, axis=0, dtype=jnp.float32) / q).astype(dy.dtype) \
                    if previous.has_bias else None
                dz8, dz = (dz8, 1.0 / q), None
            elif below_plan is not None and below_plan.relu_from_next_input:
                # ReLU's derivative from this layer's own FP8 input h8 = Q(relu(z)), as XLA
                # fusions after a plain FP8 GEMM (also the previous layer's bias gradient).
                p, _ = matmul8(dz8, dz_scale, s.kernel, s.kernel_scale, dy.dtype,
                                data.requested, fast_data, transpose_b=True)
                dz = jnp.where(positive(h8), p, jnp.zeros((), p.dtype))
                next_dbias = jnp.sum(dz, axis=0, dtype=jnp.float32).astype(dz.dtype) \
                    if previous.has_bias else None
            else:
                epilog = data.epilog
                dz, aux = matmul8(
                    dz8, dz_scale, s.kernel, s.kernel_scale, dy.dtype, data.requested, fast_data,
                    epilog=epilog, transpose_b=True,
                    inputs={epilog.aux_input: previous_residual} if epilog.aux_input else None)
                next_dbias = aux.get(epilog.reduction_output) if previous is not None and \
                    previous.has_bias and epilog.reduction_output else None
            if dz is not None:
                dz8 = None
        grads.append((dkernel, own_dbias if need_bias_grad else dbias))
        dbias = next_dbias
    return dz, tuple(reversed(grads)), _next_state(planned, saved, state, gradient_amaxes)


def _next_state(planned: StackPlan, saved, state, gradient_amaxes):
    """The state's cotangent: its next value (Flax's "overwrite with gradient"), each FP8
    layer's histories with this step's amaxes recorded; a bf16 layer's unchanged."""
    if state is None:
        return None
    amaxes = [s.input_amax for s in saved] + list(gradient_amaxes.values())
    _check_recordable(planned, manual_axes.varying_axes(amaxes), state)
    return tuple(Fp8History(record(h.input, s.input_amax), record(h.gradient,
                                                                   gradient_amaxes[i]))
                 if q else h for i, (q, s, h) in enumerate(zip(planned.quantized, saved, state)))


def _check_recordable(planned: StackPlan, varying, state):
    """Inside shard_map: an error where this step's amaxes, varying over the mesh axes
    `varying`, may differ between the devices that share `state`."""
    unreduced = [a for a in varying if a not in manual_axes.varying_axes(jax.tree.leaves(state))]
    if unreduced:  # each device would record its own amaxes
        wanted = tuple(dict.fromkeys((*(planned.fp8.amax_reduction_axes or ()), *unreduced)))
        raise ValueError(f"fp8_state: inside shard_map this step's amaxes may differ "
                         f"between the devices along the mesh axes {tuple(unreduced)}, but "
                         f"fp8_state is the same on every device; pass fp8=Fp8(..., "
                         f"amax_reduction_axes={wanted}) so that every device records the "
                         f"amaxes of the whole tensors")


_fp8_stack.defvjp(_fp8_stack_fwd, _fp8_stack_bwd)


@jax.custom_vjp
def carry_state(y, state):
    """y, with `state`'s cotangent its own value: a stack under delayed scaling whose layers
    all stay bf16 (`Fp8(layers="auto")`) returns its state unchanged as its gradient."""
    del state
    return y


carry_state.defvjp(lambda y, state: (y, state), lambda state, dy: (dy, state))


def stack(planned: StackPlan, rows, params, state=None):
    """The stack on `rows` `(M, K)` as `planned` (`stack_plan.plan_stack`, with FP8 layers) says
    (called by `functional.run`); `state`: the `Fp8History` of each layer under delayed scaling
    (or recording current scaling's amaxes), else None."""
    return _fp8_stack(planned, rows, params, state)
