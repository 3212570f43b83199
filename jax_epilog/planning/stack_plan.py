"""The plan of a `dense`/`mlp` stack, made when it is traced (`plan_stack`): for each layer
whether it runs FP8 (`quantized_layers`: the stack's measured entry, else `fp8_pays`), where
its ReLU derivative comes from and which GEMMs write FP8 tensors; every GEMM of the stack
(`stack_gemms`: the one list of what the layers issue) with its epilog, layout and the backend
the layer asks `matmul` for, and what that backend becomes on CUDA; and whether the training
step and the inference forward run the fused stack or the plain expression. `layers` carries
it out, `tune` times its stacks and GEMMs, `explain` prints it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import numpy as np

from jax_epilog.op.epilogs import Epilog
from jax_epilog.planning import table_format
from jax_epilog.planning.context import Choice, Context, Gemm, describe, on_cuda

# --- a stack as the layers describe it --------------------------------------------------------

class Layer(NamedTuple):
    """What the custom VJP needs to know, statically, about one layer."""

    activation: Optional[str]
    has_bias: bool


class Stack(NamedTuple):
    """Static description of a stack (hashable: the custom_vjp's non-differentiable argument).

    `inference`: what the stack's primal (the inference forward, where nothing differentiates
    it) runs, "fused" or "plain", as `plan_stack` chose."""

    layers: tuple[Layer, ...]
    precision: Any
    forward: str   # the `backend` of the forward GEMMs
    backward: str  # and of the backward ones
    inference: str = "fused"


def weight_grad_epilog(with_bias_grad: bool) -> Epilog:
    return Epilog.BGRADB if with_bias_grad else Epilog.DEFAULT


def data_grad_epilog(previous: Optional[Layer]) -> Epilog:
    """DRELU_BGRAD and friends where the previous layer is activated, else a plain GEMM."""
    if previous is None or previous.activation is None:
        return Epilog.DEFAULT
    return Epilog.find_derivative(previous.activation, bias_gradient=previous.has_bias)


def weight_grad_gives_bias_grad(layers, i: int) -> bool:
    """Whether layer i's bias gradient comes from its weight-gradient GEMM (BGRADB): it has a
    bias that the data-gradient GEMM of layer i + 1 does not reduce (DRELU_BGRAD and friends)."""
    given_above = i + 1 < len(layers) and data_grad_epilog(layers[i]).reduction_output
    return layers[i].has_bias and not given_above


# --- FP8: which layers, and where each FP8 tensor comes from ----------------------------------

#: Layer GEMMs of at least this many FLOPs (2·rows·K·N) run FP8 under `Fp8(layers="auto")`:
#: below it the amax and cast passes cost more than the faster FP8 GEMM saves. It is the
#: crossover `benchmarks/fp8_bench.py --sweep` measured on training steps of 4-layer ReLU
#: stacks, FP8 in every layer against the faster bf16 step (benchmarks/results/fp8_sweep.md).
FP8_MIN_FLOPS = 2**36
#: FP8 GEMMs want K and N in multiples of 16 elements; others would be padded (a copy) first.
FP8_ALIGNMENT = 16
#: The epilogs whose FP8 GEMM cuBLASLt 13.1 can write as e4m3 with its amax (as cuBLASLt
#: answered when asked, docs/fp8.md's kernel table): under delayed scaling such a layer writes
#: the next layer's FP8 input itself.
FP8_RESULT_EPILOGS = frozenset({Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS,
                                Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS})
#: The epilogs cuBLASLt 13.1 runs with FP8 operands and a float32 result (it has no such kernel
#: with a bias, a bias gradient or an activation's auxiliary output; docs/fp8.md).
FLOAT32_KERNEL_EPILOGS = frozenset({Epilog.DEFAULT, Epilog.DRELU})


def fp8_pays_why(rows: int, k: int, n: int) -> Choice:
    """`fp8_pays` with its reason."""
    if k % FP8_ALIGNMENT or n % FP8_ALIGNMENT:
        return Choice("bf16", f"K={k} or N={n} is not a multiple of {FP8_ALIGNMENT} (FP8 "
                              "would pad, a copy)")
    flops = 2 * rows * k * n
    if flops < FP8_MIN_FLOPS:
        return Choice("bf16", f"2·rows·K·N = {flops:.3g} FLOPs < FP8_MIN_FLOPS "
                              f"({FP8_MIN_FLOPS:.3g}): quantizing costs more than FP8 saves")
    return Choice("fp8", f"2·rows·K·N = {flops:.3g} FLOPs >= FP8_MIN_FLOPS "
                         f"({FP8_MIN_FLOPS:.3g})")


def fp8_pays(rows: int, k: int, n: int) -> bool:
    """Whether the rule runs a layer `(rows, k) @ (k, n)` in FP8 under `Fp8(layers="auto")`
    where no measured stack entry decides (`quantized_layers`): its GEMM has at least
    `FP8_MIN_FLOPS` FLOPs, and K and N are multiples of 16 (no padding copy). Below that, the
    amax and cast passes over the activations cost more than the faster FP8 GEMMs save."""
    return fp8_pays_why(rows, k, n).choice == "fp8"


def measured_fp8(ctx: Context, stack: Stack, rows: int, widths, dtype) -> Optional[Choice]:
    """"fp8" or "bf16" for every layer of the stack, where the tables decide and a training-step
    entry of this stack near `rows` holds an FP8 time (`dispatch.fp8_stack_decision`: FP8 must
    beat the faster bf16 step by `table_format.MARGIN`); else None. The inference forward follows
    the training step's entry (tune times FP8 only in steps)."""
    if not ctx.tables_decide():
        return None
    decision = ctx.fp8_table(stack_key(stack, rows, widths, dtype, "step"))
    if decision is None:
        return None
    verdict = "won" if decision.choice == "fp8" else "did not win"
    scaling = decision.entry.seconds.get(table_format.FP8_SCALING)
    timed = f" ({scaling} scaling)" if scaling else ""
    return Choice(decision.choice, f"FP8 in every layer{timed} {verdict} against the faster "
                                   f"bf16 step by {table_format.MARGIN:.0%}: stack entry "
                                   f"({describe(decision)})")


