"""Flax NNX modules: `Dense` and `MLP`, drop-in for `nnx.Linear` followed by an activation,
and `SwiGLU`, the Llama-style MLP block.

The parameters are the stock ones: `kernel` `(in_features, out_features)` and `bias`
`(out_features,)`, made by the same initialisers from the same RNG stream in the same order, so
`Dense(..., rngs=nnx.Rngs(0))` starts from exactly the weights `nnx.Linear(..., rngs=nnx.Rngs(0))`
would, and the state of either loads into the other. `MLP` keeps its layers in `layers`, the
state tree of a list of `nnx.Linear` (`layers/0/kernel`, ...), and runs the whole stack as one
`jax_epilog.mlp` call so the backward can fuse across layers.

Flax is an optional dependency: `pip install ".[flax]"` in a checkout
(`pip install "jax-epilog[flax]"` from a package index).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Optional

import jax.numpy as jnp

from jax_epilog.runtime.library import install_hint as _install_hint

try:
    from flax import nnx
    from flax.linen.dtypes import promote_dtype
except ImportError as error:
    raise ImportError(f"jax_epilog.nnx needs Flax: {_install_hint('flax')}") from error

from jax_epilog.float8.recipe import Fp8History, as_fp8
from jax_epilog.float8.weights import Fp8Weight
from jax_epilog.layers.serving import promote
from jax_epilog.layers.functional import activation_name, dense, mlp
from jax_epilog.layers.swiglu import FP8_GEMMS, swiglu

# Flax >= 0.12 wants lists of modules wrapped so it can see their state; older Flax takes lists.
_ModuleList = getattr(nnx, "List", list)


class AmaxHistory(nnx.Variable):
    """An FP8 layer's amax history (delayed scaling, `fp8=True`'s): state, not a
    parameter. Its gradient is its next value (Flax's "overwrite with gradient"): take
    gradients w.r.t. it too and write them into the model (`update_amax_histories`), never
    through the optimizer."""


def update_amax_histories(model: nnx.Module, grads) -> None:
    """Writes the `AmaxHistory` part of `grads` (gradients of `model` taken w.r.t.
    `AmaxHistory` variables, e.g. `nnx.grad(..., argnums=nnx.DiffState(0, nnx.Any(nnx.Param,
    AmaxHistory)))`) into `model`: each history's gradient is its next value."""
    nnx.update(model, nnx.filter_state(grads, AmaxHistory) if hasattr(nnx, "filter_state")
               else grads.filter(AmaxHistory))


def _amax_histories(fp8) -> tuple[Optional[AmaxHistory], Optional[AmaxHistory]]:
    """A layer's (input, gradient) `AmaxHistory` variables where the recipe keeps state
    (`Fp8.keeps_state`: not current or block scaling), else None."""
    if fp8 is None or not fp8.keeps_state:
        return None, None
    state = fp8.init_state(1)[0]
    return AmaxHistory(state.input), AmaxHistory(state.gradient)


def _check_in_features(inputs, in_features: int, module: str):
    shape = jnp.shape(inputs)
    if not shape or shape[-1] != in_features:
        raise ValueError(f"x has {shape[-1] if shape else 'no'} features; this {module} was "
                         f"built with in_features={in_features}")


class Dense(nnx.Module):
    """`activation(inputs @ kernel + bias)` in one fused kernel; arguments as `nnx.Linear`'s.

    Args:
      in_features, out_features: the kernel is `(in_features, out_features)`.
      activation: None, "relu" or "gelu" (tanh approximation, `jax.nn.gelu`'s default), or
        `jax.nn.relu` / `jax.nn.gelu` for the same; checked here, not at the first call.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init, rngs: as for
        `nnx.Linear`, and so are kernel_metadata and bias_metadata. Sharding annotations such as
        `kernel_init=nnx.with_partitioning(init, ("data", "model"))` carry over to the params.
      fp8: None, True or `jax_epilog.Fp8(...)`: FP8 training as `jax_epilog.dense`'s `fp8=`.
        The parameters are the same with or without it, so checkpoints interchange. Unless
        `Fp8(scaling="current")` or `"block"` (`Fp8.keeps_state`), the layer also holds its
        amax histories as `AmaxHistory` variables (`input_amax_history`,
        `gradient_amax_history`) and runs delayed scaling from them (`fp8=True` included:
        "auto" scaling), calibrating itself from a fresh state (`jax_epilog.Fp8`).
    """

    def __init__(self, in_features: int, out_features: int, *,
                 activation: Any = None, use_bias: bool = True,
                 dtype: Optional[Any] = None, param_dtype: Any = jnp.float32,
                 precision: Any = None,
                 kernel_init: Any = nnx.initializers.lecun_normal(),
                 bias_init: Any = nnx.initializers.zeros_init(),
                 rngs: nnx.Rngs,
                 kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
                 bias_metadata: Mapping[str, Any] = MappingProxyType({}),
                 fp8: Any = None):
        activation = activation_name(activation)
        fp8 = as_fp8(fp8)
        # Same draws, same order as nnx.Linear: identical weights from identical Rngs.
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            **kernel_metadata)
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype),
                              **bias_metadata) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.fp8 = fp8
        self.input_amax_history, self.gradient_amax_history = _amax_histories(fp8)

    def kernel_and_bias(self) -> tuple[Any, Optional[Any]]:
        """The parameters' values; the kernel may be stored in FP8 (an `Fp8Weight`, put there
        by `nnx.update(model, jax_epilog.quantize_params(nnx.state(model, nnx.Param)))`)."""
        kernel = self.kernel.get_value() if hasattr(self.kernel, "get_value") else \
            self.kernel.value
        return (kernel if isinstance(kernel, Fp8Weight) else kernel[...],
                self.bias[...] if self.bias is not None else None)

    def fp8_state(self) -> Optional[Fp8History]:
        """This layer's `fp8_state=` for `jax_epilog.dense` (None under current scaling)."""
        if self.input_amax_history is None:
            return None
        return Fp8History(self.input_amax_history[...], self.gradient_amax_history[...])

    def __call__(self, inputs):
        _check_in_features(inputs, self.in_features, "Dense")
        inputs, kernel, bias = promote(promote_dtype, inputs, *self.kernel_and_bias(),
                                       dtype=self.dtype)
        return dense(inputs, kernel, bias, activation=self.activation, precision=self.precision,
                     fp8=self.fp8, fp8_state=self.fp8_state())


