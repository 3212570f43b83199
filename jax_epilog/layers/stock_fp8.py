"""FP8 training for stock Flax layers: `fp8_dot_general`, a drop-in for `jax.lax.dot_general`
that runs the product as this package's FP8 GEMM (`op.matmul.matmul` with e4m3 operands, the
backward's two GEMMs with e5m2 gradients), which the Flax ops of `layers.stock_flax` wrap as a
Linen `dot_general_cls` and an NNX `dot_general` / `einsum_op`.

Any valid `dot_general` is taken: the operands are transposed and reshaped to the GEMM's
`(B, M, K) @ (B, K, N)` (batch dims first, then the free dims, the contracting dims in the order
the dimension numbers pair them; no batch dims is the rank-2 GEMM, so `nn.Dense` on `(..., K)`
folds every leading dim into M), and the result back to `dot_general`'s order (batch, lhs free,
rhs free). XLA fuses those transposes into the quantizing casts, which read the 16-bit tensors
anyway. Where the FP8 GEMM cannot or should not run (`fallback_reason`: an operand or result
dtype it has no kernel for, a zero-sized dim, or a GEMM too small to pay for its quantization
under `Fp8(layers="auto")`), the product runs as `jax.lax.dot_general` in the operands' dtype,
with one `Fp8FallbackWarning` per layer and reason, or a `ValueError` under `strict=True`.

Scaling is the recipe's (`jax_epilog.Fp8`): "current" (every scale from its tensor's own amax,
no state) or "delayed" ("auto" with a state), Flax's `fp8_ops` recipe with Flax's state: three
amax histories (the input's, the kernel's, the output gradient's) and three scales, whose
gradients are their next values (the "overwrite with gradient" convention), so a training loop
written for `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` runs unchanged. Each tensor's scale
comes from the largest amax of its history (earlier steps) and its own amax is recorded for the
next step (`scaling.quantize_delayed`); a cold history (all zeros, a fresh state) calibrates
from this step's amax where Flax's op would use scale 1 (`scaling.uncalibrated` restores
Flax's start). The scales in the state are written, each the one its tensor used this step, so
the state reads as Flax's; the next scales come from the histories alone.
"""

from __future__ import annotations

import contextvars
import functools
import math
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.float8.recipe import Fp8, as_fp8
from jax_epilog.float8.scaling import quantize_scaled
from jax_epilog.layers.fp8_step import carry_state, matmul8
from jax_epilog.op.epilogs import Epilog
from jax_epilog.planning.stack_plan import fp8_gemm_backend, fp8_pays_why
from jax_epilog.runtime import settings

#: Flax's names for an FP8 op's state (`flax.linen.fp8_ops.Fp8DotGeneralBase`): amax histories
#: of shape `(amax_history_length,)` and scales of shape `(1,)`, all float32.
HISTORY_NAMES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history")
SCALE_NAMES = ("input_scale", "kernel_scale", "output_grad_scale")
STATE_NAMES = HISTORY_NAMES + SCALE_NAMES
#: The dtypes the FP8 GEMM reads (operands) and writes (results).
COMPUTE_DTYPES = ("float16", "bfloat16", "float32")
ZERO_SIZED = "a zero-sized dimension (nothing to compute)"


class Fp8FallbackWarning(UserWarning):
    """A dot product the FP8 ops ran in 16/32 bits (`jax.lax.dot_general`) instead of FP8;
    the message names the layer, the shapes and why. Filter it with `warnings.filterwarnings`
    where that is expected."""


def init_state(length: int) -> dict:
    """A fresh delayed-scaling state, as Flax's FP8 ops initialise theirs: zero histories of
    `length`, unit scales."""
    histories = {n: jnp.zeros((length,), jnp.float32) for n in HISTORY_NAMES}
    return {**histories, **{n: jnp.ones((1,), jnp.float32) for n in SCALE_NAMES}}


