"""`dense` and `mlp`: differentiable layers on cuBLASLt's epilogs (SPEC §2).

`mlp` is ONE `jax.custom_vjp` over the whole stack (`dense` is the same function for a stack of
one layer), so the backward can use the epilogs that cross a layer boundary:

- Forward, training: each layer is one RELU_AUX_BIAS (GELU_AUX_BIAS, BIAS, DEFAULT, ...) GEMM.
  The residuals are each layer's input (for its weight gradient), the kernels, and per
  activation the packed 1-bit ReLU mask (the pre-activation for GELU). A full-width ReLU
  pre-activation is never kept. Forward without differentiation uses the epilog without aux.
- Backward, walking the layers in reverse with dZ_i the gradient at layer i's pre-activation:
  dW_i = h_iᵀ dZ_i is a GEMM, with the bias gradient fused (BGRADB) where no other kernel gives
  it (the last layer, or a layer whose successor is not activated); for i > 0 the
  data-gradient GEMM dZ_i W_iᵀ also applies layer i-1's activation derivative and reduces its
  bias gradient (DRELU_BGRAD / DGELU_BGRAD, DRELU / DGELU without a bias). Each of these fused
  steps has an unfused equivalent (XLA's GEMM, elementwise derivative, reduction); which runs is
  chosen per GEMM from measurements at lowering time (`backend="auto"`, see `plan` and
  `planning.decisions`), and likewise for the forward GEMMs. On a CUDA GPU the whole stack may instead
  be the plain expression `act(x @ kernel + bias)` under JAX's own autodiff (`jax.nn.relu`'s
  gradient at 0 is then 0, where the mask's is 1): where the table's entry for this stack
  (measured whole by `python -m jax_epilog.tune`, the training step and the inference forward each on its own)
  chose it, or, without an entry, where every GEMM of the training step would run XLA's way.
  `stack_plan.plan_stack` makes these choices when the stack is traced; `jax_epilog.explain` shows
  them.

Dtypes, as Flax's `Dense` does it: everything is cast to one computation dtype before the
matmul: `dtype` if given, else `jnp.result_type` of `x` and the parameters (what the plain
expression `x @ kernel + bias` computes in). So float32 parameters with `dtype=jnp.bfloat16`
compute in bf16, and their gradients come back float32 (the gradient of the cast). cuBLASLt
accumulates in float32 whatever the dtype.

Transforms: `jax.jit`, `jax.grad`/`jax.vjp`, `jax.vmap`, `jax.checkpoint` and `jax.lax.scan`
work. The residuals carry `jax.ad_checkpoint.checkpoint_name`s (`RELU_MASK_NAME`,
`GELU_PRE_ACTIVATION_NAME`, `LAYER_INPUT_NAME`), so a remat policy such as
`jax.checkpoint_policies.save_only_these_names(RELU_MASK_NAME)` keeps the 1-bit masks and
recomputes the rest. Forward-mode (`jax.jvp`, `jax.jacfwd`) is not supported: JAX cannot
differentiate a `custom_vjp` in forward mode, and a `custom_jvp` would give up the fused backward.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_epilog.op import epilogs

from jax_epilog.op import manual_axes

from jax_epilog.planning import context, stack_plan
from jax_epilog.float8.recipe import as_fp8, check_state
from jax_epilog.layers import block_step, fp8_step  # FP8 training (SPEC §5)
from jax_epilog.layers import serving  # stored FP8 weights (docs/serving.md)
from jax_epilog.layers.gemms import (GELU_PRE_ACTIVATION_NAME, LAYER_INPUT_NAME,  # noqa: F401
                          RELU_MASK_NAME, data_gradient, layer_forward, weight_gradient)
from jax_epilog.op.arguments import SUPPORTED_DTYPES
from jax_epilog.op.matmul import activation_gradient
from jax_epilog.planning.stack_plan import Layer, Stack, StackPlan, weight_grad_gives_bias_grad

ACTIVATIONS = (None, "relu", "gelu")

#: `forward=` / `backward=` of the layers (one spelling for both), as the `backend` of the
#: GEMMs they issue.
STACK_BACKENDS = {"auto": "auto", "fused": "cublaslt", "xla": "xla"}
#: Old spellings still taken, with a `DeprecationWarning`: `backward="unfused"` was "xla".
_OLD_SPELLINGS = {("backward", "unfused"): "xla"}


# --- the custom VJP over a stack ----------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_stack(planned: StackPlan, x, params):
    # The primal runs only where nothing differentiates the stack: the inference forward.
    stack = planned.stack
    _observe(planned, "forward")
    if stack.inference == "plain":
        return plain_expression(stack, x, params)
    h = x
    for layer, (kernel, bias) in zip(stack.layers, params):
        h, _ = layer_forward(stack, layer, h, kernel, bias, keep_residual=False)
    return h


def _stack_fwd(planned: StackPlan, x, params):
    stack = planned.stack
    _observe(planned, "step")
    h, inputs, residuals = x, [], []
    for layer, (kernel, bias) in zip(stack.layers, params):
        inputs.append(checkpoint_name(h, LAYER_INPUT_NAME))
        h, residual = layer_forward(stack, layer, h, kernel, bias, keep_residual=True)
        residuals.append(residual)
    kernels = tuple(kernel for kernel, _ in params)
    return h, (tuple(inputs), kernels, tuple(residuals))


def _stack_bwd(planned: StackPlan, saved, dy):
    stack = planned.stack
    inputs, kernels, residuals = saved
    layers = stack.layers
    dz = activation_gradient(dy, residuals[-1], layers[-1].activation)
    gemm = dict(precision=stack.precision, backend=stack.backward)
    dbias = None  # the current layer's bias gradient, when the step above has given it
    grads = []
    for i in reversed(range(len(layers))):
        need_bias_grad = weight_grad_gives_bias_grad(layers, i)
        dkernel, fused_dbias = weight_gradient(inputs[i], dz, bias_gradient=need_bias_grad,
                                               **gemm)
        grads.append((dkernel, fused_dbias if need_bias_grad else dbias))
        # The data-gradient GEMM also applies the layer below's activation derivative and
        # reduces its bias gradient (DRELU_BGRAD and friends), where it has an activation.
        below = layers[i - 1] if i > 0 else Layer(None, False)
        dz, dbias = data_gradient(dz, kernels[i], activation=below.activation,
                                  has_bias=below.has_bias,
                                  residual=residuals[i - 1] if i else None, **gemm)
    return dz, tuple(reversed(grads))


fused_stack.defvjp(_stack_fwd, _stack_bwd)


def _observe(planned: StackPlan, mode: str) -> None:
    """Tells the planning context's observer (`tune`, `explain`) that the stack's fused form
    is traced as `mode` ("step" or "forward")."""
    observe = context.current().observe
    if observe is not None:
        observe(planned, mode)


# --- the plain expression, where the plan chose it ------------------------------------------

def plain_expression(stack: Stack, h, params):
    for layer, (kernel, bias) in zip(stack.layers, params):
        z = jnp.matmul(h, kernel, precision=stack.precision)
        z = z if bias is None else z + bias
        h = epilogs.ACTIVATIONS[layer.activation].plain(z) if layer.activation else z
    return h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _plain_step(planned: StackPlan, x, params):
    """The plain expression under JAX's autodiff, the fused stack where nothing differentiates
    it (the plan chose the fused inference forward and the plain training step)."""
    return fused_stack(planned, x, params)  # the primal: the inference forward


def _plain_step_fwd(planned: StackPlan, x, params):
    return jax.vjp(functools.partial(plain_expression, planned.stack), x, params)  # (y, pullback)


def _plain_step_bwd(planned: StackPlan, pullback, dy):
    return pullback(dy)


_plain_step.defvjp(_plain_step_fwd, _plain_step_bwd)


# --- the public layers: argument checks, dtypes, leading dims ------------------------------

def _describe_callable(fn) -> str:
    """`jax.nn.silu`, not `<function silu at 0x...>`, for error messages."""
    if isinstance(fn, functools.partial):
        arguments = [repr(a) for a in fn.args] + [f"{k}={v!r}" for k, v in fn.keywords.items()]
        return f"functools.partial({_describe_callable(fn.func)}, {', '.join(arguments)})"
    module = getattr(fn, "__module__", None) or ""
    if module.startswith("jax._src.nn"):
        module = "jax.nn"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return f"{module}.{name}" if module and name else repr(fn)


_ONLY_RELU_GELU = ("cuBLASLt's epilogs fuse only ReLU and GELU (tanh approximation), so apply "
                   "any other activation to the layer's output")


def activation_name(activation, name: str = "activation") -> Optional[str]:
    """The activation as the layers name it: None, "relu" or "gelu".

    `jax.nn.relu` and `jax.nn.gelu` (whose default, `approximate=True`, is the tanh
    approximation cuBLASLt's GELU epilogs compute) stand for "relu" and "gelu"; anything else
    raises an error naming `name`, what is accepted and what came.
    """
    if activation is None:
        return None
    accepted = "None, 'relu' or 'gelu' (or jax.nn.relu / jax.nn.gelu)"
    if isinstance(activation, str):
        if activation.strip().lower() in ACTIVATIONS:  # names are case-insensitive, as epilogs'
            return activation.strip().lower()
        raise ValueError(f"{name}: expected {accepted}, got {activation!r}; {_ONLY_RELU_GELU}")
    if activation is jax.nn.relu:
        return "relu"
    partial = isinstance(activation, functools.partial)
    keywords = activation.keywords if partial else {}
    if (activation.func if partial else activation) is jax.nn.gelu and not (
            partial and activation.args) and set(keywords) <= {"approximate"}:
        if keywords.get("approximate", True):
            return "gelu"
        raise ValueError(f"{name}: the exact GELU (jax.nn.gelu with approximate=False) is "
                         "not what cuBLASLt's GELU epilogs compute; they use the tanh "
                         "approximation: pass 'gelu' or jax.nn.gelu")
    raise TypeError(f"{name}: expected {accepted}, got {_describe_callable(activation)}; "
                    f"{_ONLY_RELU_GELU}")


def _check_activation(name: str, activation) -> Optional[str]:
    return activation_name(activation, name)


def compute_dtype(dtype, arrays):
    compute = jnp.result_type(*arrays) if dtype is None else jnp.dtype(dtype)
    if compute not in SUPPORTED_DTYPES:
        source = "promoted from x and the parameters" if dtype is None else "given as dtype"
        raise TypeError(f"dtype: expected a computation dtype float16, bfloat16 or float32, got "
                        f"{compute} ({source}); pass dtype= or cast the inputs")
    return compute


def described(value) -> str:
    """A value for an error message: an array by its shape and dtype (never its contents), a
    sequence by its length and what it holds."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        inner = ", ".join(described(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"{type(value).__name__} of {len(value)}: ({inner})"
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} {text[:77]}..."


