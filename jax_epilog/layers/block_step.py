"""Block-scaled FP8 training (`Fp8(scaling="block")`, issue 39; docs/fp8.md, "Block-scaled
training"): DeepSeek-V3's recipe, as TransformerEngine's `Float8BlockScaling` runs it.

Each run of consecutive block-scaled layers `act(x W + b)` of a stack is one `jax.custom_vjp`
(`_segment`), three block-scaled e4m3 GEMMs a layer (`jax_epilog.matmul` with `BlockScales`),
every scale current, from its own tile:

- Forward, y = x W: x in 1×128 tiles along K (`quantize_1x128`), W in 128×128 blocks
  (`quantize_128x128`), the bias in the GEMM's BIAS epilog. Block-scaled GEMMs run DEFAULT
  and BIAS only, so the activation is applied where the next layer quantizes its input
  (`quantize_1x128_both(activation=...)`, one pass over Z); the segment's last layer applies
  it in an XLA fusion.
- Data gradient, dx = dZ Wᵀ: dZ in 1×128 tiles along N, W's same 128×128 blocks read
  transposed (a block of W is a block of Wᵀ: no requantization).
- Weight gradient, dW = xᵀ dZ: it contracts the tokens, so both operands need 1×128 tiles
  along the tokens: xᵀ and dZᵀ quantized with `transposed=True`. x and dZ are each quantized
  once into both copies (`quantize_1x128_both`; `blocks.BOTH_COPIES`, read when the stack
  is traced, says how: XLA or a Pallas kernel). Tokens are zero-padded to a multiple of 128
  for these copies (zero rows add nothing to either product); any token count works.
- The residuals are FP8: xᵀ's e4m3 copy and its scales, W's e4m3 blocks and their scales,
  and the activation's (the 1-bit ReLU mask, GELU's pre-activation), never a 16-bit x;
  named as `layers.functional`'s are (`LAYER_INPUT_NAME`, `residual_name`) for remat.
- dZ's quantization pass also computes dZ = dY · gelu'(Z) (GELU's residual is Z) and dZ's
  column sums, the bias gradient (`pre_activation=`, `column_sums=`); ReLU's 1-bit mask is
  applied by an XLA fusion before it. With the Pallas kernel, nothing else reads dY or Z.

The layers' feature widths must be multiples of 128 (every GEMM contracts one of them):
`Fp8(layers="all")` refuses others with an error naming the argument; `layers="auto"` runs
such a layer, and one too small for FP8 to pay (`stack_plan.fp8_pays`), in the compute dtype
(`layers.functional`'s layer); `planning.block_plan` decides. There is no state: the Flax
modules hold no amax histories. On a CPU every GEMM is the exact reference (block
dequantization, float32 product).

The SwiGLU block under this recipe (`swiglu`, which `layers.swiglu.swiglu` runs where
`block_plan.swiglu_plan` says) is one more custom VJP of six such GEMMs: x, h = silu(g)·u,
dy and `[dg du]` quantized into both their copies, `[gate up]` and down in 128×128 blocks,
g and u kept in 1×128 tiles along F for the backward.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_epilog.float8.blocks import (both_copies_kernel, dequantize, quantize_1x128,
                                     quantize_1x128_both, quantize_128x128)
from jax_epilog.layers import gating
from jax_epilog.layers.gemms import LAYER_INPUT_NAME, SWIGLU_HIDDEN_NAME, residual_name
from jax_epilog.op import barrier
from jax_epilog.op.block_scales import BLOCK, BlockScales
from jax_epilog.op.epilogs import ACTIVATIONS, Epilog
from jax_epilog.op.matmul import activation_gradient, matmul
from jax_epilog.planning import block_plan

#: The format of every operand: activations, weights and gradients (`Fp8.gradient`).
FORMAT = "float8_e4m3fn"


class Layer(NamedTuple):
    """What is static about one block-scaled layer: its activation, whether it has a bias,
    its result dtype, and how x and dZ are quantized into both their copies
    (`blocks.BOTH_COPIES`, read when the stack is traced, so the backward runs the same)."""

    activation: Optional[str]
    has_bias: bool
    dtype: str
    both_copies: str


def _padded_rows(x):
    """x (rows, K) with zero rows up to a multiple of 128: the weight gradient's transposed
    1×128 copies tile the tokens."""
    pad = -x.shape[0] % BLOCK
    return x if not pad else jnp.pad(x, ((0, pad), (0, 0)))


def _transposed(scales: BlockScales) -> BlockScales:
    """A weight's 128×128 scales as the forward reads it, W (K, N) as op(b) = Wᵀ (N, K)."""
    return BlockScales(scales.values.T, scales.block)


