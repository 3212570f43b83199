"""`swiglu`: the Llama-style MLP block `down(silu(x @ gate) * (x @ up))`, no biases; in FP8 as
ONE `jax.custom_vjp` that keeps little for its backward.

In the compute dtype (no `fp8=`) the block is plain JAX, differentiated by JAX: the GEMMs are
XLA's (a bf16 GEMM with no bias or ReLU/GELU gains nothing from an epilog: XLA's own runs at
the chip's ceiling, benchmarks/README.md). A custom VJP that kept only x and `[g u]` and
recomputed h in the backward ran slower than the plain block and held more temporaries
(benchmarks/results/swiglu/swiglu.md).

With `fp8=` (SPEC §5's recipe, `Fp8`; docs/fp8.md, "SwiGLU"):

- Forward: x and the concatenated kernel `[gate up]` `(D, 2F)` quantized to e4m3, then ONE
  FP8 GEMM for g and u (N = 2F, result in the compute dtype). XLA's fusions read `[g u]`
  and write h = silu(g)·u quantized to e4m3 (the down GEMM's operand) and g and u in e4m3,
  each on its own scale (the backward's copies); then the FP8 down GEMM.
- Residuals: x8, g8, u8 and h8 (one byte per element each) with their scales, and the two
  FP8 kernels: never a 16-bit copy of an activation.
- Backward: dy quantized to e5m2; d(down) = h8ᵀ dy8 and dh = dy8 down8ᵀ; one fusion computes
  dg = dh·u·silu'(g) and du = dh·silu(g) from g8 and u8 and quantizes `[dg du]` to e5m2;
  d(gate_up) = x8ᵀ `[dg du]`8 and dx = `[dg du]`8 `[gate up]`8ᵀ.
- JAX_EPILOG_FUSED_PASSES `cuda` (or `auto`): those passes are the library's CUDA kernels
  (`layers.fused_swiglu`, `float8.fused`), which also write dy8ᵀ and `[dg du]`8ᵀ in the
  pass that quantizes them (docs/fp8.md, "Fused passes").
- Delayed scaling (`fp8_state=`: two `Fp8History`, the gate/up GEMM's (input x, gradient
  `[dg du]`) then the down GEMM's (input h, gradient dy)): x and h take their scales from the
  histories, as a stack's layer inputs do; the kernels, the gradients and the saved g8 and u8
  keep current scaling (as the stacks' weights and top gradients do). The state's gradient is
  its next value, each history with this step's amax recorded.

`Fp8(layers="auto")` runs the block FP8 where both GEMMs pass `stack_plan.fp8_pays` (large
enough, widths multiples of 16), else in the compute dtype (an `fp8_state` then passes
through unchanged); `layers="all"` always (`planning.block_plan.swiglu_plan` decides, and
tells `explain`).

With `Fp8(scaling="block")` (DeepSeek-V3's recipe, `layers.block_step`'s; docs/fp8.md,
"Block-scaled training") the block is another custom VJP, `block_step.swiglu`, of six
block-scaled e4m3 GEMMs: x, h and, in the backward, dy and `[dg du]` in 1×128 tiles, each
quantized once into both its copies (the forward's and the weight gradient's, tokens padded
to a multiple of 128); `[gate up]` and down in 128×128 blocks, read transposed by the data
gradients; g and u kept in 1×128 tiles along F. D, F and D_out must be multiples of 128
(`planning.block_plan.swiglu_plan`); no state.

Kernels stored in FP8 (`Fp8Weight`s, `quantize_params`; docs/serving.md) run the inference
forward of `layers.serving`, the way chosen by the rows as for a served `dense`:

- "fp8": x quantized to e4m3 once (the gate weight's static `input_scale`, else x's amax),
  one FP8 GEMM per stored gate/up weight (one for a `(D, 2F)` `[gate up]`, two for a pair:
  joining stored weights would copy them every call), results in the compute dtype; one
  fusion reads `[g u]` and writes h = silu(g)·u in e4m3 (the down weight's static scale, else
  h's amax), then the FP8 down GEMM.
- "fp8_pallas": each GEMM the Pallas kernel of few rows on CUDA (`serving.fp8_pallas`),
  which quantizes its 16-bit input as "fp8" does, in the kernel; h = silu(g)·u is rounded to
  the compute dtype first.
- "xla_fp8": the same, each GEMM XLA's own FP8 dot (`serving.xla_fp8`).
- "weight_only": each GEMM of the 16-bit activation and the converted FP8 weight
  (`serving.weight_only`), h = silu(g)·u in between.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_epilog.float8 import fused
from jax_epilog.float8.blocks import both_copies_kernel
from jax_epilog.float8.recipe import Fp8, Fp8History, as_fp8, check_state
from jax_epilog.float8.scaling import quantize_scaled, record, reduced_amaxes
from jax_epilog.float8.weights import Fp8Weight
from jax_epilog.layers import block_step, fp8_step, fused_swiglu, gating, serving
from jax_epilog.layers.functional import compute_dtype, described
from jax_epilog.layers.gemms import LAYER_INPUT_NAME, SWIGLU_HIDDEN_NAME
from jax_epilog.op import barrier, manual_axes
from jax_epilog.planning import block_plan
from jax_epilog.planning.serving_plan import serving_way


#: `fp8_state=` of the block: one `Fp8History` per GEMM, in this order.
FP8_GEMMS = ("gate_up", "down")


class Block(NamedTuple):
    """The static description of one traced block: its FP8 config (None: compute dtype),
    its GEMMs' precision, and F (the split of `[g u]`)."""

    fp8: Optional[Fp8]
    precision: object
    hidden: int


