"""Inference with weights stored in FP8 (`Fp8Weight`, docs/serving.md): the forward of a
`dense`/`mlp` stack some of whose kernels are `Fp8Weight`s, and `calibrate`, which gives them
static input scales.

A stored-FP8 layer over many rows is one FP8 GEMM: the input quantized to e4m3 (from its own
amax, in one XLA fusion with whatever produced it, or with the weight's static
`input_scale`), the stored `(N, K)` data read as it is (K-major, what the kernel wants), bias
and ReLU/GELU in the GEMM's epilog, the result in the compute dtype. Over few rows (decoding)
a layer is weight-only (the 16-bit input times the weight converted inside XLA's GEMM), XLA's
own FP8 dot of the quantized input, or one Pallas kernel on CUDA that quantizes the input
and multiplies (`fp8_pallas`); `planning.serving_plan` chooses, `JAX_EPILOG_SERVING`
overrides. 16-bit layers of the same stack run their ordinary forward GEMM. Nothing here is differentiable: a gradient through a stored-FP8 stack
raises an error that says to train the 16-bit parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8 import few_rows_fp8_kernel, scaling
from jax_epilog.float8.blocks import quantize_rows
from jax_epilog.float8.weights import INPUT_FORMAT, Fp8Weight, check_weight
from jax_epilog.op.block_scales import BlockScales
from jax_epilog.op.epilogs import ACTIVATIONS, Epilog, aux_dtype
from jax_epilog.op.matmul import matmul
from jax_epilog.op.reference import saturating_cast
from jax_epilog.planning import block_plan
from jax_epilog.planning.context import Choice
from jax_epilog.planning.serving_plan import WEIGHT_ONLY_MIN_ROWS, serving_way
from jax_epilog.runtime import context


#: The stored-FP8 GEMMs use cuBLASLt's fast accumulation, as the training recipe's forward
#: GEMMs do (`Fp8()`'s default) and TransformerEngine's forward does.
FAST_ACCUMULATION = True

_NOT_DIFFERENTIABLE = (
    "layers with weights stored in FP8 (jax_epilog.Fp8Weight, made by quantize_params) run "
    "inference only: differentiate the 16-bit parameters (fp8=True trains in FP8) and "
    "quantize them after training")


def has_stored_weights(params) -> bool:
    """Whether any kernel of a stack's `(kernel, bias)` pairs is an `Fp8Weight`."""
    return any(isinstance(pair[0], Fp8Weight) for pair in params
               if isinstance(pair, (tuple, list)) and pair)


def operands_dtype(x, params):
    """The result type of `x` and a stack's 16-bit parameters, its compute dtype unless one
    is given (an `Fp8Weight` holds FP8 data, not a compute dtype)."""
    arrays = [x] + [p for pair in params for p in pair
                    if p is not None and not isinstance(p, Fp8Weight)]
    return jnp.result_type(*arrays)


def promote(promote_dtype: Callable, *arrays, dtype):
    """Flax's `promote_dtype` over `arrays`, `Fp8Weight`s passed through unchanged."""
    plain = [a for a in arrays if not isinstance(a, Fp8Weight)]
    promoted = iter(promote_dtype(*plain, dtype=dtype))
    return [a if isinstance(a, Fp8Weight) else next(promoted) for a in arrays]


def forward(activations: tuple, dtype, x, params):
    """`act_i(h @ kernel_i + bias_i)` layer by layer, stored-FP8 kernels as FP8 GEMMs; `x`
    `(rows, K)` in `dtype`, `params` checked pairs (16-bit ones cast to `dtype`). Not
    differentiable (`_NOT_DIFFERENTIABLE`)."""
    observe("served stack", x.shape[0], [kernel for kernel, _ in params], dtype)
    return _served_layers(activations, dtype, x, params)


def observe(kind: str, rows: int, kernels, dtype) -> None:
    """Tells `explain` (`block_plan.observe`) how a served `kind` of `kernels` runs over
    `rows` rows: each stored-FP8 kernel the one way `serving_way` chooses, each 16-bit one
    its ordinary forward GEMM."""
    way = serving_way(rows)
    stored = [kernel for kernel in kernels if isinstance(kernel, Fp8Weight)]
    scales = sorted({"per channel" if per_channel(k) else "per tensor" for k in stored})
    plain = Choice("bf16", "a 16-bit kernel: its forward GEMM (jax_epilog.matmul)")
    gemms = tuple(block_plan.Gemm(f"kernel {i}", *kernel.shape,
                                  way if isinstance(kernel, Fp8Weight) else plain)
                  for i, kernel in enumerate(kernels))
    block_plan.observe(block_plan.BlockPlan(
        kind, jnp.dtype(dtype).name, rows, f"kernels stored in FP8, {' and '.join(scales)}",
        way, gemms))


