"""FP8 for stock Flax layers by one keyword: `Fp8DotGeneral` and `Fp8Einsum`, for Linen
(`nn.Dense(..., dot_general_cls=jax_epilog.linen.Fp8DotGeneral)`, in place of Flax's
`fp8_ops.Fp8DirectDotGeneralOp`; `nn.DenseGeneral` likewise) and NNX
(`nnx.Linear(..., dot_general=jax_epilog.nnx.Fp8DotGeneral())`, `nnx.LinearGeneral` likewise,
`nnx.Einsum(..., einsum_op=jax_epilog.nnx.Fp8Einsum())`). Each runs `stock_fp8.fp8_dot_general`,
this package's FP8 GEMM; which scaling, formats and fallbacks: that module.

State, delayed scaling (`fp8=True`, "auto" scaling): the six variables of Flax's FP8 ops, under
Flax's names and shapes (`stock_fp8.STATE_NAMES`), in Linen's `"_overwrite_with_gradient"`
collection, whose gradients are the variables' next values
(`flax.training.train_state.TrainState.apply_gradients` writes them), and in NNX as the
Variable type Flax's Linen-to-NNX bridge gives that collection (`OverwriteWithGradient`).
`Fp8(scaling="current")` keeps no state.

Flax is an optional dependency (`pip install ".[flax]"`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax.numpy as jnp

from jax_epilog.runtime.library import install_hint as _install_hint

try:
    from flax import linen, nnx
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
except ImportError as error:
    raise ImportError(f"jax_epilog's Flax FP8 ops need Flax: {_install_hint('flax')}") \
        from error

from jax_epilog.float8.recipe import as_fp8
from jax_epilog.layers import stock_fp8
from jax_epilog.layers.stock_fp8 import STATE_NAMES, fp8_dot_general, init_state

#: NNX's Variable type of Flax's "overwrite with gradient" collection (the one Flax's
#: Linen-to-NNX bridge gives a bridged `fp8_ops` op's state): not parameters; their
#: gradients are their next values (`overwrite_with_gradient` writes them into the model).
OverwriteWithGradient = nnx.variable_type_from_name(OVERWRITE_WITH_GRADIENT,
                                                    allow_register=True)


def _recipe(fp8, history_length: Optional[int], where: str):
    """The op's `Fp8`, its amax history length overridden where given."""
    recipe = as_fp8(fp8)
    if recipe is None or recipe.block:
        raise ValueError(f"{where}: fp8: expected True or jax_epilog.Fp8(...) with current or "
                         f"delayed scaling (block scaling has no dot_general op), got {fp8!r}")
    if history_length is not None:
        recipe = dataclasses.replace(recipe, amax_history_length=history_length)
    return recipe


def fp8_einsum(dot, eqn, lhs, rhs, precision=None, preferred_element_type=None,
               out_sharding=None):
    """`jnp.einsum` of two operands with its products run by `dot` (a dot_general)."""
    return jnp.einsum(eqn, lhs, rhs, precision=precision,
                      preferred_element_type=preferred_element_type,
                      out_sharding=out_sharding, _dot_general=dot)


# --- Linen ------------------------------------------------------------------------------------

class Fp8DotGeneral(linen.Module):
    """A Linen `dot_general_cls` running this package's FP8 GEMMs; a drop-in for
    `flax.linen.fp8_ops.Fp8DirectDotGeneralOp` (same state, same training loop).

    Attributes:
      fp8: True or a `jax_epilog.Fp8` (`jax_epilog.Fp8(layers="all")` runs every shape in FP8
        as Flax's op does; the default "auto" keeps a GEMM too small to gain in 16 bits, with
        a warning). `Fp8(scaling="current")` keeps no state.
      amax_history_length: the histories' length (default: the recipe's, 1024 as Flax's).
      strict: raise where a product cannot run in FP8 (its dtype) instead of warning.
    Applied without the `"_overwrite_with_gradient"` collection, "auto" scaling runs current
    scaling (and `Fp8(scaling="delayed")` raises).
    """

    fp8: Any = True
    amax_history_length: Optional[int] = None
    strict: bool = False

    def _fp8_state(self) -> Optional[dict]:
        recipe = _recipe(self.fp8, self.amax_history_length, self._where())
        if not recipe.keeps_state or not (self.is_initializing() or all(
                self.has_variable(OVERWRITE_WITH_GRADIENT, n) for n in STATE_NAMES)):
            return None
        fresh = init_state(recipe.amax_history_length)
        return {n: self.variable(OVERWRITE_WITH_GRADIENT, n, lambda v=fresh[n]: v).value
                for n in STATE_NAMES}

    def _where(self) -> str:
        return "/".join(self.path) or type(self).__name__

    def _dot(self, state, lhs, rhs, dimension_numbers, precision=None,
             preferred_element_type=None, out_sharding=None):
        recipe = _recipe(self.fp8, self.amax_history_length, self._where())
        token = stock_fp8.initialising.set(self.is_initializing())
        try:
            return fp8_dot_general(lhs, rhs, dimension_numbers, precision,
                                   preferred_element_type, fp8=recipe, state=state,
                                   strict=self.strict, name=self._where(),
                                   out_sharding=out_sharding)
        finally:
            stock_fp8.initialising.reset(token)

    @linen.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return self._dot(self._fp8_state(), lhs, rhs, dimension_numbers, precision,
                         preferred_element_type, out_sharding)