def _gradient_bound(dh, s: "Saved"):
    """|dh| · max(|u·silu'(g)|, |silu(g)|) in float32, whose amax is `[dg du]`'s (to the
    compute dtype's rounding of dg and du, which the saturating cast absorbs). Written apart
    from `gating.hidden_gradient` (σ from tanh, g and u dequantized again) so that XLA shares no
    subexpression between the amax pass and the cast: it then computes the gradient in each
    instead of writing `[dg du]` (and σ) between them, and the step moves fewer bytes outside
    its GEMMs (as XLA compiles it for a Llama-size block)."""
    g = s.g8.astype(jnp.float32) * s.g_scale
    u = s.u8.astype(jnp.float32) * s.u_scale
    sigmoid = 0.5 * (1.0 + jnp.tanh(0.5 * g))
    return jnp.abs(dh.astype(jnp.float32)) * jnp.maximum(
        jnp.abs(u * sigmoid * (1.0 + g * (1.0 - sigmoid))), jnp.abs(g * sigmoid))


# --- compute dtype -------------------------------------------------------------------------

def _dot(a, b, precision, dtype):
    """a @ b in the compute dtype (XLA's GEMMs accumulate in float32 and write that dtype)."""
    return jnp.matmul(a, b, precision=precision).astype(dtype)


def _block(block: Block, x, gate_up, down):
    """The block in the compute dtype, differentiated by JAX (the module docstring says why)."""
    gu = checkpoint_name(_dot(_input(x), gate_up, block.precision, x.dtype), SWIGLU_HIDDEN_NAME)
    return _dot(gating.hidden(gu, block.hidden).astype(x.dtype), down, block.precision, x.dtype)


def _input(x):
    return checkpoint_name(x, LAYER_INPUT_NAME)


# --- FP8 -----------------------------------------------------------------------------------

class Saved(NamedTuple):
    """What the FP8 backward keeps: the FP8 input x8, g8, u8, h8 and kernels, their
    dequantization scales, and x's and h's amaxes (for the next state; None without one)."""

    x8: object
    x_scale: object
    g8: object
    g_scale: object
    u8: object
    u_scale: object
    h8: object
    h_scale: object
    w8: object
    w_scale: object
    down8: object
    down_scale: object
    x_amax: object
    h_amax: object