class MLP(nnx.Module):
    """A stack of `Dense` layers run as one `jax_epilog.mlp` call.

    `MLP(64, [128, 128, 10], rngs=nnx.Rngs(0))` has the parameters (and initial values) of
    `nnx.List([nnx.Linear(64, 128), nnx.Linear(128, 128), nnx.Linear(128, 10)])` stored as
    `layers`; `activation` follows every layer but the last, `final_activation` the last.
    The activations are checked as `Dense`'s are. The other arguments are `nnx.Linear`'s and
    apply to every layer; `fp8` is `Dense`'s (chosen per layer by `jax_epilog.Fp8()`; unless
    `scaling="current"` each layer holds its `AmaxHistory` variables).
    """

    def __init__(self, in_features: int, features: Sequence[int], *,
                 activation: Any = "relu", final_activation: Any = None,
                 use_bias: bool = True, dtype: Optional[Any] = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 kernel_init: Any = nnx.initializers.lecun_normal(),
                 bias_init: Any = nnx.initializers.zeros_init(),
                 rngs: nnx.Rngs, fp8: Any = None):
        if isinstance(features, (str, bytes)) or not isinstance(features, Iterable):
            raise TypeError(f"features: expected a sequence of layer sizes such as [512, 10] "
                            f"(the last is the output size), got {features!r}")
        features = list(features)
        if not features:
            raise ValueError("features: expected at least one layer size, got []")
        activation = activation_name(activation, "activation")
        final_activation = activation_name(final_activation, "final_activation")
        fp8 = as_fp8(fp8)
        sizes = [in_features, *features]
        self.layers = _ModuleList([
            Dense(sizes[i], sizes[i + 1],
                  activation=activation if i < len(features) - 1 else final_activation,
                  use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  precision=precision, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs,
                  fp8=fp8)
            for i in range(len(features))])
        self.activation = activation
        self.final_activation = final_activation
        self.dtype = dtype
        self.precision = precision
        self.fp8 = fp8

    def __call__(self, inputs):
        _check_in_features(inputs, self.layers[0].in_features, "MLP")
        params = [p for layer in self.layers for p in layer.kernel_and_bias()]
        inputs, *params = promote(promote_dtype, inputs, *params, dtype=self.dtype)
        states = [layer.fp8_state() for layer in self.layers]
        return mlp(inputs, list(zip(params[0::2], params[1::2])), activation=self.activation,
                   final_activation=self.final_activation, precision=self.precision,
                   fp8=self.fp8, fp8_state=None if None in states else states)