def _layers(activations: tuple, dtype, x, params):
    h, h8 = x, None  # h8: (e4m3 input, its scale) when the GEMM before wrote it in FP8
    for i, (activation, (kernel, bias)) in enumerate(zip(activations, params)):
        epilog = Epilog.find(activation, bias is not None, False)
        if not isinstance(kernel, Fp8Weight):
            inputs = None if bias is None else {"bias": bias.astype(dtype)}
            h = matmul(h, kernel, epilog=epilog, epilog_inputs=inputs)
            continue
        check_weight(f"layers[{i}] kernel", kernel, (h if h8 is None else h8[0]).shape[-1])
        recorded = record_input(h, kernel)
        way = serving_way(x.shape[0]).choice  # the same way for every layer
        if way == "weight_only":
            h = weight_only(h, kernel, bias, activation)
            continue
        if way == "fp8_pallas":  # h is 16-bit: only the "fp8" way writes FP8 between layers
            h = fp8_pallas(h, kernel, bias, activation, dtype)
            continue
        h8, input_scale = quantize_input(h, kernel) if h8 is None else h8
        if way == "xla_fp8":
            h, h8 = xla_fp8(h8, input_scale, kernel, bias, activation, dtype), None
            continue
        following = params[i + 1][0] if i + 1 < len(params) else None
        if jnp.dtype(dtype) == jnp.float32 and bias is not None:
            # cuBLASLt 13.1 has no FP8 kernel with a float32 result and a bias epilog (per
            # tensor or per row, docs/fp8.md): the plain FP8 GEMM, the rest one fusion
            h, h8 = _fp8_gemm_then_epilogue(h8, input_scale, kernel, bias, activation), None
            continue
        if writes_fp8_input(kernel, following, recorded, dtype):
            # The next layer's static scale is known: this GEMM writes its e4m3 input
            # itself (saturating), saving a pass over the activation and half its bytes.
            result, scales = INPUT_FORMAT, {"d": 1.0 / following.input_scale}
            inputs = None if bias is None else {"bias": bias.astype(aux_dtype(result))}
        else:
            result, scales = dtype, {}
            inputs = None if bias is None else {"bias": bias.astype(dtype)}
        y = fp8_matmul(h8, input_scale, kernel, result, epilog=epilog, epilog_inputs=inputs,
                       scales=scales)
        h, h8 = (y, None) if result == dtype else (None, (y, following.input_scale))
    return h


def writes_fp8_input(weight: Fp8Weight, following, recorded, dtype) -> bool:
    """Whether a served FP8 GEMM (of `weight`) writes its result in e4m3 for the layer after
    it: that layer's weight is stored in FP8 with a static input scale (`calibrate`), so its
    FP8 GEMM would quantize with that scale anyway. In bfloat16 only: an FP8 result's bias is
    bfloat16 (cuBLASLt's), which would round a float32 or float16 bias. Not while
    calibrating, which records 16-bit inputs. Not from a per-channel weight: GEMMs with row
    scales write 16/32-bit results."""
    return (isinstance(following, Fp8Weight) and following.input_scale is not None
            and recorded is None and jnp.dtype(dtype) == jnp.bfloat16
            and not per_channel(weight))


def per_channel(weight: Fp8Weight) -> bool:
    """Whether `weight` has one scale per output channel (`quantize_params(granularity=
    "channel")`) rather than one for the kernel."""
    return jnp.ndim(weight.scale) == 1