def quantized_layers(fp8, rows: int, widths,
                     measured: Optional[Choice] = None) -> tuple[Choice, ...]:
    """Per layer "fp8" or "bf16" (the compute dtype) under the `Fp8` config `fp8`, and why: the
    one place this is decided. `layers="all"`: every layer. `layers="auto"`: the stack's
    measured entry where it has one (`measured`, from `measured_fp8`: the same answer for
    every layer), else each layer by the rule `fp8_pays_why`."""
    if fp8.layers == "all":
        return tuple(Choice("fp8", 'Fp8(layers="all")') for _ in widths[1:])
    if measured is not None:
        return tuple(measured for _ in widths[1:])
    return tuple(fp8_pays_why(rows, k, n) for k, n in zip(widths, widths[1:]))


def fp8_layers(fp8, rows: int, widths) -> tuple[bool, ...]:
    """Which layers of a stack (`widths`: its K_0, K_1, ..., K_last) run FP8 under `fp8` by the
    rule, without the decision tables (`quantized_layers` says why; on a GPU a measured stack
    entry can decide otherwise, which `jax_epilog.explain` shows)."""
    return tuple(c.choice == "fp8" for c in quantized_layers(fp8, rows, widths))


def fp8_gemm_backend(requested: str, epilog: Epilog, result_dtype, override) -> Choice:
    """The backend the FP8 layers ask of `matmul` for one FP8 GEMM under the stack's
    `forward`/`backward` (`override`: ``JAX_EPILOG_BACKEND``). Only "auto" is changed (an
    explicit backend runs as asked), to XLA's FP8 GEMM and fusions (or the override, which
    replaces every automatic choice) where:

    - the result is float32 and cuBLASLt has no FP8 kernel for the epilog
      (`FLOAT32_KERNEL_EPILOGS`): XLA's FP8 GEMM to float32 rather than the reference fallback;
    - the GEMM applies an activation's derivative (DRELU_BGRAD and friends): XLA's FP8 GEMM,
      then the derivative, the bias gradient and the amax as fusions: cuBLASLt's FP8
      DRELU_BGRAD runs far below its own plain FP8 GEMM and XLA's, losing more per layer than
      the elementwise passes cost (benchmarks/README.md, benchmarks/results/fp8.md).
      `backward="fused"` keeps the kernel (fp8_bench's ours_fp8_fused row measures both), and
      so does JAX_EPILOG_BACKEND=cublaslt.
    """
    if requested != "auto":
        return Choice(requested, f"backend={requested!r} asked for")
    if np.dtype(result_dtype) == np.float32 and epilog not in FLOAT32_KERNEL_EPILOGS:
        return Choice(override() or "xla", f"cuBLASLt 13.1 has no FP8 {epilog.name} kernel "
                                           "with a float32 result: XLA's FP8 GEMM")
    if epilog.derivative:
        return Choice(override() or "xla", "an FP8 GEMM applying a derivative runs faster "
                                           "as XLA's FP8 GEMM and fusions")
    return Choice("auto", "")