class Fp8Einsum(Fp8DotGeneral):
    """`jnp.einsum(eqn, lhs, rhs)` of two operands with the product run by `Fp8DotGeneral`;
    a drop-in for `flax.linen.fp8_ops.Fp8Einsum` (called `(eqn, lhs, rhs, precision=,
    preferred_element_type=)`). Flax's `nn.Einsum` takes no einsum op: its layers are
    reached by `jax_epilog.linen.fp8_training` instead."""

    @linen.compact
    def __call__(self, eqn, lhs, rhs, precision=None, preferred_element_type=None,
                 out_sharding=None):
        dot = functools.partial(self._dot, self._fp8_state())
        return fp8_einsum(dot, eqn, lhs, rhs, precision, preferred_element_type, out_sharding)


# --- NNX --------------------------------------------------------------------------------------

class NnxFp8DotGeneral(nnx.Module):
    """An NNX `dot_general` running this package's FP8 GEMMs: pass an instance,
    `nnx.Linear(..., dot_general=jax_epilog.nnx.Fp8DotGeneral())` (or to `nnx.LinearGeneral`),
    and the layer holds its state. Public as `jax_epilog.nnx.Fp8DotGeneral`.

    Args:
      fp8, amax_history_length, strict: as for the Linen op (`jax_epilog.linen.Fp8DotGeneral`).
      name: the layer's name in warnings and errors.
    Under delayed scaling (`fp8=True`'s "auto") the op holds Flax's six FP8 variables as
    `OverwriteWithGradient`; take gradients w.r.t. them too and write those into the model
    (`overwrite_with_gradient`), never through the optimizer. As a `dot_general_cls` (made
    anew at every call) only `Fp8(scaling="current")` makes sense: a new state every call would
    calibrate from each step's own amaxes.
    """

    public_name = "jax_epilog.nnx.Fp8DotGeneral"  # warnings' name for an unnamed op

    def __init__(self, *, fp8: Any = True, amax_history_length: Optional[int] = None,
                 strict: bool = False, name: Optional[str] = None):
        self.fp8 = _recipe(fp8, amax_history_length, name or type(self).__name__)
        self.strict = strict
        self.name = name  # None: warnings and errors name the op and the shapes
        if self.fp8.keeps_state:
            for key, value in init_state(self.fp8.amax_history_length).items():
                setattr(self, key, OverwriteWithGradient(value))

    def _fp8_state(self) -> Optional[dict]:
        return {n: getattr(self, n)[...] for n in STATE_NAMES} if self.fp8.keeps_state \
            else None

    def product(self):
        """`fp8_dot_general` with this op's recipe, state, strictness and name bound."""
        return functools.partial(fp8_dot_general, fp8=self.fp8, state=self._fp8_state(),
                                 strict=self.strict, name=self.name or self.public_name)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return self.product()(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                              out_sharding=out_sharding)


class NnxFp8Einsum(NnxFp8DotGeneral):
    """An NNX `einsum_op`: `nnx.Einsum(..., einsum_op=jax_epilog.nnx.Fp8Einsum())` runs the
    layer's einsum with its product as `jax_epilog.nnx.Fp8DotGeneral`. Public as
    `jax_epilog.nnx.Fp8Einsum`."""

    public_name = "jax_epilog.nnx.Fp8Einsum"

    def __call__(self, eqn, lhs, rhs, precision=None, preferred_element_type=None,
                 out_sharding=None):
        return fp8_einsum(self.product(), eqn, lhs, rhs, precision, preferred_element_type,
                          out_sharding)


def overwrite_with_gradient(model: nnx.Module, grads) -> None:
    """Writes the `OverwriteWithGradient` part of `grads` (gradients of `model` taken w.r.t.
    those variables too, e.g. `nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param,
    OverwriteWithGradient)))`) into `model`: each FP8 variable's gradient is its next value."""
    nnx.update(model, nnx.filter_state(grads, OverwriteWithGradient))
