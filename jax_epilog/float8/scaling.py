"""Per-tensor FP8 scaling (SPEC §5): a tensor's amax, its scale and saturating cast, in one
XLA expression that fuses with what already reads the tensor (`quantize_scaled`); delayed
scaling's amax histories (`record`) and their self-calibration while a history is cold
(`quantize_delayed`, `delayed_amax`, `result_bound`); and `quantize_tensor`, the public
`jax_epilog.quantize`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.float8.recipe import check_margin, fp8_format
from jax_epilog.op.amaxes import amax, amaxes
from jax_epilog.op.reference import saturating_cast
from jax_epilog.runtime import context


def multiplier(x_amax, dtype: str, margin: int):
    """The float32 quantization multiplier `q = largest / 2**margin / amax`; 1 where the amax
    is 0 or not finite (or q would not be)."""
    q = float(jnp.finfo(dtype).max) / 2.0**margin / x_amax
    ok = (x_amax > 0) & jnp.isfinite(x_amax) & jnp.isfinite(q)
    return jnp.where(ok, q, 1.0).astype(jnp.float32)


def quantize(x, x_amax, dtype: str, margin: int):
    """(x in FP8, the float32 scale that dequantizes it): `q·x` rounded and saturated, with
    q = `multiplier(x_amax, ...)`."""
    q = multiplier(x_amax, dtype, margin)
    return saturating_cast(x.astype(jnp.float32) * q, dtype), 1.0 / q


def reduce_amax(x_amax, axes):
    """`x_amax`, the largest over the devices along the bound axes among `axes`
    (`Fp8.amax_reduction_axes`), so that inside `shard_map` it is the whole tensor's amax.
    Axes that are not bound (outside `shard_map`, where the amax already covers the whole
    array) are skipped (`bound_axes`)."""
    bound = bound_axes(axes)
    return jax.lax.pmax(x_amax, bound) if bound else x_amax


def reduced_amaxes(arrays, axes, one_pass: bool = False):
    """float32 `(len(arrays),)`: the amax of each array, over `axes` as `reduce_amax`: one
    collective for all of them where they are sharded (`op.amaxes`, which says what
    `one_pass` does), so the layers take together every amax that does not wait for
    another."""
    return reduce_amax(amaxes(*arrays, one_pass=one_pass), axes)


def bound_axes(axes) -> tuple[str, ...]:
    """The names among `axes` (`Fp8.amax_reduction_axes`) that are bound here (inside
    `shard_map`); a name that is not an axis of the mesh in use is an error."""
    bound = []
    for name in axes or ():
        try:
            jax.lax.axis_size(name)
        except NameError:
            mesh = jax.sharding.get_abstract_mesh()
            if not mesh.empty and name not in mesh.axis_names:
                raise ValueError(f"amax_reduction_axes: {name!r} is not an axis of the mesh "
                                 f"in use, whose axes are {mesh.axis_names}; name the axes "
                                 f"that split the batch, activations or weights") from None
            continue
        bound.append(name)
    return tuple(bound)


def calibrates() -> bool:
    """Whether delayed scaling calibrates itself from a cold history in this trace (the
    per-trace context's switch, `uncalibrated`)."""
    return context.current().calibrates


def uncalibrated():
    """Within the block (in this thread), stacks traced under delayed scaling do not calibrate
    themselves: a cold history gives scale 1 (no own amax, no bounds). What the tests
    and `benchmarks/fp8_bench.py` compare self-calibration with; not for training. (A switch
    of the per-trace `runtime.context.Context`: every FP8 layer, stock Flax ones included,
    reaches these functions, and none has an argument to carry it.)"""
    return context.changed(calibrates=False)


def quantize_delayed(x, history, dtype: str, margin: int, amax_axes=None, x_amax=None):
    """(x in FP8, its dequantization scale, amax(x)): delayed scaling, the scale from the
    largest amax of `history` (earlier steps), x's own amax (over `amax_axes`,
    `reduce_amax`) recorded for the next step. While `history` is cold (`cold`) and the
    layers calibrate (`uncalibrated`), the scale is x's own amax's, chosen by a `where` on
    two scalars. Not a `jax.lax.cond`: on a GPU XLA copies a conditional's predicate to the
    host and waits for it, so every stack stalled the step once (a GPT step then spent a
    large part of its time waiting, docs/fp8.md). The price: the cast waits for the
    amax, so x is read twice where XLA cannot fuse the amax into x's producer. `x_amax`, where
    given, is x's amax already taken (`reduced_amaxes`, with others)."""
    if x_amax is None:
        x_amax = reduced_amaxes([x], amax_axes)[0]
    x8, scale = quantize(x, delayed_scale_amax(history, x_amax), dtype, margin)
    return x8, scale, x_amax


def delayed_scale_amax(history, x_amax):
    """The amax a tensor's delayed scale comes from: `history`'s largest, or, while it is
    `cold` and the layers calibrate, the tensor's own `x_amax` (`quantize_delayed`)."""
    scale_amax = jnp.max(history)
    if calibrates():
        scale_amax = jnp.where(cold(history), x_amax, scale_amax)
    return scale_amax


def cold(history):
    """Whether the amax `history` gives no delayed scale yet: its largest value is 0 (a fresh
    `Fp8.init_state`, or no amax recorded yet) or not finite."""
    largest = jnp.max(history)
    return ~(jnp.isfinite(largest) & (largest > 0))


def power_of_two_above(x):
    """The smallest power of two >= x (float32, x > 0): a bound rounded so that float32
    rounding in computing it cannot change the scale it gives."""
    return jnp.exp2(jnp.ceil(jnp.log2(x))).astype(jnp.float32)


def delayed_amax(history, bound):
    """The amax a GEMM-written tensor's delayed scale comes from: `history`'s largest, or,
    while it is `cold` (and the layers calibrate), `bound` (`result_bound`), an upper bound
    on this step's amax rounded up to a power of two: the FP8 values then fill less of the
    format, but nothing saturates and small values are kept (e5m2 gradients lose nothing
    a bound 64 times too large would matter to; e4m3 inputs keep 2**6 of range below it)."""
    largest = jnp.max(history)
    if not calibrates():
        return largest
    return jnp.where(cold(history), power_of_two_above(bound), largest)


def bound_terms(other, axis: int, bias=None) -> list:
    """The arrays whose amaxes `result_bound` takes, for a GEMM result R = A @ B (+ bias):
    B's values `other` summed in float32 along `axis` (its contracted one), and the bias.
    They depend on the weights alone, so their amaxes join the weights' (`reduced_amaxes`)."""
    terms = [jnp.sum(jnp.abs(other.astype(jnp.float32)), axis=axis)]
    return terms if bias is None else [*terms, bias]


def result_bound(operand_amax, term_amaxes):
    """An upper bound on |R| for a GEMM result R = A @ B (+ bias), from the amax of A's
    values (`operand_amax`) and the amaxes of `bound_terms`: |R| <= amax(A) · max_j sum_k
    |B[k, j]| + max |bias|."""
    bound = operand_amax * term_amaxes[0]
    return bound + term_amaxes[1] if len(term_amaxes) > 1 else bound


def quantize_scaled(x, dtype: str, margin: int, history=None, amax_axes=None, x_amax=None):
    """(x in FP8, its dequantization scale, amax(x)): delayed scaling from `history`, or
    current scaling without one: the amax (over `amax_axes`, `reduce_amax`) and the cast in
    one expression (XLA fuses the reduction with the producer of x or the cast's read of it),
    the amax the one the scale came from, so recording it in a state costs nothing. `x_amax`,
    where given, is x's amax already taken (`reduced_amaxes`, with others)."""
    if history is not None:
        return quantize_delayed(x, history, dtype, margin, amax_axes, x_amax)
    if x_amax is None:
        x_amax = reduced_amaxes([x], amax_axes)[0]
    return (*quantize(x, x_amax, dtype, margin), x_amax)


def quantize_tensor(x, dtype="float8_e4m3fn", *, margin: int = 0):
    """Per-tensor current scaling of `x`, as the layers do it (`Fp8(scaling="current")`):
    `(x8, scale)` with `x ≈ scale * x8` (x8 in `dtype`, scale a float32 scalar), the convention of
    `matmul(..., quantization_scales={"a": scale_a, "b": scale_b})`. The scale maps amax(x) to
    the format's largest value divided by `2**margin`; values are rounded and saturated.
    Public as `jax_epilog.quantize`."""
    if not isinstance(x, jax.Array | np.ndarray) or not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x: expected a floating-point array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    check_margin(margin)
    x8, scale, _ = quantize_scaled(x, fp8_format("dtype", dtype), margin)
    return x8, scale


def record(history, x_amax):
    """`history` with `x_amax` as its most recent entry (the oldest dropped)."""
    return jnp.concatenate([jnp.reshape(x_amax, (1,)).astype(history.dtype), history[:-1]])
