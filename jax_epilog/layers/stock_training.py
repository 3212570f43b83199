"""`fp8_training`: a whole stock Flax model trained in FP8 by one call, its code unchanged, as
Qwix intercepts a model: rules choose layers by module path, and each chosen `nn.Dense`,
`nn.DenseGeneral`, `nn.Einsum`, `nnx.Linear`, `nnx.LinearGeneral` or `nnx.Einsum` (or a
subclass that keeps its `__call__`) runs its product as `stock_fp8.fp8_dot_general`.

- NNX: a copy of the model (arrays shared) whose chosen layers hold the FP8 op of
  `layers.stock_flax` as their `dot_general` (`einsum_op` for `nnx.Einsum`), named by path.
  Any `Fp8` scaling works: under delayed scaling the ops hold their state in the model.
- Linen: a copy of the module whose `__call__` runs under `flax.linen.intercept_methods`: a
  chosen layer's call sees `jax.lax.dot_general` (and, for `nn.Einsum`, `jax.numpy.einsum`)
  replaced by the FP8 op for its duration, in this thread only. The parameter tree is the
  model's. A Linen layer cannot grow variables from outside its own code, so only current
  scaling (stateless) is taken.

Layers whose product is already custom (a `dot_general`, `dot_general_cls` or `einsum_op`
that is not JAX's own, Flax's FP8 ops included) are left as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_epilog.float8.recipe import Fp8, as_fp8
from jax_epilog.layers.stock_flax import NnxFp8DotGeneral, NnxFp8Einsum, fp8_einsum
from jax_epilog.layers.stock_fp8 import fp8_dot_general, initialising

#: The stock layers by how their product is reached: through the dot_general they hold, or
#: through `jnp.einsum`.
DOT_LAYERS = (nnx.Linear, nnx.LinearGeneral, linen.Dense, linen.DenseGeneral)
EINSUM_LAYERS = (nnx.Einsum, linen.Einsum)
#: `fp8_training`'s default recipe: current scaling, which keeps no state.
DEFAULT_FP8 = Fp8(scaling="current")


def _stock(module) -> Optional[type]:
    """The stock class `module` is (or subclasses without overriding `__call__`), else None."""
    own = getattr(type(module), "_jax_epilog_untrained", type(module))
    for cls in DOT_LAYERS + EINSUM_LAYERS:
        if issubclass(own, cls) and own.__call__ is cls.__call__:
            return cls
    return None


def _plain(module) -> bool:
    """Whether the layer's product is JAX's own (nothing custom to keep)."""
    if isinstance(module, EINSUM_LAYERS):
        return getattr(module, "einsum_op", _ORIGINAL_EINSUM) in (jnp.einsum, _ORIGINAL_EINSUM)
    cls_ = getattr(module, "dot_general_cls", None)
    dot = getattr(module, "dot_general", None)
    return cls_ is None and dot in (None, jax.lax.dot_general, _ORIGINAL_DOT_GENERAL)


def _as_rules(rules) -> tuple[str, ...]:
    """`rules` (None: every stock layer; a path regex; a sequence of them) as regexes."""
    if rules is None:
        return (".*",)
    names = (rules,) if isinstance(rules, str) else rules
    if not isinstance(names, Sequence) or not names or \
            not all(isinstance(r, str) for r in names):
        raise TypeError(f"rules: expected None, a module-path regex or a sequence of them "
                        f"(e.g. r\"blocks/.*/mlp/.*\"), got {rules!r}")
    for rule in names:
        try:
            re.compile(rule)
        except re.error as error:
            raise ValueError(f"rules: {rule!r} is not a regex ({error})") from None
    return tuple(names)


def _chosen(rules, path: str) -> bool:
    return any(re.fullmatch(rule, path) for rule in rules)


def _path(parts) -> str:
    return "/".join(str(p) for p in parts)


def fp8_training(model, *, rules=None, fp8: Any = None, strict: bool = False):
    """`model` (a Flax NNX or Linen module) with the chosen stock layers trained in FP8.

    Args:
      model: an `nnx.Module` (returned: a copy whose chosen layers run FP8; arrays shared) or
        a `linen.Module` (returned: a copy whose `init`/`apply` run the chosen layers in FP8,
        with the same parameter tree).
      rules: None (every stock layer), a regex matched in full against a layer's path (its
        names joined by "/": "blocks/0/mlp/up"; Linen: "Dense_0" for an unnamed layer), or
        a sequence of them (a layer matching any is chosen).
      fp8: the `jax_epilog.Fp8` recipe; default `Fp8(scaling="current")` (no state). Linen
        takes current scaling only. `Fp8(layers="all")` runs every chosen layer in FP8;
        "auto" keeps GEMMs too small to gain in 16 bits, with a warning naming each.
      strict: raise, naming the layer, where a chosen layer's product cannot run in FP8
        (its dtype), instead of warning and running it in 16/32 bits.
    """
    rules = _as_rules(rules)
    recipe = DEFAULT_FP8 if fp8 is None else as_fp8(fp8)
    if recipe is None or recipe.block:
        raise ValueError(f"fp8: expected jax_epilog.Fp8(...) with current or delayed scaling "
                         f"(or None for current scaling), got {fp8!r}")
    if isinstance(model, nnx.Module):
        return _nnx(model, rules, recipe, strict)
    if isinstance(model, linen.Module):
        if recipe.keeps_state:
            raise ValueError(f"fp8: a Linen model intercepted from outside keeps no state, so "
                             f"only Fp8(scaling=\"current\") applies, got {recipe!r}; for "
                             f"delayed scaling give each layer "
                             f"dot_general_cls=jax_epilog.linen.Fp8DotGeneral")
        return _linen(model, rules, recipe, strict)
    raise TypeError(f"model: expected a flax.nnx.Module or flax.linen.Module, got "
                    f"{type(model).__name__}")


# --- NNX --------------------------------------------------------------------------------------

_data = getattr(nnx, "data", lambda value: value)  # Flax >= 0.12 marks a static attribute's data


def _nnx(model, rules, recipe: Fp8, strict: bool):
    model = nnx.clone(model)
    for parts, module in nnx.iter_modules(model):
        path = _path(parts)
        if _stock(module) is None or not _plain(module) or not _chosen(rules, path):
            continue
        # The op is a module (it may hold state): data where the layer had a static function.
        if isinstance(module, EINSUM_LAYERS):
            module.einsum_op = _data(NnxFp8Einsum(fp8=recipe, strict=strict, name=path))
        else:
            module.dot_general = _data(NnxFp8DotGeneral(fp8=recipe, strict=strict, name=path))
            if hasattr(module, "dot_general_cls"):
                module.dot_general_cls = None
    return model


# --- Linen ------------------------------------------------------------------------------------

_ORIGINAL_DOT_GENERAL = jax.lax.dot_general
_ORIGINAL_EINSUM = jnp.einsum
_active = threading.local()  # .dot: this thread's FP8 dot_general while a chosen layer runs
_patch_lock = threading.Lock()
_patch_count = 0


@contextlib.contextmanager
def _inactive():
    """The FP8 op's own code (its checks, its 16-bit fallback) sees JAX's functions."""
    previous, _active.dot = getattr(_active, "dot", None), None
    try:
        yield previous
    finally:
        _active.dot = previous


def _dot_general(*args, **kwargs):
    with _inactive() as dot:
        return (dot or _ORIGINAL_DOT_GENERAL)(*args, **kwargs)


def _einsum_op(*args, **kwargs):
    with _inactive() as dot:
        if dot is None or "_dot_general" in kwargs or len(args) != 3:
            return _ORIGINAL_EINSUM(*args, **kwargs)
        return fp8_einsum(dot, *args, **kwargs)


@contextlib.contextmanager
def _running(dot):
    """Within it, in this thread, `jax.lax.dot_general` and `jnp.einsum` run `dot`; the
    functions are swapped for dispatchers while any thread is in such a block."""
    global _patch_count
    with _patch_lock:
        if _patch_count == 0:
            jax.lax.dot_general, jnp.einsum = _dot_general, _einsum_op
        _patch_count += 1
    previous, _active.dot = getattr(_active, "dot", None), dot
    try:
        yield
    finally:
        _active.dot = previous
        with _patch_lock:
            _patch_count -= 1
            if _patch_count == 0:
                jax.lax.dot_general, jnp.einsum = _ORIGINAL_DOT_GENERAL, _ORIGINAL_EINSUM


def _interceptor(rules, recipe: Fp8, strict: bool):
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        path = _path(module.path)
        if context.method_name != "__call__" or _stock(module) is None or \
                not _plain(module) or not _chosen(rules, path):
            return next_fun(*args, **kwargs)
        dot = functools.partial(fp8_dot_general, fp8=recipe, strict=strict, name=path)
        token = initialising.set(module.is_initializing())
        try:
            with _running(dot):
                return next_fun(*args, **kwargs)
        finally:
            initialising.reset(token)
    return intercept


def _linen(model: linen.Module, rules, recipe: Fp8, strict: bool):
    """A copy of `model` of a subclass whose `__call__` runs under the interceptor (Linen's
    `apply` runs a clone of the module, so the class must carry it)."""
    cls = getattr(type(model), "_jax_epilog_untrained", type(model))
    intercept = _interceptor(rules, recipe, strict)

    def __call__(self, *args, **kwargs):
        with linen.intercept_methods(intercept):
            return super(trained, self).__call__(*args, **kwargs)

    trained = type(cls.__name__, (cls,), {"__call__": __call__, "_jax_epilog_untrained": cls,
                                          "__module__": cls.__module__,
                                          "__doc__": f"`{cls.__qualname__}` trained in FP8 "
                                                     "(jax_epilog fp8_training)."})
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.init and f.name != "parent"}
    return trained(**fields)
