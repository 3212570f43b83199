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
  chosen per GEMM from measurements at lowering time (`backend="auto"`, see `dispatch`), and
  likewise for the forward GEMMs. On a CUDA GPU the whole stack may instead be the plain
  expression `act(x @ kernel + bias)` under JAX's own autodiff (`jax.nn.relu`'s gradient at 0
  is then 0, where the mask's is 1): where the table's entry for this stack (measured whole by
  `python -m jax_epilog.tune`, the training step and the inference forward each on its own)
  chose it, or, without an entry, where every GEMM of the training step would run XLA's way.

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

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import config, cuda_library, epilogs, manual_axes
from . import fp8 as fp8_training  # FP8 training (SPEC §5); it builds on this module's helpers
from .epilogs import Epilog
from .matmul import (SUPPORTED_DTYPES, activation_gradient, data_gradient, matmul,
                     weight_gradient)

ACTIVATIONS = (None, "relu", "gelu")

#: `checkpoint_name`s of the residuals, for `jax.checkpoint_policies.save_only_these_names`.
RELU_MASK_NAME = "jax_epilog_relu_mask"
GELU_PRE_ACTIVATION_NAME = "jax_epilog_gelu_pre_activation"
LAYER_INPUT_NAME = "jax_epilog_layer_input"

#: `forward=` / `backward=` of the layers, as the `backend` of the GEMMs they issue.
FORWARD_CHOICES = {"auto": "auto", "fused": "cublaslt", "xla": "xla"}
BACKWARD_CHOICES = {"auto": "auto", "fused": "cublaslt", "unfused": "xla"}


class Layer(NamedTuple):
    """What the custom VJP needs to know, statically, about one layer."""

    activation: Optional[str]
    has_bias: bool


class Stack(NamedTuple):
    """Static description of a stack (hashable: the custom_vjp's non-differentiable argument)."""

    layers: tuple[Layer, ...]
    precision: Any
    forward: str   # the `backend` of the forward GEMMs
    backward: str  # and of the backward ones


# --- the custom VJP over a stack ----------------------------------------------------------