def _fp8_forward(block: Block, x, gate_up, down, state, keep: bool):
    fp8 = block.fp8
    axes, fmt, margin = fp8.amax_reduction_axes, fp8.forward, fp8.margin
    history = (lambda i: state[i].input) if fp8.delayed and state is not None else (lambda i: None)
    fast = fp8.fast("forward")
    # amaxes that wait for nothing else are taken together, one collective where sharded
    x_amax, w_amax, down_amax = reduced_amaxes([x, gate_up, down], axes)
    x8, x_scale, x_amax = quantize_scaled(x, fmt, margin, history(0), axes, x_amax)
    w8, w_scale, _ = quantize_scaled(gate_up, fmt, margin, x_amax=w_amax)
    down8, down_scale, _ = quantize_scaled(down, fmt, margin, x_amax=down_amax)
    gu, _ = fp8_step.matmul8(x8, x_scale, w8, w_scale, x.dtype, "auto", fast)
    if fused.uses_cuda():  # the same two passes as the library's kernels (docs/fp8.md)
        h8, h_scale, h_amax, g8, g_scale, u8, u_scale = fused_swiglu.swiglu_forward(
            gu, fmt, margin, history(1), axes, keep)
    else:
        h = gating.hidden(gu, block.hidden)
        # g and u (kept for the backward) on scales of their own, their amaxes with h's
        halves = (gu[:, :block.hidden], gu[:, block.hidden:]) if keep else ()
        # one pass reads [g u] for the three amaxes, one more writes h8, g8 and u8 (fewer
        # bytes outside the GEMMs than an amax pass per array, as XLA compiles a Llama-size
        # block)
        h_amax, *half_amaxes = reduced_amaxes([h, *halves], axes, one_pass=True)
        h8, h_scale, h_amax = quantize_scaled(h, fmt, margin, history(1), axes, h_amax)
        if keep:
            (g8, g_scale, _), (u8, u_scale, _) = (quantize_scaled(half, fmt, margin, x_amax=a)
                                                  for half, a in zip(halves, half_amaxes))
    if keep:
        # Without the barrier XLA fused g8's and u8's casts into the backward's fusions,
        # which then read the 16-bit [g u] instead: kept from forward to backward, it was
        # the largest temporary of the step. With h8 in it, the casts run before the down
        # GEMM, and [g u] can die before that GEMM's buffers are taken (fewer temporaries than
        # with y in the barrier, as XLA compiles a Llama-size block).
        h8, g8, u8 = barrier.flat_barrier(h8, g8, u8)
    y, _ = fp8_step.matmul8(h8, h_scale, down8, down_scale, x.dtype, "auto", fast)
    if not keep:
        return y, None
    named = functools.partial(checkpoint_name, name=SWIGLU_HIDDEN_NAME)
    recorded = state is not None  # the amaxes are kept only for the next state
    return y, Saved(_input(x8), x_scale, named(g8), g_scale, named(u8), u_scale, named(h8),
                    h_scale, w8, w_scale, down8, down_scale, x_amax if recorded else None,
                    h_amax if recorded else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_block(block: Block, x, gate_up, down, state):
    return _fp8_forward(block, x, gate_up, down, state, keep=False)[0]


def _fp8_block_fwd(block: Block, x, gate_up, down, state):
    y, saved = _fp8_forward(block, x, gate_up, down, state, keep=True)
    return y, (saved, state)


def _fp8_block_bwd(block: Block, residuals, dy):
    s, state = residuals
    fp8, dtype = block.fp8, dy.dtype
    axes, fmt, margin = fp8.amax_reduction_axes, fp8.gradient, fp8.margin
    fast_data, fast_weight = fp8.fast("data gradient"), fp8.fast("weight gradient")
    matmul8 = fp8_step.matmul8
    cuda = fused.uses_cuda()  # dy8ᵀ and [dg du]8ᵀ written with dy8 and [dg du]8 (fused.py)
    if cuda:
        dy8, dy8t, dy_scale, dy_amax = fused.quantize_transpose(dy, fmt, margin, amax_axes=axes)
    else:
        (dy8, dy_scale, dy_amax), dy8t = quantize_scaled(dy, fmt, margin, amax_axes=axes), None
    # The weight gradient's K-major operands (h8ᵀ, dy8ᵀ) are made after the barrier, as in
    # the stacks (barrier.flat_barrier says why); the data gradient waits for it.
    dy8, h8, dy8t = barrier.flat_barrier(dy8, s.h8, dy8t)
    ddown, _ = matmul8(h8.T, s.h_scale, dy8.T if dy8t is None else dy8t, dy_scale, dtype,
                       "auto", fast_weight, transpose_b=True)
    dy8, ddown = barrier.flat_barrier(dy8, ddown)
    dh, _ = matmul8(dy8, dy_scale, s.down8, s.down_scale, dtype, "auto", fast_data,
                    transpose_b=True)
    if cuda:
        dgu8, dgu8t, dgu_scale, dgu_amax = fused_swiglu.swiglu_gradient(
            dh, s.g8, s.g_scale, s.u8, s.u_scale, fmt, margin, axes)
    else:
        g, u = (v8.astype(jnp.float32) * scale for v8, scale in ((s.g8, s.g_scale),
                                                                 (s.u8, s.u_scale)))
        # [dg du] in the compute dtype (FP8 rounds far coarser), its amax from
        # `_gradient_bound` so that XLA does not write it between the amax pass and the cast.
        (dgu8, dgu_scale, dgu_amax), dgu8t = quantize_scaled(
            gating.hidden_gradient(dh, g, u, dtype), fmt, margin, amax_axes=axes,
            x_amax=reduced_amaxes([_gradient_bound(dh, s)], axes)[0]), None
    dgu8, x8, dgu8t = barrier.flat_barrier(dgu8, s.x8, dgu8t)
    dgate_up, _ = matmul8(x8.T, s.x_scale, dgu8.T if dgu8t is None else dgu8t, dgu_scale,
                          dtype, "auto", fast_weight, transpose_b=True)
    dgu8, dgate_up = barrier.flat_barrier(dgu8, dgate_up)
    dx, _ = matmul8(dgu8, dgu_scale, s.w8, s.w_scale, dtype, "auto", fast_data,
                    transpose_b=True)
    next_state = None if state is None else (
        Fp8History(record(state[0].input, s.x_amax), record(state[0].gradient, dgu_amax)),
        Fp8History(record(state[1].input, s.h_amax), record(state[1].gradient, dy_amax)))
    return dx, dgate_up, ddown, next_state


_fp8_block.defvjp(_fp8_block_fwd, _fp8_block_bwd)


# --- kernels stored in FP8 (inference) ----------------------------------------------------

def _served_block(hidden: int, dtype, x, gate_up: tuple, down: Fp8Weight):
    """The block's forward over `x` `(rows, D)` in `dtype` with stored weights: `gate_up` one
    `(D, 2F)` `Fp8Weight` or a (gate, up) pair of `(D, F)` ones (module docstring)."""
    for weight in gate_up:
        serving.record_input(x, weight)
    way = serving_way(x.shape[0]).choice
    if way in ("weight_only", "fp8_pallas"):  # each GEMM takes the 16-bit input as it is
        def layer(h, w):
            if way == "weight_only":
                return serving.weight_only(h, w, None, None)
            return serving.fp8_pallas(h, w, None, None, dtype)  # quantizes h itself

        gu = jnp.concatenate([layer(x, w) for w in gate_up], axis=1)
        h = gating.hidden(gu, hidden).astype(dtype)
        serving.record_input(h, down)
        return layer(h, down)
    gemm = functools.partial(_quantized_gemm, way, dtype=dtype)
    x8, x_scale = serving.quantize_input(x, gate_up[0])
    gu = jnp.concatenate([gemm(x8, x_scale, w) for w in gate_up], axis=1)
    h = gating.hidden(gu, hidden)
    serving.record_input(h, down)
    return gemm(*serving.quantize_input(h, down), down)


def _quantized_gemm(way: str, h8, h_scale, weight: Fp8Weight, dtype):
    """h8 @ weight in `dtype` by `way`: our FP8 GEMM ("fp8") or XLA's FP8 dot ("xla_fp8")."""
    if way == "xla_fp8":
        return serving.xla_fp8(h8, h_scale, weight, None, None, dtype)
    return serving.fp8_matmul(h8, h_scale, weight, dtype)


_serve = serving.inference_only(_served_block, (0, 1))


def _stored_kernels(x, gate_up, down) -> Optional[tuple[tuple, Fp8Weight, int]]:
    """(the gate/up `Fp8Weight`s, down, F) where the block's kernels are stored in FP8, each
    checked; None where none is; a block of both kinds raises an error naming the 16-bit
    kernels."""
    pair = isinstance(gate_up, (tuple, list))
    if pair and len(gate_up) != 2:
        return None  # `_kernels` says what is expected
    named = (*((("gate_up (gate)", gate_up[0]), ("gate_up (up)", gate_up[1])) if pair
               else (("gate_up", gate_up),)), ("down", down))
    plain = [name for name, kernel in named if not isinstance(kernel, Fp8Weight)]
    if len(plain) == len(named):
        return None
    if plain:
        raise TypeError(f"{', '.join(plain)}: a 16-bit kernel in a block whose other kernels "
                        f"are stored in FP8 (jax_epilog.Fp8Weight); swiglu serves the three "
                        f"stored together: quantize them together (quantize_params does, "
                        f"whatever its include= rule picks of a block) or none")
    d = jnp.shape(x)[-1] if jnp.ndim(x) else None
    if d is None:
        raise ValueError(f"x: expected an array of shape (..., D), got shape {jnp.shape(x)}")
    for name, kernel in named[:-1]:
        serving.check_weight(name, kernel, d)
    widths = [kernel.shape[1] for _, kernel in named[:-1]]
    if len(widths) == 2 and widths[0] != widths[1]:
        raise ValueError(f"gate_up: gate and up must have the same shape (D, F), got "
                         f"{named[0][1].shape} and {named[1][1].shape}")
    if len(widths) == 1 and widths[0] % 2:
        raise ValueError(f"gate_up: expected shape ({d}, 2F) ([gate up] side by side), got "
                         f"{named[0][1].shape}")
    hidden = widths[0] if len(widths) == 2 else widths[0] // 2
    serving.check_weight("down", down, hidden, "h = silu(g)·u")
    return tuple(kernel for _, kernel in named[:-1]), down, hidden


# --- the public block ------------------------------------------------------------------------

def _kernels(x, gate_up, down):
    """(the `(D, 2F)` kernel `[gate up]`, down, F), checked against x `(..., D)`."""
    d = jnp.shape(x)[-1] if jnp.ndim(x) else None
    if d is None:
        raise ValueError(f"x: expected an array of shape (..., D), got shape {jnp.shape(x)}")
    if isinstance(gate_up, (tuple, list)):
        if len(gate_up) != 2:
            raise TypeError(f"gate_up: expected a (D, 2F) kernel or a (gate, up) pair of (D, F) "
                            f"kernels, got {described(gate_up)}")
        gate, up = gate_up
        for name, kernel in (("gate", gate), ("up", up)):
            if jnp.ndim(kernel) != 2 or jnp.shape(kernel)[0] != d:
                raise ValueError(f"gate_up ({name}): expected shape ({d}, F) (x has {d} "
                                 f"features), got {jnp.shape(kernel)}")
        if jnp.shape(gate) != jnp.shape(up):
            raise ValueError(f"gate_up: gate and up must have the same shape (D, F), got "
                             f"{jnp.shape(gate)} and {jnp.shape(up)}")
        hidden = jnp.shape(gate)[1]
        gate_up = jnp.concatenate([gate, up], axis=1)  # fused into the cast or quantization
    else:
        shape = jnp.shape(gate_up)
        if len(shape) != 2 or shape[0] != d or shape[1] % 2:
            raise ValueError(f"gate_up: expected shape ({d}, 2F) ([gate up] side by side; x has "
                             f"{d} features) or a (gate, up) pair, got {described(gate_up)}")
        hidden = shape[1] // 2
    if jnp.ndim(down) != 2 or jnp.shape(down)[0] != hidden:
        raise ValueError(f"down: expected shape ({hidden}, D_out) (the hidden width F = "
                         f"{hidden}), got {jnp.shape(down)}")
    return gate_up, down, hidden


def swiglu(x, gate_up, down, *, dtype=None, precision=None, fp8=None, fp8_state=None):
    """The SwiGLU MLP block of Llama-style models, `down(silu(x @ gate) * (x @ up))`, no biases.

    Args:
      x: `(..., D)`; the leading dims are flattened into the GEMMs' rows.
      gate_up: the gate and up kernels, either as a pair `(gate, up)` of `(D, F)` kernels or
        side by side in one `(D, 2F)` kernel (`gate = gate_up[:, :F]`, `up = gate_up[:, F:]`).
        Either way they run as one GEMM (a pair is concatenated in the step, a copy XLA fuses
        into the cast or FP8 quantization that reads the kernels anyway).
      down: `(F, D_out)`.
        The kernels may instead be stored in FP8 (`jax_epilog.Fp8Weight`s, all three, or the
        `(D, 2F)` one and down; `jax_epilog.quantize_params`): then the block runs the
        inference forward with FP8 GEMMs (or weight-only over few rows) and a result in the
        computation dtype, as a served `dense` does (docs/serving.md); `fp8=` and
        `fp8_state=` do not apply to it, and it is not differentiable.
      dtype: the computation dtype; None: `jnp.result_type` of x and the kernels, like Flax.
      precision: the GEMMs' precision in the compute dtype (float32 only), as `dense`'s.
      fp8: None or False (compute dtype), True (`jax_epilog.Fp8()`) or `jax_epilog.Fp8(...)`:
        the gate/up GEMM and the down GEMM in FP8 (e4m3 activations and kernels, e5m2
        gradients by default), h = silu(g)·u quantized in the fusion that computes it, the
        backward's activations kept in FP8 (docs/fp8.md, "SwiGLU"). `Fp8()` runs FP8 where
        both GEMMs are large enough (`layers="auto"`), `Fp8(layers="all")` always.
        `Fp8(scaling="block")`: block-scaled e4m3 throughout (1×128 tiles, 128×128 kernel
        blocks; D, F and D_out multiples of 128), no `fp8_state`.
      fp8_state: two `jax_epilog.Fp8History` (`Fp8(...).init_state(2)`: the gate/up GEMM's,
        then the down GEMM's): delayed scaling, as for `dense`; its gradient is its next value.

    Returns:
      `(..., D_out)` in the computation dtype. Differentiable in reverse mode w.r.t. x, the
      kernels and `fp8_state`.
    """
    stored = _stored_kernels(x, gate_up, down)
    if stored is not None:  # inference; the training arguments do not apply
        return _served(x, *stored, dtype)
    fp8 = as_fp8(fp8)
    fp8_state = check_state(fp8, fp8_state, len(FP8_GEMMS))
    gate_up, down, hidden = _kernels(x, gate_up, down)
    dtype = compute_dtype(dtype, [x, gate_up, down])
    x, gate_up, down = (jnp.asarray(a, dtype) for a in (x, gate_up, down))
    lead, d, d_out = x.shape[:-1], x.shape[-1], down.shape[1]
    rows = x.reshape(math.prod(lead), d)
    axes = manual_axes.varying_axes([rows, gate_up, down])
    rows, gate_up, down = (manual_axes.vary(a, axes) for a in (rows, gate_up, down))
    way = block_plan.observe(block_plan.swiglu_plan(fp8, rows.shape[0], d, hidden, d_out,
                                                    jnp.dtype(dtype).name)).way.choice
    if way == "fp8_block":
        y = manual_axes.rows_in_auto_axes(
            functools.partial(block_step.swiglu,
                              block_step.SwiGLU(hidden, both_copies_kernel())), rows, gate_up,
            down)
    elif way == "fp8":
        block = Block(fp8.resolved(fp8_state is not None), precision, hidden)
        y = _fp8_block(block, rows, gate_up, down, fp8_state)
    else:
        y = manual_axes.rows_in_auto_axes(
            functools.partial(_block, Block(None, precision, hidden)), rows, gate_up, down)
        if fp8_state is not None:
            y = fp8_step.carry_state(y, fp8_state)
    return y.reshape(*lead, d_out)


def _served(x, gate_up: tuple, down: Fp8Weight, hidden: int, dtype):
    dtype = compute_dtype(dtype, [x])
    x = jnp.asarray(x, dtype)
    lead, d = x.shape[:-1], x.shape[-1]
    rows = x.reshape(math.prod(lead), d)
    serving.observe("served swiglu", rows.shape[0], (*gate_up, down), dtype)
    y = _serve(hidden, dtype, rows, gate_up, down)
    return y.reshape(*lead, y.shape[-1])