def _check_params(x, layers):
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(f"layers: expected a non-empty sequence of (kernel, bias) pairs, got "
                        f"{type(layers).__name__}")
    width = jnp.shape(x)[-1] if jnp.ndim(x) else None
    if width is None:
        raise ValueError(f"x: expected an array of shape (..., K), got shape {jnp.shape(x)}")
    params = []
    for i, pair in enumerate(layers):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"layers[{i}]: expected a (kernel, bias) pair, got {described(pair)}")
        kernel, bias = pair
        if jnp.ndim(kernel) != 2 or jnp.shape(kernel)[0] != width:
            source = "x has" if i == 0 else f"layers[{i - 1}] gives"
            raise ValueError(f"layers[{i}] kernel: expected shape ({width}, N) ({source} "
                             f"{width} features), got {jnp.shape(kernel)}")
        width = jnp.shape(kernel)[1]
        if bias is not None and jnp.shape(bias) != (width,):
            raise ValueError(f"layers[{i}] bias: expected shape ({width},) or None, got "
                             f"{jnp.shape(bias)}")
        params.append((kernel, bias))
    return params


def _backend(name: str, value) -> str:
    """`forward=` or `backward=` (`name`) as the `backend` its GEMMs are asked for."""
    if isinstance(value, str) and (name, value) in _OLD_SPELLINGS:
        new = _OLD_SPELLINGS[name, value]
        warnings.warn(f'{name}="{value}" is spelled "{new}" now (as `forward=` and '
                      f'`matmul(backend=)` spell it)', DeprecationWarning, stacklevel=4)
        value = new
    if not isinstance(value, str) or value not in STACK_BACKENDS:
        raise ValueError(f"{name}: expected one of {tuple(STACK_BACKENDS)}, got {value!r}")
    return STACK_BACKENDS[value]