def _layer_forward(stack: Stack, layer: Layer, h, kernel, bias, keep_residual: bool):
    """(act(h @ kernel + bias), residual or None), in one epilog GEMM."""
    epilog = Epilog.find(layer.activation, layer.has_bias, keep_residual)
    out = matmul(h, kernel, epilog=epilog, precision=stack.precision, backend=stack.forward,
                 epilog_inputs={"bias": bias} if layer.has_bias else None)
    if not epilog.aux_output:
        return out, None
    y, aux = out
    name = RELU_MASK_NAME if layer.activation == "relu" else GELU_PRE_ACTIVATION_NAME
    return y, checkpoint_name(aux[epilog.aux_output], name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stack(stack: Stack, x, params):
    # The primal runs only where nothing differentiates the stack: the inference forward.
    _record(stack, x, params, "forward")
    if _measured_path(stack, *_problem(x, params), "forward") == "plain":
        return _plain_expression(stack, x, params)
    h = x
    for layer, (kernel, bias) in zip(stack.layers, params):
        h, _ = _layer_forward(stack, layer, h, kernel, bias, keep_residual=False)
    return h


def _stack_fwd(stack: Stack, x, params):
    _record(stack, x, params, "step")
    h, inputs, residuals = x, [], []
    for layer, (kernel, bias) in zip(stack.layers, params):
        inputs.append(checkpoint_name(h, LAYER_INPUT_NAME))
        h, residual = _layer_forward(stack, layer, h, kernel, bias, keep_residual=True)
        residuals.append(residual)
    kernels = tuple(kernel for kernel, _ in params)
    return h, (tuple(inputs), kernels, tuple(residuals))


def _weight_grad_epilog(with_bias_grad: bool) -> Epilog:
    return Epilog.BGRADB if with_bias_grad else Epilog.DEFAULT


def _data_grad_epilog(previous: Optional[Layer]) -> Epilog:
    """DRELU_BGRAD and friends where the previous layer is activated, else a plain GEMM."""
    if previous is None or previous.activation is None:
        return Epilog.DEFAULT
    return Epilog.find_derivative(previous.activation, bias_gradient=previous.has_bias)


def _weight_grad_gives_bias_grad(layers, i: int) -> bool:
    """Whether layer i's bias gradient comes from its weight-gradient GEMM (BGRADB): it has a
    bias that the data-gradient GEMM of layer i + 1 does not reduce (DRELU_BGRAD and friends)."""
    given_above = i + 1 < len(layers) and _data_grad_epilog(layers[i]).reduction_output
    return layers[i].has_bias and not given_above


def _stack_bwd(stack: Stack, saved, dy):
    inputs, kernels, residuals = saved
    layers = stack.layers
    dz = activation_gradient(dy, residuals[-1], layers[-1].activation)
    gemm = dict(precision=stack.precision, backend=stack.backward)
    dbias = None  # the current layer's bias gradient, when the step above has given it
    grads = []
    for i in reversed(range(len(layers))):
        need_bias_grad = _weight_grad_gives_bias_grad(layers, i)
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


_stack.defvjp(_stack_fwd, _stack_bwd)


# --- per stack: the plain expression or the fused stack, whichever was faster ---------------

def _gemms(layers, rows: int, widths) -> list:
    """(direction, (epilog, batch, M, N, K, transpose_a, transpose_b)) of every GEMM of a
    training step, as `_stack_fwd` and `_stack_bwd` issue them."""
    gemms = []
    for i, layer in enumerate(layers):
        k, n = widths[i], widths[i + 1]
        forward = Epilog.find(layer.activation, layer.has_bias, keep_residual=True)
        weight = _weight_grad_epilog(_weight_grad_gives_bias_grad(layers, i))
        data = _data_grad_epilog(layers[i - 1] if i else None)
        gemms += [("forward", (forward, 1, rows, n, k, False, False)),
                  ("backward", (weight, 1, k, n, rows, True, False)),
                  ("backward", (data, 1, rows, k, n, False, True))]
    return gemms


def _on_cuda_gpu() -> bool:
    # Other platforms run the reference: the layer is the same code whichever path it takes.
    return jax.default_backend() == "gpu" and cuda_library.available()


def _problem(x, params) -> tuple:
    """(rows, widths, dtype) of a stack called on the rows `x`, as `_run` computes them."""
    return x.shape[0], [x.shape[1]] + [kernel.shape[1] for kernel, _ in params], x.dtype


def _stack_key(stack: Stack, rows: int, widths, dtype, mode: str):
    from . import dispatch
    layers = stack.layers
    return dispatch.make_stack_key(dtype, rows, widths, [layer.activation for layer in layers],
                                   [layer.has_bias for layer in layers], mode)


def _left_to_auto(stack: Stack) -> bool:
    return stack.forward == "auto" and stack.backward == "auto"


_recorded: Optional[list] = None  # while `recording_stacks()` collects


@contextlib.contextmanager
def recording_stacks():
    """Collects (in the list it yields) the `dispatch.StackKey` of every stack left to "auto"
    whose fused form is traced in the block: its custom VJP's forward as a training step, its
    primal as an inference forward. `python -m jax_epilog.tune` finds a program's stacks so."""
    global _recorded
    previous, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = previous


def _record(stack: Stack, x, params, mode: str) -> None:
    if _recorded is not None and _left_to_auto(stack):
        _recorded.append(_stack_key(stack, *_problem(x, params), mode))


def _measured_path(stack: Stack, rows: int, widths, dtype, mode: str) -> Optional[str]:
    """"plain" or "fused": what the stack's nearest measured entry for `mode` ("step" or
    "forward") chose on this CUDA GPU (`dispatch.stack_decision`); None without one, or where
    forward=/backward= asked for a backend (the GEMMs then run as asked)."""
    if not _on_cuda_gpu() or not _left_to_auto(stack):
        return None
    from . import dispatch
    decision = dispatch.stack_decision(_stack_key(stack, rows, widths, dtype, mode))
    return decision.choice if decision is not None else None


def _plain_is_faster(stack: Stack, rows: int, widths, dtype) -> bool:
    """Whether the stack's training step runs as the plain expression on this CUDA GPU: where
    its measured stack entry chose "plain", else (no entry) where every GEMM of the step runs
    XLA's way (asked for, or chosen per problem by `dispatch`). The plain expression is
    compiled by XLA exactly as a user's own (no bit mask to keep, nothing to pack).

    The layer cannot know here whether it will be differentiated, so this follows the training
    step, which users optimise; the inference forward follows its own entry where it has one
    (in `_stack`'s primal and in `_plain_stack`)."""
    if not _on_cuda_gpu():
        return False
    measured = _measured_path(stack, rows, widths, dtype, "step")
    if measured is not None:
        return measured == "plain"
    from . import dispatch

    def backend(choice, epilog, *problem):
        if choice != "auto":
            return choice
        return config.backend_override() or dispatch.choose(epilog, dtype, *problem)

    choices = {"forward": stack.forward, "backward": stack.backward}
    return all(backend(choices[direction], *gemm) == "xla"
               for direction, gemm in _gemms(stack.layers, rows, widths))


def _plain_expression(stack: Stack, h, params):
    for layer, (kernel, bias) in zip(stack.layers, params):
        z = jnp.matmul(h, kernel, precision=stack.precision)
        z = z if bias is None else z + bias
        h = epilogs.ACTIVATIONS[layer.activation].plain(z) if layer.activation else z
    return h


def _plain_stack(stack: Stack, h, params):
    """The plain expression under JAX's autodiff; where the stack's inference entry chose the
    fused stack, that is what runs when nothing differentiates it."""
    if _measured_path(stack, *_problem(h, params), "forward") == "fused":
        return _plain_step(stack, h, params)
    return _plain_expression(stack, h, params)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _plain_step(stack: Stack, x, params):
    return _stack(stack, x, params)  # the primal: the inference forward


def _plain_step_fwd(stack: Stack, x, params):
    return jax.vjp(functools.partial(_plain_expression, stack), x, params)  # (y, pullback)


def _plain_step_bwd(stack: Stack, pullback, dy):
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


def _compute_dtype(dtype, arrays):
    compute = jnp.result_type(*arrays) if dtype is None else jnp.dtype(dtype)
    if compute not in SUPPORTED_DTYPES:
        source = "promoted from x and the parameters" if dtype is None else "given as dtype"
        raise TypeError(f"dtype: expected a computation dtype float16, bfloat16 or float32, got "
                        f"{compute} ({source}); pass dtype= or cast the inputs")
    return compute


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
            raise TypeError(f"layers[{i}]: expected a (kernel, bias) pair, got {pair!r}")
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


def _backend(name: str, value, choices: dict) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {tuple(choices)}, got {value!r}")
    return choices[value]


def _run(x, params, activations, *, precision, forward, backward, dtype, fp8=None,
         fp8_state=None):
    fp8 = fp8_training.as_fp8(fp8)
    fp8_state = fp8_training.check_state(fp8, fp8_state, len(activations))
    stack_backends = (_backend("forward", forward, FORWARD_CHOICES),
                      _backend("backward", backward, BACKWARD_CHOICES))
    params = _check_params(x, params)
    arrays = [x] + [p for pair in params for p in pair if p is not None]
    dtype = _compute_dtype(dtype, arrays)
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
    stack = Stack(layers, precision, *stack_backends)
    widths = [rows.shape[1]] + [kernel.shape[1] for kernel, _ in params]
    if fp8 is not None and any(fp8.quantized_layers(rows.shape[0], widths)):
        y = fp8_training.stack(stack, fp8, rows, params, fp8_state)
    else:
        if _plain_is_faster(stack, rows.shape[0], widths, dtype):
            y = _plain_stack(stack, rows, params)
        else:
            y = _stack(stack, rows, params)
        if fp8_state is not None:  # every layer stayed bf16: the state passes through
            y = fp8_training.carry_state(y, fp8_state)
    return y.reshape(*lead, y.shape[-1])


def dense(x, kernel, bias=None, *, activation=None, precision=None, forward="auto",
          backward="auto", dtype=None, fp8=None, fp8_state=None):
    """`act(x @ kernel + bias)` in one cuBLASLt epilog GEMM, with a fused backward.

    Args:
      x: `(..., K)`; the leading dims are flattened into the GEMM's rows.
      kernel: `(K, N)`.
      bias: `(N,)` or None.
      activation: None, "relu" or "gelu" (tanh approximation); `jax.nn.relu` and `jax.nn.gelu`
        (its default is the tanh approximation) stand for the names.
      precision: as for `jax_epilog.matmul` (float32 only: HIGHEST is full float32).
      forward: "auto" (per GEMM, the faster of cuBLASLt's epilog and XLA's own GEMM and
        fusions, as measured on this GPU; see `jax_epilog.dispatch`), "fused" (cuBLASLt) or
        "xla".
      backward: likewise for the backward GEMMs: "auto", "fused" or "unfused" (XLA).
      dtype: the computation dtype; None: `jnp.result_type(x, kernel, bias)`, like Flax.
      fp8: None or False (no FP8), True (`jax_epilog.Fp8()`) or a `jax_epilog.Fp8(...)`: train
        with FP8 GEMMs, per-tensor current scaling, e4m3 activations and weights, e5m2
        gradients, results in the computation dtype (`jax_epilog.fp8`, docs/fp8.md).
        `Fp8()` runs FP8 only where the GEMM is large enough to gain (`fp8.fp8_pays`);
        `Fp8(layers="all")` always.
      fp8_state: the layer's `jax_epilog.Fp8History` of amaxes (`Fp8(...).init_state(1)`
        before the first step): required by `fp8=Fp8(scaling="delayed")`, optional with
        current scaling (which records its amaxes in it). Its gradient is its next value,
        Flax's "overwrite with gradient" convention: take `jax.grad` w.r.t. it and pass the
        result to the next step.

    Returns:
      `(..., N)` in the computation dtype. Differentiable in reverse mode w.r.t. all three.
    """
    activation = _check_activation("activation", activation)
    return _run(x, [(kernel, bias)], [activation], precision=precision, forward=forward,
                backward=backward, dtype=dtype, fp8=fp8, fp8_state=fp8_state)


def mlp(x, layers, *, activation="relu", final_activation=None, precision=None,
        forward="auto", backward="auto", dtype=None, fp8=None, fp8_state=None):
    """A stack of `dense` layers as ONE custom VJP, its backward fused across layer boundaries.

    Args:
      x: `(..., K)`.
      layers: a sequence of `(kernel, bias)` pairs, kernel `(K_i, K_{i+1})`, bias
        `(K_{i+1},)` or None.
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
    return _run(x, layers, activations, precision=precision, forward=forward,
                backward=backward, dtype=dtype, fp8=fp8, fp8_state=fp8_state)
