"""`EpilogProvider`: a Qwix quantization provider whose chosen layers run jax-epilog's served
FP8 forward (docs/stock_models.md, "Serving"), so that `qwix.quantize_model(model,
EpilogProvider(rules), *inputs)` serves as `jax_epilog.serve_fp8` does.

Built on Qwix's public extension points, the two hooks of a `qwix.QuantizationProvider`
subclass: `process_model_inputs`, which Qwix calls with the model before each call, and
`get_intercept_map`, which names the functions Qwix patches while the model runs. Qwix's own
providers intercept `jax.lax.dot_general` and `jnp.einsum`, which see neither the layer's
bias nor its attributes; this one works on whole stock layers (`nnx.Linear`,
`nnx.LinearGeneral`, `nnx.Einsum`, `linen.Dense`, `linen.DenseGeneral`, `linen.Einsum`), so
that the bias the layer adds is fused into the served GEMM's epilog.

NNX: before the first call (the one `quantize_model` makes), each layer a rule chooses has
its kernel stored in FP8 and its class swapped for its served subclass, as `serve_fp8` does
(layers stacked by `nnx.vmap` included), so it serves under `nnx.jit` and wherever it is
called from afterwards. Linen (whose layers exist only while it runs): the stock layers'
`__call__` are intercepted; `init` of the quantized module stores the chosen kernels as
`Fp8Weight`s (as Qwix's PTQ stores its quantized params at init), `apply` serves them.

The rules are Qwix's `QuantizationRule`s: `module_path`, `op_names` ("dot_general" for the
dense layers, "einsum"), `weight_qtype` (float8_e4m3fn or float8_e5m2; None leaves a layer
alone). `act_qtype` may be None or float8_e4m3fn: the served ways quantize the input
themselves (e4m3 where they run FP8 GEMMs, the rows choose). Options the served route has no
counterpart for (`tile_size`, `act_static_scale`, calibration methods other than absmax)
raise when the provider is made.
"""

from __future__ import annotations

import re
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen, nnx

from jax_epilog.float8.weights import Fp8Weight
from jax_epilog.layers import stock_layers
from jax_epilog.layers.stock_layers import kernel_value, stock_kind
from jax_epilog.layers.stock_serving import (StockServingWarning, _Context, intercept,
                                             path_string, serve_nnx_layer, shown)

try:
    import qwix
except ImportError as error:
    raise ImportError("jax_epilog.layers.qwix_serving needs Qwix (pip install qwix)") from error

#: The functions intercepted (Linen's stock layers' `__call__`) with the op name Qwix's rules
#: use for them; NNX layers are served before the model runs (`process_model_inputs`).
INTERCEPTED = {
    "flax.linen.Dense.__call__": (linen.Dense, "dot_general"),
    "flax.linen.DenseGeneral.__call__": (linen.DenseGeneral, "dot_general"),
    "flax.linen.Einsum.__call__": (linen.Einsum, "einsum"),
}
#: The op name of each kind of stock layer (`stock_layers.stock_kind`).
OPS = {"dense": "dot_general", "general": "dot_general", "einsum": "einsum"}

FP8_WEIGHTS = ("float8_e4m3fn", "float8_e5m2")


def _check_rule(i: int, rule) -> None:
    def name(dtype) -> Optional[str]:
        return None if dtype is None else jnp.dtype(dtype).name

    if name(rule.weight_qtype) not in (None, *FP8_WEIGHTS):
        raise ValueError(f"rules[{i}].weight_qtype: EpilogProvider stores weights in "
                         f"{' or '.join(FP8_WEIGHTS)}, got {name(rule.weight_qtype)}; use "
                         "qwix.PtqProvider for other types")
    if name(rule.act_qtype) not in (None, "float8_e4m3fn"):
        raise ValueError(f"rules[{i}].act_qtype: the served ways quantize inputs to "
                         f"float8_e4m3fn (or not at all, weight-only), got "
                         f"{name(rule.act_qtype)}")
    unsupported = {"tile_size": rule.tile_size is not None,
                   "act_static_scale": bool(rule.act_static_scale),
                   "weight_calibration_method": rule.weight_calibration_method != "absmax"}
    for field, bad in unsupported.items():
        if bad:
            raise ValueError(f"rules[{i}].{field}={getattr(rule, field)!r} has no counterpart "
                             "in jax-epilog's served route (per-tensor or per-channel absmax "
                             "weight scales; static input scales come from "
                             "jax_epilog.calibrate)")