class LayerPlan(NamedTuple):
    """One layer of a stack: FP8 or the compute dtype, and, for FP8 stacks, where tensors come
    from (the rules are `relu_from_next_input`, `writes_fp8_result`, `writes_fp8_gradient`)."""

    fp8: bool
    why: str
    relu_from_next_input: bool = False
    writes_fp8_result: bool = False
    writes_fp8_gradient: bool = False


def relu_from_next_input(stack: Stack, quantized, i: int) -> bool:
    """Whether layer i's ReLU derivative is taken from the next layer's FP8 input, `h8 > 0`
    (`h8 = Q(relu(z))`, which that layer keeps anyway), so that layer i keeps no mask and its
    forward GEMM has no aux output (RELU_BIAS, not RELU_AUX_BIAS). The one rule: a ReLU layer
    followed by an FP8 layer, under `backward="auto"` (whose data gradients through ReLU then
    are plain FP8 GEMMs and XLA fusions); an explicit backend keeps the packed mask (
    `"fused"`: cuBLASLt's DRELU_BGRAD reads it; `"xla"`: XLA's FP8 GEMM then the mask's
    derivative, the path "auto" took before). The derivative differs from the mask's only
    where z > 0 quantizes to 0 (`q(h)·z` under 2**-10, half e4m3's smallest subnormal: about
    2**-19 of h's amax) and at z = ±0 (and NaN): 0 there, `jax.nn.relu`'s own convention at 0,
    where cuBLASLt's mask bit passes the gradient."""
    return stack.layers[i].activation == "relu" and i + 1 < len(quantized) and \
        quantized[i + 1] and stack.backward == "auto"


def writes_fp8_result(stack: Stack, fp8, quantized, i: int, dtype) -> bool:
    """Whether layer i's forward GEMM writes the next layer's FP8 input (and its amax) itself,
    so that input needs no cast and no amax pass: under delayed scaling (the scale is known
    before the GEMM), a next layer in FP8, an epilog cuBLASLt has an e4m3 result for
    (`FP8_RESULT_EPILOGS`), and bfloat16 compute (an FP8 result's bias and aux are bfloat16,
    SPEC §5)."""
    layer = stack.layers[i]
    epilog = Epilog.find(layer.activation, layer.has_bias, False)
    return fp8.delayed and i + 1 < len(quantized) and quantized[i] and quantized[i + 1] and \
        np.dtype(dtype) == np.dtype("bfloat16") and epilog in FP8_RESULT_EPILOGS


def writes_fp8_gradient(stack: Stack, fp8, quantized, i: int) -> bool:
    """Whether the data-gradient GEMM of layer i + 1 writes layer i's FP8 gradient dZ8 (and
    its amax) itself, so the 16-bit data gradient never exists: under delayed scaling (the
    scale known before the GEMM), for a ReLU whose derivative comes from the next layer's
    input (`relu_from_next_input`: a 0/1 mask, which commutes with the quantization, applied
    to the FP8 bits), layer i in FP8. The amax is the GEMM's, before the mask: an upper bound
    of dZ's."""
    return fp8.delayed and quantized[i] and relu_from_next_input(stack, quantized, i)