class SwiGLU(nnx.Module):
    """The Llama-style MLP block `down(silu(gate(x)) * up(x))`, no biases, as one
    `jax_epilog.swiglu` call.

    `SwiGLU(4096, 14336, rngs=nnx.Rngs(0))` holds `gate`, `up` and `down`, each a bias-free
    `Dense` whose state is that of `nnx.Linear(..., use_bias=False)` made in that order from
    the same `rngs` (`gate.kernel` `(in_features, hidden_features)`, `up.kernel` likewise,
    `down.kernel` `(hidden_features, out_features)`), so the initial weights and checkpoints
    are those of such a block. Separate kernels, not one `(D, 2F)`: the step's concatenation
    is fused into the quantization that reads them anyway (docs/fp8.md, "SwiGLU").

    Args:
      in_features: D.
      hidden_features: F, the width of silu(g)·u (Llama's `intermediate_size`).
      out_features: D_out; None (default): D.
      dtype, param_dtype, precision, kernel_init, rngs: as for `nnx.Linear` (`kernel_init`
        makes all three kernels).
      down_kernel_init: the down kernel's initialiser, if not `kernel_init`: e.g. for
        sharding annotations, `nnx.with_partitioning(init, ("mlp", "embed"))` where gate and
        up take `("embed", "mlp")`.
      fp8: None, True or `jax_epilog.Fp8(...)`: as `jax_epilog.swiglu`'s `fp8=`. Unless
        `Fp8(scaling="current")`, the block holds its two GEMMs' amax histories as
        `AmaxHistory` variables (`gate_up_input_amax_history`, ...,
        `down_gradient_amax_history`) and runs delayed scaling, as `Dense` does.
    """

    def __init__(self, in_features: int, hidden_features: int,
                 out_features: Optional[int] = None, *, dtype: Optional[Any] = None,
                 param_dtype: Any = jnp.float32, precision: Any = None,
                 kernel_init: Any = nnx.initializers.lecun_normal(),
                 down_kernel_init: Any = None, rngs: nnx.Rngs, fp8: Any = None):
        fp8 = as_fp8(fp8)
        out_features = in_features if out_features is None else out_features
        layer = dict(use_bias=False, param_dtype=param_dtype, rngs=rngs)
        self.gate = Dense(in_features, hidden_features, kernel_init=kernel_init, **layer)
        self.up = Dense(in_features, hidden_features, kernel_init=kernel_init, **layer)
        self.down = Dense(hidden_features, out_features, **layer, kernel_init=kernel_init
                          if down_kernel_init is None else down_kernel_init)
        self.in_features = in_features
        self.dtype = dtype
        self.precision = precision
        self.fp8 = fp8
        for gemm in FP8_GEMMS:
            histories = _amax_histories(fp8)
            for field, history in zip(Fp8History._fields, histories):
                setattr(self, f"{gemm}_{field}_amax_history", history)

    def fp8_state(self) -> Optional[tuple[Fp8History, ...]]:
        """The block's `fp8_state=` for `jax_epilog.swiglu` (None under current scaling)."""
        if self.gate_up_input_amax_history is None:
            return None
        return tuple(Fp8History(*(getattr(self, f"{gemm}_{field}_amax_history")[...]
                                  for field in Fp8History._fields)) for gemm in FP8_GEMMS)

    def __call__(self, inputs):
        _check_in_features(inputs, self.in_features, "SwiGLU")
        kernels = [layer.kernel_and_bias()[0] for layer in (self.gate, self.up, self.down)]
        inputs, gate, up, down = promote(promote_dtype, inputs, *kernels, dtype=self.dtype)
        return swiglu(inputs, (gate, up), down, precision=self.precision, fp8=self.fp8,
                      fp8_state=self.fp8_state())