class EpilogProvider(qwix.QuantizationProvider):
    """A Qwix provider serving the chosen stock layers with jax-epilog's FP8 GEMMs.

    Args:
      rules: Qwix `QuantizationRule`s, first match decides (module docstring).
      strict: a chosen layer the route cannot take raises a `ValueError` naming it (else it
        stays 16-bit with a `StockServingWarning`).
      granularity: "tensor" or "channel", as `jax_epilog.quantize_params`'.
    """

    def __init__(self, rules, *, strict: bool = False, granularity: str = "tensor"):
        rules = list(rules)
        super().__init__(rules)
        for i, rule in enumerate(rules):
            _check_rule(i, rule)
        self.serving_rules = tuple(rules)
        self.strict = strict
        self.granularity = granularity

    def process_model_inputs(self, model, model_args, model_kwargs):
        if isinstance(model, nnx.Module):
            self._serve_nnx(model)
        return super().process_model_inputs(model, model_args, model_kwargs)

    def _serve_nnx(self, model) -> None:
        """Serves each stock layer of `model` a rule chooses (as `serve_fp8` does), before it
        runs: layers stacked by `nnx.vmap` and run by `nnx.scan` are then stored whole."""
        for path, module in nnx.iter_modules(model):
            kind, name = stock_kind(module), path_string(path)
            custom = stock_layers.overridden_call(module)
            if custom is not None:
                self._chosen(name, "dot_general", module, None, custom)
            if kind is None or hasattr(type(module), "_jax_epilog_unserved"):
                continue
            kernel = kernel_value(module.kernel)
            if isinstance(kernel, jax.core.Tracer):
                continue  # a traced call of a model served already
            dtype = self._chosen(name, OPS[kind], module, kernel)
            if dtype is not None:
                serve_nnx_layer(module, kind, kernel, name, dtype, self.granularity)

    def get_intercept_map(self):
        handlers = {target: self._handler(cls, op) for target, (cls, op) in INTERCEPTED.items()}
        return super().get_intercept_map() | handlers

    def _rule(self, path: str, op: str):
        return next((r for r in self.serving_rules if re.fullmatch(r.module_path, path) and
                     (not r.op_names or op in r.op_names)), None)

    def _handler(self, cls: type, op: str):
        def handler(module, inputs, *args, **kwargs):
            def original():  # Qwix runs the unpatched method inside its handler
                return cls.__call__(module, inputs, *args, **kwargs)
            return self._linen(module, op, original, inputs, args, kwargs)
        return handler

    def _chosen(self, path: str, op: str, module, kernel,
                reason: Optional[str] = None) -> Optional[str]:
        """The matching rule's stored dtype where the layer is served, else None (a warning
        or, with `strict`, an error naming `path` where it cannot be: `reason`, or
        `why_not`'s)."""
        rule = self._rule(path, op)
        if rule is None or rule.weight_qtype is None:
            return None
        reason = reason or stock_layers.why_not(module, stock_kind(module), kernel)
        if reason is None:
            return jnp.dtype(rule.weight_qtype).name
        if self.strict:
            raise ValueError(f"{shown(path)}: cannot be served in FP8: {reason}")
        warnings.warn(f"{shown(path)} stays 16-bit: {reason}", StockServingWarning,
                      stacklevel=3)
        return None

    def _stored(self, module, kernel, path: str, dtype: str) -> Fp8Weight:
        return stock_layers.stored_kernel(module, stock_kind(module), kernel,
                                          name=f"{shown(path)}/kernel", dtype=dtype,
                                          granularity=self.granularity)

    def _linen(self, module, op, original, inputs, args, kwargs):
        if not module.is_initializing():  # apply: serves the kernels init stored
            return intercept(lambda *a, **k: original(), (inputs, *args), kwargs,
                             _Context(module, "__call__"))
        out = original()  # creates the 16-bit params
        kernel = kernel_value(module.get_variable("params", "kernel"))
        path = path_string(module.path)
        dtype = self._chosen(path, op, module, kernel)
        if dtype is None:
            return out
        module.put_variable("params", "kernel", self._stored(module, kernel, path, dtype))
        return intercept(lambda *a, **k: original(), (inputs, *args), kwargs,
                         _Context(module, "__call__"))
