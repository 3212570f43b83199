"""Flax Linen modules: `Dense` and `MLP`, drop-in for `linen.Dense` followed by an activation,
and `SwiGLU`, the Llama-style MLP block.

The parameters are the stock ones (`kernel` `(inputs.shape[-1], features)`, `bias`
`(features,)`) with the same default initialisers, so `init` with the same key gives exactly
the parameters `linen.Dense` would, and either's checkpoint loads into the other. `MLP` names
its layers `layers_0`, `layers_1`, ... (what `self.layers = [nn.Dense(f) for f in features]`
in `setup` gives) and runs the whole stack as one `jax_epilog.mlp` call.

Flax is an optional dependency: `pip install ".[flax]"` in a checkout
(`pip install "jax-epilog[flax]"` from a package index).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import jax.numpy as jnp

from jax_epilog.runtime.library import install_hint as _install_hint

try:
    from flax import linen
    from flax.linen.dtypes import promote_dtype
except ImportError as error:
    raise ImportError(f"jax_epilog.linen needs Flax: {_install_hint('flax')}") from error

from jax_epilog.float8.recipe import Fp8History, as_fp8
from jax_epilog.float8.weights import Fp8Weight
from jax_epilog.layers.serving import promote
from jax_epilog.layers.functional import activation_name, dense, mlp
from jax_epilog.layers.swiglu import FP8_GEMMS, swiglu

#: The variable collection of the FP8 amax histories (delayed scaling, `fp8=True`'s): Flax's
#: "overwrite with gradient" collection, whose gradients are the variables' next values and
#: which `flax.training.train_state.TrainState.apply_gradients` overwrites, not optimizes.
try:
    from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT as FP8_COLLECTION
except ImportError:  # older Flax: the same name
    FP8_COLLECTION = "_overwrite_with_gradient"


class Dense(linen.Module):
    """`activation(inputs @ kernel + bias)` in one fused kernel; attributes as `linen.Dense`'s.

    Attributes:
      features: the number of output features.
      activation: None, "relu" or "gelu" (tanh approximation, `jax.nn.gelu`'s default), or
        `jax.nn.relu` / `jax.nn.gelu` for the same; checked on construction.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as for `linen.Dense`;
        `kernel_init=linen.with_partitioning(init, names)` annotates the kernel for sharding.
      fp8: None, True or `jax_epilog.Fp8(...)`: FP8 training as `jax_epilog.dense`'s `fp8=`;
        checked on construction. The parameters are the same with or without it. Unless
        `Fp8(scaling="current")` or `"block"` (`Fp8.keeps_state`), the layer also keeps
        `input_amax_history` and `gradient_amax_history` in the `FP8_COLLECTION` collection
        (`"_overwrite_with_gradient"`, as Flax's own fp8 ops) and runs delayed scaling from
        them (`fp8=True` included: "auto" scaling): differentiate w.r.t. that collection too,
        and replace it by its gradient (`TrainState.apply_gradients` does). Applied without
        the collection, `fp8=True` runs current scaling.
    """

    features: int
    activation: Any = None
    use_bias: bool = True
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = linen.initializers.lecun_normal()
    bias_init: Any = linen.initializers.zeros_init()
    fp8: Any = None

    def __post_init__(self):
        activation_name(self.activation)
        as_fp8(self.fp8)
        super().__post_init__()

    @linen.compact
    def kernel_and_bias(self, in_features: int) -> tuple[Any, Optional[Any]]:
        """This layer's parameters for inputs of `in_features` (created on first use). The
        kernel may be stored in FP8 (`jax_epilog.quantize_params`), for inference."""
        kernel = None
        if self.has_variable("params", "kernel"):
            kernel = linen.unbox(self.get_variable("params", "kernel"))
            built = jnp.shape(kernel)[0]
            if built != in_features:
                raise ValueError(f"x has {in_features} features; this Dense was initialised "
                                 f"with in_features={built}")
        if not isinstance(kernel, Fp8Weight):  # Flax's shape check reads only arrays
            kernel = self.param("kernel", self.kernel_init, (in_features, self.features),
                                self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) \
            if self.use_bias else None
        return kernel, bias

    @linen.compact
    def fp8_state(self, fp8) -> Optional[Fp8History]:
        """This layer's `fp8_state=` under `fp8` (created on first use): None under current
        scaling, and under "auto" when applied without the `FP8_COLLECTION` variables (e.g.
        `apply({"params": ...})`), which then runs current scaling."""
        fp8 = as_fp8(fp8)
        if fp8 is None or not fp8.keeps_state:
            return None
        names = [f"{field}_amax_history" for field in Fp8History._fields]
        if fp8.scaling == "auto" and not self.is_mutable_collection(FP8_COLLECTION) and \
                not all(self.has_variable(FP8_COLLECTION, name) for name in names):
            return None
        initial = fp8.init_state(1)[0]
        return Fp8History(*(self.variable(FP8_COLLECTION, name, lambda value=value: value).value
                            for name, value in zip(names, initial)))

    def __call__(self, inputs):
        kernel, bias = self.kernel_and_bias(jnp.shape(inputs)[-1])
        inputs, kernel, bias = promote(promote_dtype, inputs, kernel, bias, dtype=self.dtype)
        return dense(inputs, kernel, bias, activation=activation_name(self.activation),
                     precision=self.precision, fp8=self.fp8, fp8_state=self.fp8_state(self.fp8))


class MLP(linen.Module):
    """A stack of `Dense` layers (`features[i]` outputs each) run as one `jax_epilog.mlp` call.

    `activation` follows every layer but the last, `final_activation` the last; both are
    checked on construction, as `Dense`'s is. The other attributes are `linen.Dense`'s and
    apply to every layer; `fp8` is `Dense`'s (chosen per layer by `jax_epilog.Fp8()`; unless
    `scaling="current"` each `layers_i` keeps its amax histories in `FP8_COLLECTION`).
    """

    features: Sequence[int]
    activation: Any = "relu"
    final_activation: Any = None
    use_bias: bool = True
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = linen.initializers.lecun_normal()
    bias_init: Any = linen.initializers.zeros_init()
    fp8: Any = None

    def __post_init__(self):
        if isinstance(self.features, (str, bytes)) or not isinstance(self.features, Iterable):
            raise TypeError(f"features: expected a sequence of layer sizes such as [512, 10] "
                            f"(the last is the output size), got {self.features!r}")
        if not list(self.features):
            raise ValueError("features: expected at least one layer size, got []")
        activation_name(self.activation, "activation")
        activation_name(self.final_activation, "final_activation")
        as_fp8(self.fp8)
        super().__post_init__()

    @linen.compact
    def __call__(self, inputs):
        features = list(self.features)
        activation = activation_name(self.activation)
        final_activation = activation_name(self.final_activation)
        sizes = [jnp.shape(inputs)[-1], *features]
        params, states = [], []
        for i, size in enumerate(features):
            layer = Dense(size, activation=activation if i < len(features) - 1
                          else final_activation,
                          use_bias=self.use_bias, dtype=self.dtype,
                          param_dtype=self.param_dtype, precision=self.precision,
                          kernel_init=self.kernel_init, bias_init=self.bias_init,
                          name=f"layers_{i}")
            params.extend(layer.kernel_and_bias(sizes[i]))
            states.append(layer.fp8_state(self.fp8))
        inputs, *params = promote(promote_dtype, inputs, *params, dtype=self.dtype)
        return mlp(inputs, list(zip(params[0::2], params[1::2])), activation=activation,
                   final_activation=final_activation, precision=self.precision, fp8=self.fp8,
                   fp8_state=None if None in states else states)


class SwiGLU(linen.Module):
    """The Llama-style MLP block `down(silu(gate(x)) * up(x))`, no biases, as one
    `jax_epilog.swiglu` call (its FP8 form: one gate/up GEMM, h quantized where it is computed,
    the backward's activations kept in FP8).

    The parameters are those of three bias-free `linen.Dense` submodules named `gate`, `up` and
    `down` (`gate/kernel` `(D, hidden_features)`, likewise `up/kernel`, `down/kernel`
    `(hidden_features, out_features)`), made by the same initialiser from the same RNG paths,
    so a checkpoint of such a block loads as is. Separate kernels, not one `(D, 2F)`: the
    concatenation the step needs is fused into the quantization that reads the kernels anyway
    (docs/fp8.md, "SwiGLU"), and each kernel shards on its own along F.

    Attributes:
      hidden_features: F, the width of silu(g)·u (Llama's `intermediate_size`).
      out_features: D_out; None (default): the input's D, as a residual block needs.
      dtype, param_dtype, precision, kernel_init: as for `linen.Dense` (`kernel_init` makes
        all three kernels).
      down_kernel_init: the down kernel's initialiser, if not `kernel_init`: e.g. for
        sharding annotations, `linen.with_partitioning(init, ("mlp", "embed"))` where gate and
        up take `("embed", "mlp")`.
      fp8: None, True or `jax_epilog.Fp8(...)`: as `jax_epilog.swiglu`'s `fp8=`. Unless
        `Fp8(scaling="current")`, the block keeps the amax histories of its two GEMMs in
        `FP8_COLLECTION` (`gate_up_input_amax_history`, ..., `down_gradient_amax_history`)
        and runs delayed scaling, exactly as `Dense` does.
    """

    hidden_features: int
    out_features: Optional[int] = None
    dtype: Optional[Any] = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = linen.initializers.lecun_normal()
    down_kernel_init: Any = None
    fp8: Any = None

    def __post_init__(self):
        as_fp8(self.fp8)
        super().__post_init__()

    @linen.compact
    def __call__(self, inputs):
        d = jnp.shape(inputs)[-1]
        d_out = d if self.out_features is None else self.out_features
        down_init = self.kernel_init if self.down_kernel_init is None else self.down_kernel_init
        kernels = [Dense(features, use_bias=False, param_dtype=self.param_dtype,
                         kernel_init=init, name=name).kernel_and_bias(width)[0]
                   for name, width, features, init in (
                       ("gate", d, self.hidden_features, self.kernel_init),
                       ("up", d, self.hidden_features, self.kernel_init),
                       ("down", self.hidden_features, d_out, down_init))]
        inputs, gate, up, down = promote(promote_dtype, inputs, *kernels, dtype=self.dtype)
        return swiglu(inputs, (gate, up), down, precision=self.precision, fp8=self.fp8,
                      fp8_state=self._fp8_state())

    def _fp8_state(self):
        """The block's two `Fp8History` (as `Dense.fp8_state`, one per GEMM), or None."""
        fp8 = as_fp8(self.fp8)
        if fp8 is None or not fp8.keeps_state:
            return None
        names = [f"{gemm}_{field}_amax_history" for gemm in FP8_GEMMS
                 for field in Fp8History._fields]
        if fp8.scaling == "auto" and not self.is_mutable_collection(FP8_COLLECTION) and \
                not all(self.has_variable(FP8_COLLECTION, name) for name in names):
            return None
        initial = [value for history in fp8.init_state(len(FP8_GEMMS)) for value in history]
        values = [self.variable(FP8_COLLECTION, name, lambda value=value: value).value
                  for name, value in zip(names, initial)]
        return tuple(Fp8History(*values[i:i + 2]) for i in range(0, len(values), 2))
