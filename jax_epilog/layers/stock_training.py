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

A chosen layer with a bias is taken whole (`fused_forward`): the interception runs at its
`__call__`, so the bias goes into the FP8 GEMM's epilog and its gradient is taken with the
output gradient's amax, as this package's own FP8 layers do (`fp8_dot_general(bias=)`), where
the layer's `dot_general` alone would leave the add to XLA on the GEMM's rounded result. NNX:
such a layer's class becomes a subclass of its own (`TrainedLinear` is an `nnx.Linear`; the
attributes and state paths stay). A layer the whole-layer route cannot take (a custom
`promote_dtype`, `preferred_element_type`, batch dims, an einsum string given at call time)
runs its own `__call__` with the FP8 op, the bias added after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
import threading
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_epilog.float8.recipe import Fp8, as_fp8
from jax_epilog.layers import stock_layers
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
    own = stock_layers.stock_class(type(module))
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


# --- a layer with its bias, whole ------------------------------------------------------------

def _kind(module) -> str:
    return "einsum" if isinstance(module, EINSUM_LAYERS) else \
        "general" if isinstance(module, (nnx.LinearGeneral, linen.DenseGeneral)) else "dense"


def whole_layer(module, kernel, bias, einsum_str: Optional[str] = None) -> bool:
    """Whether the chosen layer is run whole by `fused_forward` (its bias in the GEMM's
    epilog): it has a bias, Flax's own dtype promotion and result dtype, and its kernel is one
    GEMM's `(K, N)` (no batch dims; an einsum's string known when built, as called), or a
    stack of such kernels along leading dims (`nnx.vmap`-built layers, which a lifted
    transform hands one at a time)."""
    if bias is None or getattr(module, "preferred_element_type", None) is not None:
        return False
    promote = getattr(module, "promote_dtype", None)
    if promote is not None and not getattr(promote, "__module__", "").startswith("flax."):
        return False
    kind = _kind(module)
    try:
        if kind == "einsum":
            stock_layers.einsum_string(module, einsum_str)
        lead = stock_layers.stacked_dims(module, kind, kernel)
        layout = stock_layers.layout(module, kind, jnp.shape(kernel)[lead:])
    except stock_layers.Unsupported:
        return False
    return layout.n * math.prod(jnp.shape(kernel)[:lead]) == jnp.size(bias)


def fused_forward(module, inputs, kernel, bias, product, einsum_str: Optional[str] = None):
    """The stock layer's output for `inputs` (`whole_layer`): `inputs` and `kernel` as the
    GEMM's `(rows, K)` and `(K, N)` (transposes XLA fuses into the quantizing casts), then
    one `product` (`fp8_dot_general`, its recipe bound) with the bias in its epilog."""
    inputs = jnp.asarray(inputs)
    dtype = module.dtype or jnp.result_type(inputs, kernel, bias)  # Flax's promote_dtype
    kind = _kind(module)
    geo = stock_layers.geometry(module, kind, inputs.shape, einsum_str)
    layout = stock_layers.layout(module, kind, jnp.shape(kernel))
    if geo.k != layout.k or geo.n != layout.n or jnp.size(bias) != layout.n:
        return None  # the layer's own call (Flax's errors for wrong shapes)
    matrix = jnp.transpose(jnp.asarray(kernel, dtype), layout.contracting + layout.kept)
    y = product(geo.rows(inputs.astype(dtype)), matrix.reshape(layout.k, layout.n),
                (((1,), (0,)), ((), ())), bias=jnp.asarray(bias, dtype).reshape(-1))
    return geo.output(y)


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
        bias = None if module.bias is None else module.bias[...]
        if whole_layer(module, module.kernel[...], bias):
            module.__class__ = trained_nnx_class(type(module))
    return model


def _trained_nnx_call(self, inputs, *args, **kwargs):
    """A trained layer's `__call__`: the stock signature; the layer whole (`fused_forward`)
    where it can be, else its own `__call__` with the FP8 op."""
    untrained = type(self)._jax_epilog_untrained.__call__
    einsum = isinstance(self, EINSUM_LAYERS)
    names = ("einsum_str", "out_sharding") if einsum else ("out_sharding",)
    given = dict(zip(names, args), **kwargs)
    op = self.einsum_op if einsum else self.dot_general
    kernel, bias = self.kernel[...], None if self.bias is None else self.bias[...]
    if len(args) > len(names) or set(given) - set(names) or \
            given.get("out_sharding") is not None or not isinstance(op, NnxFp8DotGeneral) or \
            not whole_layer(self, kernel, bias, given.get("einsum_str")):
        return untrained(self, inputs, *args, **kwargs)
    y = fused_forward(self, inputs, kernel, bias, op.product(), given.get("einsum_str"))
    return untrained(self, inputs, *args, **kwargs) if y is None else y


@functools.cache
def trained_nnx_class(cls: type) -> type:
    """`cls`'s trained subclass (one per class, so graph definitions compare equal)."""
    return type(f"Trained{cls.__name__}", (cls,), {
        "__call__": _trained_nnx_call, "_jax_epilog_untrained": cls, "__module__": __name__,
        "__doc__": f"`{cls.__qualname__}` trained in FP8 with its bias in the GEMM's "
                   "epilog (jax_epilog fp8_training)."})


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
        if not module.is_initializing():
            y = _linen_whole(module, dot, args, kwargs)
            if y is not None:
                return y
        token = initialising.set(module.is_initializing())
        try:
            with _running(dot):
                return next_fun(*args, **kwargs)
        finally:
            initialising.reset(token)
    return intercept


def _linen_whole(module, dot, args, kwargs):
    """A chosen Linen layer's output by `fused_forward`, or None where it is not run whole."""
    names = ("inputs", "einsum_str") if isinstance(module, linen.Einsum) else ("inputs",)
    given = dict(zip(names, args), **kwargs)
    if len(args) > len(names) or set(given) - set(names) or "inputs" not in given or \
            not (module.has_variable("params", "kernel") and
                 module.has_variable("params", "bias")):
        return None
    kernel = stock_layers.kernel_value(module.get_variable("params", "kernel"))
    bias = stock_layers.kernel_value(module.get_variable("params", "bias"))
    if not whole_layer(module, kernel, bias, given.get("einsum_str")):
        return None
    return fused_forward(module, given["inputs"], kernel, bias, dot, given.get("einsum_str"))


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