def weight_only(h, weight: Fp8Weight, bias, activation: Optional[str]):
    """`act(h @ (scale · data)ᵀ + bias)` with h unquantized: the FP8 data converted to h's
    dtype where the GEMM reads it (XLA fuses the convert into its GEMM), the product in
    float32, then scale, bias and activation in one fusion, the result in h's dtype. Fewer
    than `WEIGHT_ONLY_MIN_ROWS` rows are padded with zero rows, which are sliced off."""
    rows = h.shape[0]
    padded = jnp.pad(h, ((0, max(0, WEIGHT_ONLY_MIN_ROWS - rows)), (0, 0)))
    z = jax.lax.dot_general(padded, weight.data.astype(h.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)[:rows]
    return _scaled_epilogue(z, weight.scale, bias, activation, h.dtype)


def xla_fp8(h8, input_scale, weight: Fp8Weight, bias, activation: Optional[str], dtype):
    """`act(input_scale · scale · (h8 @ dataᵀ) + bias)` by XLA's own FP8 dot (its autotuner
    picks the kernel), the product rounded to `dtype` as XLA's FP8 GEMMs write it (float32
    for a float16 `dtype`: the unscaled product, up to 448² per term, would overflow it),
    then scale, bias and activation in float32 in one fusion, the result in `dtype`.
    Per-token input scales multiply the rows, per-channel weight scales the columns."""
    z = jax.lax.dot_general(h8, weight.data, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32 if jnp.dtype(dtype) == jnp.float16
                            else dtype)
    input_scale = input_scale[:, None] if jnp.ndim(input_scale) == 1 else input_scale
    return _scaled_epilogue(z, input_scale * weight.scale, bias, activation, dtype)


def fp8_pallas(h, weight: Fp8Weight, bias, activation: Optional[str], dtype):
    """`act(h @ weight + bias)` over few rows of a 16-bit `h`: on CUDA, where the shape fits
    it, one Pallas kernel (`few_rows_fp8_kernel`) that quantizes h as `quantize_input` does
    (static scale, or the amax of h or of each row, from h's row amaxes: one XLA reduction),
    multiplies it by the stored weight and applies scale, bias and activation before
    rounding once. Elsewhere `quantize_input`, then `xla_fp8`: the same FP8 operands, the
    product rounded once more."""
    rows, k = h.shape
    if not few_rows_fp8_kernel.fits(rows, k, weight.data.shape[0], dtype):
        return xla_fp8(*quantize_input(h, weight), weight, bias, activation, dtype)
    static = weight.input_scale is not None
    operands = (h, weight.data, weight.scale) + (
        (jnp.asarray(weight.input_scale, jnp.float32),) if static else ()) + (
        () if bias is None else (bias,))

    def split(args):
        """(h, the weight, bias or None) from `operands`."""
        h, data, scale, *rest = args
        input_scale = rest.pop(0) if static else None
        return h, Fp8Weight(data, scale, input_scale), rest[0] if rest else None

    def kernel(*args):
        h, w, b = split(args)
        scaling = None if static else "row" if per_channel(w) else "tensor"
        amaxes = None if static else few_rows_fp8_kernel.row_amax(h)
        return few_rows_fp8_kernel.few_rows_fp8_gemm(
            h, w.input_scale, w.data, w.scale, b, row_amax=amaxes, activation=activation,
            dtype=dtype, input_scaling=scaling)

    def xla(*args):
        h, w, b = split(args)
        return xla_fp8(*quantize_input(h, w), w, b, activation, dtype)

    return jax.lax.platform_dependent(*operands, cuda=kernel, default=xla)


@functools.partial(jax.jit, static_argnames="activation")
def _fp8_gemm_then_epilogue(h8, h_scale, weight: Fp8Weight, bias, activation: Optional[str]):
    """`act(h8 @ weight + bias)` in float32: the FP8 GEMM without epilog, then bias and
    activation in XLA. One jitted function, so that `calibrate`'s eager run rounds as a jitted
    model does (XLA contracts the GEMM's scaling and the bias add into one multiply-add)."""
    return _scaled_epilogue(fp8_matmul(h8, h_scale, weight, jnp.float32), 1.0, bias,
                            activation, jnp.float32)


def _scaled_epilogue(z, scale, bias, activation: Optional[str], dtype):
    """`act(z · scale + bias)` in float32, in `dtype`: the XLA ways' epilog."""
    z = z.astype(jnp.float32) * scale
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    if activation is not None:
        z = ACTIVATIONS[activation].plain(z)
    return z.astype(dtype)


def fp8_matmul(h8, h_scale, weight: Fp8Weight, result, *, epilog=Epilog.DEFAULT,
               epilog_inputs=None, scales=None):
    """The FP8 GEMM of an e4m3 input `h8` (dequantized by `h_scale`, a scalar or one per row)
    and a stored weight, as it reads it (`(N, K)`, K-major), with `epilog` and a
    `result`-typed output; `scales` adds the output's `"d"` scale. Where either scale is a
    vector the GEMM scales rows (`BlockScales` "row" for both operands: cuBLASLt's outer
    vector scaling), a scalar one repeated for each row."""
    operand_scales = {"a": h_scale, "b": weight.scale}
    if per_channel(weight) or jnp.ndim(h_scale) == 1:
        rows = lambda scale, n: BlockScales(  # noqa: E731
            jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (n,)), "row")
        operand_scales = {"a": rows(h_scale, h8.shape[0]),
                          "b": rows(weight.scale, weight.data.shape[0])}
    return matmul(h8, weight.data, transpose_b=True, epilog=epilog, epilog_inputs=epilog_inputs,
                  quantization_scales={**operand_scales, **(scales or {})},
                  preferred_element_type=result, fast_accumulation=FAST_ACCUMULATION)