def _layer_plans(ctx: Context, stack: Stack, fp8, rows: int, widths,
                 dtype) -> tuple[LayerPlan, ...]:
    if fp8 is None:
        return tuple(LayerPlan(False, "no fp8=") for _ in stack.layers)
    measured = measured_fp8(ctx, stack, rows, widths, dtype) if fp8.layers == "auto" else None
    choices = quantized_layers(fp8, rows, widths, measured)
    quantized = tuple(c.choice == "fp8" for c in choices)
    if not any(quantized):
        return tuple(LayerPlan(False, c.why) for c in choices)
    return tuple(LayerPlan(q, c.why, relu_from_next_input(stack, quantized, i),
                           writes_fp8_result(stack, fp8, quantized, i, dtype),
                           writes_fp8_gradient(stack, fp8, quantized, i))
                 for i, (q, c) in enumerate(zip(quantized, choices)))


# --- the GEMMs of a stack -------------------------------------------------------------------

def stack_gemms(stack: Stack, layer_plans, rows: int, widths, dtype, fp8, mode: str,
                override: Callable[[], Optional[str]] = lambda: None) -> tuple[Gemm, ...]:
    """Every GEMM the stack issues, in the order the layers issue them: the forward GEMMs
    (`mode` "forward": only those, without residuals), then for "step" the backward's, from
    the last layer down (its weight gradient, then its data gradient). The one list of them."""
    dtype = np.dtype(dtype).name
    step = mode == "step"
    forward, backward = [], []
    for i, (layer, lp) in enumerate(zip(stack.layers, layer_plans)):
        k, n = widths[i], widths[i + 1]
        keep = step and not lp.relu_from_next_input
        epilog = Epilog.find(layer.activation, layer.has_bias, keep)
        if not lp.fp8:
            forward.append(Gemm(i, "forward", epilog, dtype, dtype, 1, rows, n, k, False, False,
                                stack.forward))
            weight = weight_grad_epilog(weight_grad_gives_bias_grad(stack.layers, i))
            backward.append((
                Gemm(i, "weight gradient", weight, dtype, dtype, 1, k, n, rows, True, False,
                     stack.backward),
                Gemm(i, "data gradient", data_grad_epilog(stack.layers[i - 1] if i else None),
                     dtype, dtype, 1, rows, k, n, False, True, stack.backward)))
            continue
        result = fp8.forward if lp.writes_fp8_result else dtype
        requested = fp8_gemm_backend(stack.forward, epilog, result, override)
        forward.append(Gemm(i, "forward", epilog, fp8.forward, result, 1, rows, n, k, False,
                            False, *requested))
        weight = fp8_gemm_backend(stack.backward, Epilog.DEFAULT, dtype, override)
        below = layer_plans[i - 1] if i else None
        if below is not None and below.writes_fp8_gradient:
            data, result = Epilog.DEFAULT, fp8.gradient
        elif below is not None and below.relu_from_next_input:
            data, result = Epilog.DEFAULT, dtype
        else:
            data, result = data_grad_epilog(stack.layers[i - 1] if i else None), dtype
        gradient = f"{fp8.gradient} x {fp8.forward}"
        backward.append((
            Gemm(i, "weight gradient", Epilog.DEFAULT, f"{fp8.forward} x {fp8.gradient}", dtype,
                 1, k, n, rows, False, True, *weight),
            Gemm(i, "data gradient", data, gradient, result, 1, rows, k, n, False, True,
                 *fp8_gemm_backend(stack.backward, data, result, override))))
    if not step:
        return tuple(forward)
    return (*forward, *(g for pair in reversed(backward) for g in pair))


# --- the stack's plan ----------------------------------------------------------------------

class StackPlan(NamedTuple):
    """How one traced `dense`/`mlp` stack runs (hashable: the FP8 custom VJP's
    non-differentiable argument)."""

    stack: Stack  # its `inference` is the inference forward's path
    rows: int
    widths: tuple[int, ...]
    dtype: str
    fp8: Any  # the `Fp8` config, or None
    layers: tuple[LayerPlan, ...]
    step: Choice  # "fused", "plain" or "fp8": the training step
    inference: Choice  # "fused", "plain" or "fp8": the forward where nothing differentiates
    gemms: tuple[Gemm, ...]  # of the training step (`stack_gemms`), planned for CUDA
    forward_gemms: tuple[Gemm, ...]  # of the inference forward

    @property
    def quantized(self) -> tuple[bool, ...]:
        return tuple(lp.fp8 for lp in self.layers)

    @property
    def any_fp8(self) -> bool:
        return any(self.quantized)

    def gemm(self, layer: int, role: str, mode: str = "step") -> Gemm:
        """The planned GEMM of `layer` in `role` ("forward", "weight gradient", "data
        gradient") of the training step or ("forward" mode) of the inference forward."""
        gemms = self.gemms if mode == "step" else self.forward_gemms
        return next(g for g in gemms if g.layer == layer and g.role == role)

    def key(self, mode: str) -> table_format.StackKey:
        """The stack's entry in the decision tables for `mode` ("step" or "forward")."""
        return stack_key(self.stack, self.rows, self.widths, self.dtype, mode)