def check_state(state, where: str) -> Optional[dict]:
    """`state` (None, or a mapping with `STATE_NAMES`) as a dict, its shapes checked."""
    if state is None:
        return None
    if not hasattr(state, "keys") or set(state.keys()) != set(STATE_NAMES):
        raise ValueError(f"{where}: expected the FP8 state {STATE_NAMES} (init_state makes "
                         f"one), got {sorted(state) if hasattr(state, 'keys') else state!r}")
    for name in STATE_NAMES:
        shape, dtype = jnp.shape(state[name]), jnp.result_type(state[name])
        wanted = "(1,)" if name in SCALE_NAMES else "(length,)"
        if len(shape) != 1 or shape[0] < 1 or (name in SCALE_NAMES and shape != (1,)) or \
                dtype != jnp.float32:
            raise ValueError(f"{where}.{name}: expected float32 of shape {wanted}, got "
                             f"{dtype} {shape}")
    return dict(state)


class Gemm(NamedTuple):
    """How a `dot_general` maps onto the GEMM: operand permutations and the GEMM's sizes."""

    lhs_perm: tuple
    rhs_perm: tuple
    batch: int  # B, or 0 for no batch dims (the rank-2 GEMM)
    m: int
    k: int
    n: int
    out_shape: tuple
    n_shape: tuple = ()  # rhs's free dims (N's)