def run(x, params, activations, *, precision, forward, backward, dtype, fp8=None,
         fp8_state=None):
    if serving.has_stored_weights(params):
        return _serve(x, params, activations, dtype)
    fp8 = as_fp8(fp8)
    fp8_state = check_state(fp8, fp8_state, len(activations))
    stack_backends = (_backend("forward", forward), _backend("backward", backward))
    params = _check_params(x, params)
    arrays = [x] + [p for pair in params for p in pair if p is not None]
    dtype = compute_dtype(dtype, arrays)
    cast = functools.partial(jnp.asarray, dtype=dtype)
    params = tuple((cast(kernel), None if bias is None else cast(bias)) for kernel, bias in params)
    layers = tuple(Layer(act, bias is not None) for act, (_, bias) in zip(activations, params))
    x = cast(x)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(math.prod(lead), k)  # one GEMM per layer over every leading index
    axes = manual_axes.varying_axes([rows, *(p for pair in params for p in pair)])
    rows = manual_axes.vary(rows, axes)  # inside shard_map (see manual_axes)
    params = tuple((manual_axes.vary(kernel, axes), manual_axes.vary(bias, axes))
                   for kernel, bias in params)
    if fp8 is not None and fp8.block:
        def plain_layer(h, kernel, bias, activation):
            return run(h, [(kernel, bias)], [activation], precision=precision, forward=forward,
                        backward=backward, dtype=dtype)
        y = manual_axes.rows_in_auto_axes(
            lambda rows, params: block_step.stack(fp8, rows, params, activations, dtype,
                                                  plain_layer), rows, params)
        return y.reshape(*lead, y.shape[-1])
    widths = [rows.shape[1]] + [kernel.shape[1] for kernel, _ in params]
    ctx = context.current()
    planned = stack_plan.plan_stack(ctx, Stack(layers, precision, *stack_backends), rows.shape[0],
                              widths, dtype, fp8, has_state=fp8_state is not None)
    if ctx.observe is not None:
        ctx.observe(planned, "planned")
    if planned.any_fp8:
        return fp8_step.stack(planned, rows, params, fp8_state).reshape(*lead, widths[-1])
    if planned.step.choice == "fused":
        y = fused_stack(planned, rows, params)
    elif planned.inference.choice == "fused":
        y = _plain_step(planned, rows, params)
    else:
        y = plain_expression(planned.stack, rows, params)
    if fp8_state is not None:  # every layer stayed bf16: the state passes through
        y = fp8_step.carry_state(y, fp8_state)
    return y.reshape(*lead, y.shape[-1])