def stack_key(stack: Stack, rows: int, widths, dtype, mode: str) -> table_format.StackKey:
    """A stack's entry in the decision tables for `mode` ("step" or "forward")."""
    return table_format.make_stack_key(dtype, rows, widths,
                                   [layer.activation for layer in stack.layers],
                                   [layer.has_bias for layer in stack.layers], mode)


def left_to_auto(stack: Stack) -> bool:
    return stack.forward == "auto" and stack.backward == "auto"


def _measured(ctx: Context, plan_key: table_format.StackKey, stack: Stack) -> Optional[Choice]:
    """The stack's nearest measured entry for its mode, where the tables decide: none for a
    stack that asked for a backend, nor under the override (its GEMMs then run as asked)."""
    if not left_to_auto(stack) or ctx.override() is not None:
        return None
    decision = ctx.stack_table(plan_key)
    if decision is None:
        return None
    return Choice(decision.choice, f"stack entry ({describe(decision)})")


def plan_stack(ctx: Context, stack: Stack, rows: int, widths, dtype, fp8=None,
               has_state: bool = False) -> StackPlan:
    """The plan of a stack on `rows` rows (`widths`: K of the first layer, then each layer's
    N) in the computation dtype `dtype`, under the `Fp8` config `fp8` (or None), whose
    `scaling="auto"` is resolved here (`Fp8.resolved`) from whether the layers were given a
    state (`has_state`): the plan carries the resolved config.

    The training step is the plain expression under JAX's autodiff on a CUDA GPU where the
    stack's measured entry chose it, or, without an entry, where every GEMM of the step runs
    XLA's way (the plain expression is then exactly what XLA makes of a user's own); the
    inference forward follows its own entry where it has one, else the step. Elsewhere (no
    CUDA GPU: the reference runs, the same code whichever path) the fused stack."""
    widths = tuple(int(w) for w in widths)
    dtype = np.dtype(dtype).name
    fp8 = None if fp8 is None else fp8.resolved(has_state)
    layer_plans = _layer_plans(ctx, stack, fp8, rows, widths, dtype)
    on_gpu = ctx.tables_decide()
    gemms = stack_gemms(stack, layer_plans, rows, widths, dtype, fp8, "step", ctx.override)
    forward_gemms = stack_gemms(stack, layer_plans, rows, widths, dtype, fp8, "forward",
                                ctx.override)
    partial = StackPlan(stack, rows, widths, dtype, fp8, layer_plans, Choice("fused", ""),
                        Choice("fused", ""), gemms, forward_gemms)
    if on_gpu:
        gemms, forward_gemms = on_cuda(ctx, gemms, dtype), on_cuda(ctx, forward_gemms, dtype)
    if any(lp.fp8 for lp in layer_plans):
        why = "FP8 layers: one FP8 custom VJP over the stack"
        return partial._replace(step=Choice("fp8", why), inference=Choice("fp8", why),
                                gemms=gemms, forward_gemms=forward_gemms)
    if not on_gpu:
        step = Choice("fused", "not a CUDA GPU with the library: the fused stack, whose GEMMs "
                               "run the reference here")
        inference = step
    else:
        step = _measured(ctx, partial.key("step"), stack)
        if step is None:
            plain = all(g.backend == "xla" for g in gemms)
            step = Choice("plain", "every GEMM of the step runs XLA's way") if plain else \
                Choice("fused", "no stack entry, and a GEMM runs cuBLASLt")
        inference = _measured(ctx, partial.key("forward"), stack) or \
            Choice(step.choice, "as the training step (no inference entry)")
    return partial._replace(stack=stack._replace(inference=inference.choice), step=step,
                            inference=inference, gemms=gemms, forward_gemms=forward_gemms)