def gemm_of(lhs_shape, rhs_shape, dimension_numbers) -> Gemm:
    """The GEMM of a valid `dot_general` of these shapes (checked by the caller)."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) % len(s) for d in dims) for dims, s in
                      ((lc, lhs_shape), (rc, rhs_shape), (lb, lhs_shape), (rb, rhs_shape)))
    lfree = tuple(d for d in range(len(lhs_shape)) if d not in lc + lb)
    rfree = tuple(d for d in range(len(rhs_shape)) if d not in rc + rb)
    size = lambda shape, dims: math.prod(shape[d] for d in dims)
    batch_shape = tuple(lhs_shape[d] for d in lb)
    out_shape = batch_shape + tuple(lhs_shape[d] for d in lfree) + \
        tuple(rhs_shape[d] for d in rfree)
    return Gemm(lb + lfree + lc, rb + rc + rfree, size(lhs_shape, lb) if lb else 0,
                size(lhs_shape, lfree), size(lhs_shape, lc), size(rhs_shape, rfree), out_shape,
                tuple(rhs_shape[d] for d in rfree))


def fallback_reason(gemm: Gemm, dtype, out_dtype, fp8: Fp8) -> tuple[Optional[str], bool]:
    """(why the product runs 16/32-bit instead of FP8, or None; whether that is a choice of
    `Fp8(layers="auto")` rather than something the FP8 GEMM cannot take)."""
    for what, d in (("operands", dtype), ("result", out_dtype)):
        if jnp.dtype(d).name not in COMPUTE_DTYPES:
            return (f"the {what} are {jnp.dtype(d).name}; the FP8 GEMM reads and writes "
                    f"{', '.join(COMPUTE_DTYPES)}"), False
    if 0 in (gemm.m, gemm.k, gemm.n, gemm.batch if gemm.batch else 1):
        return ZERO_SIZED, False
    if fp8.layers == "auto":
        choice = fp8_pays_why(max(gemm.batch, 1) * gemm.m, gemm.k, gemm.n)
        if choice.choice != "fp8":
            return (f'Fp8(layers="auto"): {choice.why} (Fp8(layers="all") runs it in FP8 '
                    f"anyway)"), True
    return None, False


_warned: set = set()
#: Set while a Linen model is initialised (`stock_flax`): its sample inputs (often one row)
#: say nothing of the shapes it trains on, so the "auto" rule's choices there are not warned of.
initialising = contextvars.ContextVar("jax_epilog_stock_fp8_initialising", default=False)


def _fall_back(reason: str, chosen: bool, name: str, strict: bool) -> None:
    if chosen and initialising.get():
        return
    if strict and not chosen:
        raise ValueError(f"{name}: cannot run in FP8 ({reason}); strict=True asked for FP8, so "
                         f"this is an error: change the layer's dtype, or drop strict=True to "
                         f"run it unquantized, in its own dtype, with a warning")
    if (name, reason) not in _warned:
        _warned.add((name, reason))
        warnings.warn(f"{name} runs jax.lax.dot_general in its operands' dtype, not as an FP8 "
                      f"GEMM: {reason}",
                      Fp8FallbackWarning, stacklevel=4)


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    *, fp8: Any = True, state=None, strict: bool = False,
                    name: Optional[str] = None, out_sharding=None, bias=None):
    """`jax.lax.dot_general(lhs, rhs, dimension_numbers)` (`+ bias`) as an FP8 GEMM (module
    docstring).

    Args:
      lhs, rhs, dimension_numbers, preferred_element_type, out_sharding: as
        `jax.lax.dot_general`'s. The operands are cast to their common dtype (the compute
        dtype); the result has `preferred_element_type` or that dtype.
      precision: ignored, as Flax's FP8 ops ignore it: FP8 GEMMs accumulate in float32
        (`Fp8.fast_accumulation` chooses where not).
      fp8: True (`Fp8()`) or a `jax_epilog.Fp8`: formats, margin, which GEMMs run FP8
        (`layers`), fast accumulation, amax reduction axes. "block" scaling is refused.
      state: None (current scaling; with `Fp8(scaling="delayed")` an error) or the delayed
        state, a dict of `STATE_NAMES` (`init_state`); its gradient is its next value.
      strict: raise where the product cannot run in FP8 instead of warning.
      name: the layer's name, for warnings and errors.
      bias: None, or an array of rhs's free dims' shape (or flattened, their product) added
        to the result: in the FP8 GEMM's epilog where it has no batch dims (the bias rounded
        once with the product, its gradient a sum of the output gradient taken with the
        gradient's amax, as this package's FP8 layers do), else after it.
    """
    where = name or "fp8_dot_general"
    recipe = as_fp8(fp8)
    if recipe is None or recipe.block:
        raise ValueError(f"{where}: fp8: expected True or jax_epilog.Fp8(...) with current or "
                         f"delayed scaling, got {fp8!r}")
    state = check_state(state, f"{where}: state")
    recipe = recipe.resolved(state is not None)
    if recipe.delayed and state is None:
        raise ValueError(f'{where}: state: Fp8(scaling="delayed") needs the FP8 state '
                         f"(init_state(length)); pass it, or use scaling=\"current\"")
    if not recipe.delayed and state is not None:  # handed back unchanged as its gradient
        return carry_state(fp8_dot_general(lhs, rhs, dimension_numbers, precision,
                                           preferred_element_type, fp8=recipe, strict=strict,
                                           name=name, out_sharding=out_sharding, bias=bias),
                           state)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    shaped = functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers,
                               preferred_element_type=preferred_element_type)
    out = jax.eval_shape(shaped, lhs, rhs)  # lax's own errors for invalid dimension numbers
    dtype = jnp.result_type(lhs, rhs)
    gemm = gemm_of(lhs.shape, rhs.shape, dimension_numbers)
    bias = _checked_bias(bias, gemm, where)
    reason, chosen = fallback_reason(gemm, dtype, out.dtype, recipe)
    if reason is not None:
        if reason != ZERO_SIZED:
            _fall_back(reason, chosen, f"{where} ({lhs.dtype}{list(lhs.shape)} x "
                                       f"{rhs.dtype}{list(rhs.shape)})", strict)
        y = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                preferred_element_type=preferred_element_type,
                                out_sharding=out_sharding)
        y = y if bias is None else y + bias
        return y if state is None else carry_state(y, state)
    a = jnp.transpose(lhs.astype(dtype), gemm.lhs_perm)
    b = jnp.transpose(rhs.astype(dtype), gemm.rhs_perm)
    lead = (gemm.batch,) if gemm.batch else ()
    fused = None if bias is None or gemm.batch else bias.reshape(gemm.n).astype(out.dtype)
    y = _fp8_gemm(_Config(recipe, dtype.name, out.dtype.name), a.reshape(*lead, gemm.m, gemm.k),
                  b.reshape(*lead, gemm.k, gemm.n), fused, state)
    y = y.reshape(gemm.out_shape)
    if bias is not None and fused is None:  # a batched GEMM: no bias epilog
        y = y + bias
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


def _checked_bias(bias, gemm: Gemm, where: str):
    """`bias` (rhs's free dims' shape, or flattened) in that shape, or None."""
    if bias is None:
        return None
    bias = jnp.asarray(bias)
    if bias.shape not in ((gemm.n,), gemm.n_shape):
        raise ValueError(f"{where}: bias: expected shape {gemm.n_shape} or ({gemm.n},) (rhs's "
                         f"free dims), got {bias.shape}")
    return bias.reshape(gemm.n_shape)


# --- the GEMM and its FP8 backward ------------------------------------------------------------

class _Config(NamedTuple):
    fp8: Fp8
    dtype: str  # the operands' (and their gradients')
    out_dtype: str


def _history(state, name):
    return None if state is None else state[name]


def _t(x):
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_gemm(config: _Config, a, b, bias, state):
    return _fp8_gemm_fwd(config, a, b, bias, state)[0]


def _fp8_gemm_fwd(config: _Config, a, b, bias, state):
    fp8 = config.fp8
    axes = fp8.amax_reduction_axes
    a8, sa, a_amax = quantize_scaled(a, fp8.forward, fp8.margin,
                                     _history(state, "input_amax_history"), axes)
    b8, sb, b_amax = quantize_scaled(b, fp8.forward, fp8.margin,
                                     _history(state, "kernel_amax_history"), axes)
    if bias is None:
        y, _ = matmul8(a8, sa, b8, sb, config.out_dtype, "auto", fp8.fast("forward"))
    else:  # the bias in the GEMM's epilog, as the FP8 layers' forward GEMM takes theirs
        backend = fp8_gemm_backend("auto", Epilog.BIAS, config.out_dtype,
                                   settings.backend_override).choice
        y, _ = matmul8(a8, sa, b8, sb, config.out_dtype, backend, fp8.fast("forward"),
                       epilog=Epilog.BIAS, inputs={"bias": bias})
    return y, (a8, sa, a_amax, b8, sb, b_amax, bias, state)  # the bias: (N,), or None


def _fp8_gemm_bwd(config: _Config, saved, dy):
    a8, sa, a_amax, b8, sb, b_amax, bias, state = saved
    fp8, dtype = config.fp8, config.dtype
    # FP8 GEMMs have no BGRADB: the bias gradient is a sum of dY, which XLA fuses with dY's
    # amax below (both read dY once), as in the FP8 layers' backward.
    dbias = jnp.sum(dy, axis=0, dtype=jnp.float32).astype(bias.dtype) \
        if bias is not None else None
    g8, sg, g_amax = quantize_scaled(dy, fp8.gradient, fp8.margin,
                                     _history(state, "output_grad_amax_history"),
                                     fp8.amax_reduction_axes)
    # dA = dY8 B8ᵀ (e5m2 × e4m3); dB = A8ᵀ dY8 from K-major copies, as the layers' step makes it.
    da, _ = matmul8(g8, sg, b8, sb, dtype, "auto", fp8.fast("data gradient"), transpose_b=True)
    db, _ = matmul8(_t(a8), sa, _t(g8), sg, dtype, "auto", fp8.fast("weight gradient"),
                     transpose_b=True)
    return da, db, dbias, _next_state(state, (a_amax, b_amax, g_amax), (sa, sb, sg))


def _next_state(state, amaxes, scales):
    """The state's cotangent, its next value: each history with this step's amax recorded,
    each scale the one its tensor used."""
    if state is None:
        return None
    nxt = {h: _record(state[h], amax) for h, amax in zip(HISTORY_NAMES, amaxes)}
    nxt.update({s: jnp.reshape(scale, (1,)).astype(jnp.float32)
                for s, scale in zip(SCALE_NAMES, scales)})
    return nxt


def _record(history, amax):
    """`history` with `amax` recorded as Flax's `fp8_ops.compute_amax_history` records it
    (roll by one, then the newest at 0), so that the state is the one Flax's op would hold and
    a checkpoint moves between the two; the window of amaxes is the same as
    `scaling.record`'s, in another order."""
    return jnp.roll(history, -1).at[0].set(jnp.reshape(amax, ()).astype(history.dtype))


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd)