def _serve(x, params, activations, dtype):
    """The inference forward of a stack with kernels stored in FP8 (`serving.forward`); the
    training arguments (`fp8=`, `fp8_state=`, backends) do not apply to it."""
    params = _check_params(x, params)
    dtype = compute_dtype(dtype, [serving.operands_dtype(x, params)])
    params = tuple((kernel if isinstance(kernel, serving.Fp8Weight) else
                    jnp.asarray(kernel, dtype), bias) for kernel, bias in params)
    x = jnp.asarray(x, dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    y = serving.forward(tuple(activations), dtype, x.reshape(math.prod(lead), k), params)
    return y.reshape(*lead, y.shape[-1])


def dense(x, kernel, bias=None, *, activation=None, precision=None, forward="auto",
          backward="auto", dtype=None, fp8=None, fp8_state=None):
    """`act(x @ kernel + bias)` in one cuBLASLt epilog GEMM, with a fused backward.

    Args:
      x: `(..., K)`; the leading dims are flattened into the GEMM's rows.
      kernel: `(K, N)`, or a `jax_epilog.Fp8Weight` (weights stored in FP8 for inference,
        `jax_epilog.quantize_params`): then the layer is one FP8 GEMM with the bias and
        activation in its epilog, forward only (docs/serving.md).
      bias: `(N,)` or None.
      activation: None, "relu" or "gelu" (tanh approximation); `jax.nn.relu` and `jax.nn.gelu`
        (its default is the tanh approximation) stand for the names.
      precision: as for `jax_epilog.matmul` (float32 only: HIGHEST is full float32).
      forward: "auto" (per GEMM, the faster of cuBLASLt's epilog and XLA's own GEMM and
        fusions, as measured on this GPU; see `jax_epilog.planning.decisions`), "fused" (cuBLASLt) or
        "xla".
      backward: likewise for the backward GEMMs: "auto", "fused" or "xla" (the old spelling
        "unfused" is still taken, with a `DeprecationWarning`).
      dtype: the computation dtype; None: `jnp.result_type(x, kernel, bias)`, like Flax.
      fp8: None or False (no FP8), True (`jax_epilog.Fp8()`) or a `jax_epilog.Fp8(...)`: train
        with FP8 GEMMs, per-tensor scaling (`Fp8()`: delayed with `fp8_state=`, current
        without), e4m3 activations and weights, e5m2 gradients, results in the computation
        dtype (`jax_epilog.fp8`, docs/fp8.md). `Fp8(scaling="block")` is block-scaled FP8
        instead (`layers.block_step`: 1×128 tiles, 128×128 weight blocks, e4m3 gradients, no
        state, widths multiples of 128).
        `Fp8()` runs FP8 where a measured stack entry (`tune --fp8`) says it gains, else
        only where the GEMM is large enough to (`fp8.fp8_pays`); `Fp8(layers="all")` always.
      fp8_state: the layer's `jax_epilog.Fp8History` of amaxes (`Fp8(...).init_state(1)`
        before the first step, which then calibrates itself): required by
        `fp8=Fp8(scaling="delayed")`; with `Fp8()`'s "auto" scaling it makes the layer
        delayed-scaled; with `scaling="current"` it records the amaxes. Its gradient is its next value,
        Flax's "overwrite with gradient" convention: take `jax.grad` w.r.t. it and pass the
        result to the next step.

    Returns:
      `(..., N)` in the computation dtype. Differentiable in reverse mode w.r.t. all three.
    """
    activation = _check_activation("activation", activation)
    return run(x, [(kernel, bias)], [activation], precision=precision, forward=forward,
                backward=backward, dtype=dtype, fp8=fp8, fp8_state=fp8_state)


def mlp(x, layers, *, activation="relu", final_activation=None, precision=None,
        forward="auto", backward="auto", dtype=None, fp8=None, fp8_state=None):
    """A stack of `dense` layers as ONE custom VJP, its backward fused across layer boundaries.

    Args:
      x: `(..., K)`.
      layers: a sequence of `(kernel, bias)` pairs, kernel `(K_i, K_{i+1})` (or an
        `Fp8Weight`, as for `dense`: forward only), bias `(K_{i+1},)` or None.
      activation: None, "relu" or "gelu" (or `jax.nn.relu` / `jax.nn.gelu`) after every layer
        but the last.
      final_activation: the same, after the last layer.
      precision, forward, backward, dtype, fp8: as for `dense` (with FP8, each layer is
        quantized on its own scales, and `Fp8()` decides per layer).
      fp8_state: as for `dense`, one `Fp8History` per layer (`Fp8(...).init_state(len(layers))`).

    Returns:
      `(..., K_last)` in the computation dtype.
    """
    activation = _check_activation("activation", activation)
    final_activation = _check_activation("final_activation", final_activation)
    n_layers = len(layers) if isinstance(layers, Sequence) else 0
    activations = [activation] * (n_layers - 1) + [final_activation]
    return run(x, layers, activations, precision=precision, forward=forward,
                backward=backward, dtype=dtype, fp8=fp8, fp8_state=fp8_state)