def _forward(layer: Layer, x8, sx, w8, sw, bias):
    """Z = x W + b (the pre-activation) in the compute dtype, one block-scaled GEMM."""
    return matmul(x8, w8, epilog=Epilog.DEFAULT if bias is None else Epilog.BIAS,
                  epilog_inputs=None if bias is None else {"bias": bias},
                  quantization_scales={"a": sx, "b": _transposed(sw)},
                  preferred_element_type=layer.dtype)


def _activated(layer: Layer, z):
    if layer.activation is None:
        return z
    return ACTIVATIONS[layer.activation].fn(z.astype(jnp.float32)).astype(z.dtype)


def _residual(layer: Layer, z):
    """What the backward keeps of Z for the activation (the ReLU mask, GELU's Z), named as
    the other layers' residuals are, for remat policies."""
    if layer.activation is None:
        return None
    return checkpoint_name(ACTIVATIONS[layer.activation].keep(z.astype(jnp.float32), z.dtype),
                           residual_name(layer.activation))


def _derivative_in_kernel(layer: Layer) -> bool:
    """Whether dZ = dY · act'(Z) is computed in dZ's quantization pass: where the residual is
    Z itself (GELU). ReLU's 1-bit mask is applied by an XLA fusion first."""
    return layer.activation is not None and ACTIVATIONS[layer.activation].residual == "gelu_aux"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _segment(layers: tuple[Layer, ...], x, params):
    # The primal runs where nothing differentiates the layers: no transposed copies, no
    # padding; XLA fuses each activation into the next layer's quantization.
    h = x
    for layer, (kernel, bias) in zip(layers, params):
        x8, sx = quantize_1x128(h, FORMAT)
        w8, sw = quantize_128x128(kernel, FORMAT)
        h = _activated(layer, _forward(layer, x8, sx, w8, sw, bias))
    return h


def _segment_fwd(layers: tuple[Layer, ...], x, params):
    # Each layer's input is quantized from the previous layer's pre-activation Z, the
    # activation applied in the same pass: no 16-bit act(Z) is written between two layers.
    rows, z, activation, saved = x.shape[0], x, None, []
    for layer, (kernel, bias) in zip(layers, params):
        (x8, sx), (xt8, sxt) = quantize_1x128_both(_padded_rows(z), FORMAT,
                                                   kernel=layer.both_copies,
                                                   activation=activation)
        w8, sw = quantize_128x128(kernel, FORMAT)
        z = _forward(layer, x8, sx, w8, sw, bias)[:rows]
        saved.append(((checkpoint_name(xt8, LAYER_INPUT_NAME), sxt), (w8, sw),
                      _residual(layer, z)))
        activation = layer.activation
    return _activated(layers[-1], z), tuple(saved)


def _segment_bwd(layers: tuple[Layer, ...], saved, dy):
    rows, grads = dy.shape[0], []
    for layer, ((xt8, sxt), (w8, sw), residual) in zip(reversed(layers), reversed(saved)):
        if _derivative_in_kernel(layer):  # dZ = dY · act'(Z) in the quantization pass
            n = dy.shape[1]
            source, activation, z = dy, layer.activation, _padded_rows(residual[:, :n])
        else:
            source = activation_gradient(dy, residual, layer.activation)
            activation, z = None, None
        (dz8, sdz), (dzt8, sdzt), *sums = quantize_1x128_both(
            _padded_rows(source), FORMAT, kernel=layer.both_copies, activation=activation,
            pre_activation=z, column_sums=layer.has_bias)
        dbias = sums[0].astype(dy.dtype) if layer.has_bias else None
        # dW = xᵀ dZ (K, N): both operands 1×128 along the tokens, dZᵀ read as op(b).
        dkernel = matmul(xt8, dzt8, transpose_b=True, quantization_scales={"a": sxt, "b": sdzt},
                         preferred_element_type=layer.dtype)
        # dx = dZ Wᵀ (tokens, K): W's blocks, W (K, N) read as op(b) (K, N).
        dy = matmul(dz8, w8, transpose_b=True, quantization_scales={"a": sdz, "b": sw},
                    preferred_element_type=layer.dtype)[:rows]
        grads.append((dkernel, dbias))
    return dy, tuple(reversed(grads))


_segment.defvjp(_segment_fwd, _segment_bwd)


def stack(fp8, rows, params, activations, dtype, plain_layer):
    """The stack on `rows` (M, K) under `fp8` (`scaling="block"`), called by `functional.run`:
    each run of block-scaled layers (`block_plan.block_stack_plan`) one `_segment`, and each
    layer "auto" leaves out `plain_layer(h, kernel, bias, activation)`, the compute-dtype
    layer."""
    widths = [rows.shape[1]] + [kernel.shape[1] for kernel, _ in params]
    plan = block_plan.observe(block_plan.block_stack_plan(fp8, rows.shape[0], widths,
                                                          jnp.dtype(dtype).name))
    h, both_copies, segment = rows, both_copies_kernel(), []

    def run_segment(h):
        if segment:
            h = _segment(tuple(layer for layer, _ in segment), h,
                         tuple(pair for _, pair in segment))
            segment.clear()
        return h

    for gemm, (kernel, bias), activation in zip(plan.gemms, params, activations):
        if gemm.choice.choice == "fp8":
            segment.append((Layer(activation, bias is not None, jnp.dtype(dtype).name,
                                  both_copies), (kernel, bias)))
        else:
            h = plain_layer(run_segment(h), kernel, bias, activation)
    return run_segment(h)