def _raise_not_differentiable(*args):
    raise TypeError(_NOT_DIFFERENTIABLE)


def inference_only(fn: Callable, static: tuple[int, ...]) -> Callable:
    """`fn` (a served forward, `static` its non-array arguments) that raises
    `_NOT_DIFFERENTIABLE` where it is differentiated, and runs as it is while `calibrate`
    records (eagerly: the values are read directly)."""
    checked = jax.custom_vjp(fn, nondiff_argnums=static)
    checked.defvjp(_raise_not_differentiable, _raise_not_differentiable)
    return lambda *args: (fn if context.current().calibration is not None else checked)(*args)


_served_layers = inference_only(_layers, (0, 1))


def quantize_input(h, weight: Fp8Weight):
    """(h in e4m3, its float32 dequantization scale): with the weight's static `input_scale`,
    else from h's amax (current scaling, one fusion with h's producer). Before a per-channel
    weight, current scaling is per token: h's rows `(rows, K)` each from their own amax, the
    scales `(rows,)` (the GEMM scales rows of both operands anyway, and a token of large
    values then costs the others no precision)."""
    with jax.named_scope("fp8_input"):  # a profile tells these kernels by this scope
        if weight.input_scale is None:
            if per_channel(weight):
                h8, scales = quantize_rows(h, INPUT_FORMAT)
                return h8, scales.values
            h8, scale = scaling.quantize(h, scaling.amax(h), INPUT_FORMAT, 0)
            return h8, scale
        scale = jnp.asarray(weight.input_scale, jnp.float32)
        return saturating_cast(h.astype(jnp.float32) / scale, INPUT_FORMAT), scale


# --- calibration ---------------------------------------------------------------------------

def record_input(h, weight: Fp8Weight) -> Optional[dict]:
    """While `calibrate` runs: `h`, the input of `weight`'s GEMM, counts towards its static
    scale. Returns the amaxes being recorded (None: not calibrating)."""
    recorded = context.current().calibration
    if recorded is None:
        return None
    if isinstance(h, jax.core.Tracer):
        raise TypeError("calibrate: apply_fn ran under a JAX transform (jax.jit, ...), where "
                        "the inputs' amaxes cannot be read; pass a function that applies the "
                        "model directly (calibrate runs it eagerly, a few batches)")
    key = id(weight.data)
    recorded[key] = max(recorded.get(key, 0.0), float(scaling.amax(h)))
    return recorded


def calibrate(apply_fn: Callable[[Any, Any], Any], params, batches: Iterable, *,
              margin: int = 0):
    """`params` whose `Fp8Weight`s carry static input scales, from the inputs those layers
    see over `batches`.

    Args:
      apply_fn: `apply_fn(params, batch)` runs the model (e.g. `lambda p, x:
        model.apply({"params": p}, x)` for Linen, `lambda s, x: nnx.merge(graphdef, s)(x)`
        for NNX). Called eagerly, once per batch: not under `jax.jit`.
      params: a tree with `Fp8Weight`s (`quantize_params`).
      batches: an iterable of at least one batch, representative of serving inputs.
      margin: scales leave `2**margin` of headroom above the largest input seen (as
        `Fp8(margin=)`); larger serving inputs saturate.

    Returns:
      The same tree; each `Fp8Weight` a batch reached has `input_scale` (its layer then
      skips the per-call amax), the others keep current scaling.
    """
    recorded: dict[int, float] = {}
    count = 0
    with context.changed(calibration=recorded):  # the model has no argument to carry it
        for batch in batches:
            apply_fn(params, batch)
            count += 1
    if not count:
        raise ValueError("batches: expected at least one batch to calibrate on, got none")
    if not recorded:
        raise ValueError("params: no layer with a stored FP8 weight ran on the batches; "
                         "quantize_params first, and apply_fn must run the model on params")

    def with_scale(leaf):
        if not isinstance(leaf, Fp8Weight) or id(leaf.data) not in recorded:
            return leaf
        q = scaling.multiplier(jnp.float32(recorded[id(leaf.data)]), INPUT_FORMAT, margin)
        return Fp8Weight(leaf.data, leaf.scale, (1.0 / q).astype(jnp.float32))

    return jax.tree_util.tree_map(with_scale, params,
                                  is_leaf=lambda x: isinstance(x, Fp8Weight))