# --- the SwiGLU block (`swiglu(..., fp8=Fp8(scaling="block"))`) ------------------------------

class SwiGLU(NamedTuple):
    """What is static about a block-scaled SwiGLU block: F, and how x, h, dy and `[dg du]`
    are quantized into both their copies (`blocks.BOTH_COPIES`, read when it is traced)."""

    hidden: int
    both_copies: str


def _both_copies(block: SwiGLU, t):
    """t's two 1×128 copies (`quantize_1x128_both`), its rows zero-padded to a multiple of
    128: the GEMM's along its features and the weight gradient's along the tokens."""
    return quantize_1x128_both(_padded_rows(t), FORMAT, kernel=block.both_copies)


def _gemm(a8, sa, w8, sw, dtype):
    """a8 (M, K) in 1×128 tiles times a weight (K, N) in 128×128 blocks, in `dtype`."""
    return matmul(a8, w8, quantization_scales={"a": sa, "b": _transposed(sw)},
                  preferred_element_type=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def swiglu(block: SwiGLU, x, gate_up, down):
    """`down(silu(x gate) * (x up))` over x (M, D), `gate_up` (D, 2F), six block-scaled
    GEMMs with its gradient (`layers.swiglu` checks the arguments)."""
    # Nothing differentiates it here: no transposed copies, no g8 and u8.
    dtype = x.dtype
    gu = _gemm(*quantize_1x128(x, FORMAT), *quantize_128x128(gate_up, FORMAT), dtype)
    h = gating.hidden(gu, block.hidden).astype(dtype)
    return _gemm(*quantize_1x128(h, FORMAT), *quantize_128x128(down, FORMAT), dtype)


def _swiglu_fwd(block: SwiGLU, x, gate_up, down):
    dtype, rows = x.dtype, x.shape[0]
    (x8, sx), (xt8, sxt) = _both_copies(block, x)
    w8, sw = quantize_128x128(gate_up, FORMAT)
    down8, sdown = quantize_128x128(down, FORMAT)
    gu = _gemm(x8, sx, w8, sw, dtype)[:rows]
    # g and u kept for the backward in 1×128 tiles along F; h rounded to the compute dtype
    # (the quantizing pass reads a tensor), then both its copies
    (g8, sg), (u8, su) = (quantize_1x128(half, FORMAT)
                          for half in (gu[:, :block.hidden], gu[:, block.hidden:]))
    (h8, sh), (ht8, sht) = _both_copies(block, gating.hidden(gu, block.hidden).astype(dtype))
    # As in the per-tensor block: the barrier keeps XLA from moving g8's and u8's casts into
    # the backward, which would keep the 16-bit [g u] alive until then.
    h8, g8, u8 = barrier.flat_barrier(h8, g8, u8)
    y = _gemm(h8, sh, down8, sdown, dtype)[:rows]
    named = functools.partial(checkpoint_name, name=SWIGLU_HIDDEN_NAME)
    return y, ((checkpoint_name(xt8, LAYER_INPUT_NAME), sxt), (named(g8), sg), (named(u8), su),
               (named(ht8), sht), (w8, sw), (down8, sdown))


def _swiglu_bwd(block: SwiGLU, saved, dy):
    (xt8, sxt), (g8, sg), (u8, su), (ht8, sht), (w8, sw), (down8, sdown) = saved
    dtype, rows = dy.dtype, dy.shape[0]
    (dy8, sdy), (dyt8, sdyt) = _both_copies(block, dy)
    # As in `_segment_bwd`: weight gradients from both operands' copies along the tokens,
    # data gradients from the kernels' blocks read transposed.
    ddown = matmul(ht8, dyt8, transpose_b=True, quantization_scales={"a": sht, "b": sdyt},
                   preferred_element_type=dtype)
    dh = matmul(dy8, down8, transpose_b=True, quantization_scales={"a": sdy, "b": sdown},
                preferred_element_type=dtype)[:rows]
    dgu = gating.hidden_gradient(dh, dequantize(g8, sg), dequantize(u8, su), dtype)
    (dgu8, sdgu), (dgut8, sdgut) = _both_copies(block, dgu)
    dgate_up = matmul(xt8, dgut8, transpose_b=True, quantization_scales={"a": sxt, "b": sdgut},
                      preferred_element_type=dtype)
    dx = matmul(dgu8, w8, transpose_b=True, quantization_scales={"a": sdgu, "b": sw},
                preferred_element_type=dtype)[:rows]
    return dx, dgate_up, ddown


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
