"""FP8 training in the layers on a CUDA device (Hopper or newer): `mlp(..., fp8=...)` must run
every GEMM of a training step as an FP8 GEMM (no reference fallback: no RuntimeWarning) and
compute what the CPU's exact model computes (`test_fp8_layers.model_stack`).

Hopper's FP8 accumulation is not float32-exact (~2e-4 of the largest value at K≈96 on random
data), and each scale comes from the amax of the previous layer's result, so on random data a
tiny difference can move later FP8 roundings by whole quanta. The tests therefore compare
bit for bit on `exact_stack`'s data (every quantization and sum exact: exact on any correct
device), and judge random data against the unquantized layer within FP8 bounds.

Every test here is marked `gpu` and skipped where JAX sees no CUDA device.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime import targets
from test_fp8_layers import (ALL, check_dense_within_fp8_rounding, close, exact_stack, leaves,
                             make_stack, model_stack, random_cotangent, run_stack, train_digits)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _layers_choose(monkeypatch):
    """These tests check the FP8 layers' own choice of kernel or XLA per GEMM (`backward=
    "fused"` where a test wants every GEMM on the kernel), not conftest's forced kernel."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)


def _gpu():
    return jax.devices("cuda")[0]


def _step(activation, backward="auto"):
    def step(x, params, dy):
        y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p, activation=activation, fp8=ALL,
                                                     backward=backward), x, params)
        return (y, *vjp(dy))
    return jax.jit(step)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_every_gemm_of_the_step_is_an_fp8_kernel(activation):
    """bf16 compute (FP8 GEMMs to bf16: what the H200 was measured to run), fused backward."""
    x, params = make_stack(0, (256, 512, 384, 128), lead=(1024,), dtype=np.float32)
    x, params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), (x, params))
    dy = jnp.ones((1024, 128), jnp.bfloat16)
    args = jax.device_put((x, params, dy), _gpu())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hlo = _step(activation, "fused").lower(*args).as_text()
    fell_back = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not fell_back, fell_back
    calls = [line for line in hlo.splitlines() if f"@{targets.MATMUL.name}" in line]
    fp8_calls = [line for line in calls if re.search(r"f8E(4M3FN|5M2)", line)]
    # 3 layers × (forward, weight gradient, data gradient)
    assert len(fp8_calls) == 9 == len(calls), calls
    assert all(np.all(np.isfinite(np.asarray(v, np.float32)))
               for v in jax.tree.leaves(_step(activation, "fused")(*args)))


@pytest.mark.parametrize("activation, xla_dots", [("relu", 0), ("gelu", 2)])
def test_auto_backward_runs_xla_fp8_gemms_for_the_derivatives(activation, xla_dots):
    """Under "auto" the data gradients through GELU are XLA's own GEMMs on the FP8 operands
    (a dot_general of f8 types, never a bf16 dot of dequantized values; which FP8 kernel XLA
    then runs, cuBLASLt's or its own, is XLA's choice), the rest our kernels. Through ReLU
    they are our plain FP8 kernels, the derivative (from the next layer's h8 > 0,
    `stack_plan.relu_from_next_input`) and the bias gradient XLA fusions."""
    x, params = make_stack(5, (256, 512, 384, 128), lead=(1024,), dtype=np.float32)
    x, params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), (x, params))
    args = jax.device_put((x, params, jnp.ones((1024, 128), jnp.bfloat16)), _gpu())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = _step(activation).lower(*args)
        compiled = lowered.compile()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    mixed = r"f8E5M2.*f8E4M3FN|f8E4M3FN.*f8E5M2"  # dZ8 (e5m2) with W8 (e4m3)
    fp8_dots = [line for line in lowered.as_text().splitlines()
                if "stablehlo.dot_general" in line and re.search(mixed, line)]
    assert len(fp8_dots) == xla_dots, fp8_dots
    assert compiled.as_text().count(f'custom_call_target="{targets.MATMUL.name}"') == \
        9 - xla_dots


def _no_fallback(fn, *args):
    """fn(*args) with every RuntimeWarning (a GEMM without an FP8 kernel) turned into a
    failure that names it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    fell_back = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not fell_back, fell_back
    return out


@pytest.mark.parametrize("dtype, backward", [(jnp.bfloat16, "auto"), (jnp.bfloat16, "fused"),
                                             (jnp.float32, "auto")])
@pytest.mark.parametrize("widths, rows", [((33, 129, 10), 127), ((64, 129, 48), 2)])
def test_exact_step_equals_the_model(widths, rows, dtype, backward):
    """Odd sizes (padded K and N), every GEMM of the step (kernels, and XLA's FP8 GEMMs where
    "auto" or float32 compute chooses them), on data where FP8 is exact: equal to the NumPy
    model bit for bit. A wrong scale, transpose, mask, bias or padding changes some value."""
    x, params, dy = exact_stack(1, widths, rows)
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)

    def step(x, params, dy):
        y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p, fp8=ALL, backward=backward),
                         x, params)
        return (y, *vjp(dy))

    args = jax.device_put((cast(x), cast(params), cast(dy)), _gpu())
    got = _no_fallback(jax.jit(step), *args)
    want = model_stack(x, params, ("relu", None), dy, [True, True], dtype=dtype)
    for g, w in zip(leaves(*got), leaves(*want)):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), w)


def test_dense_within_fp8_rounding_on_the_gpu():
    """Random data, float32 compute (XLA's FP8 GEMM to float32 for the bias epilog, the
    kernel for the weight gradient): within FP8's rounding bounds of the unquantized layer,
    plus 1e-3 of |x|@|W| for Hopper's FP8 accumulation (measured ~2e-4 at K≈96)."""
    x, [(kernel, bias)] = make_stack(5, (129, 127), lead=(31,))
    with jax.default_device(_gpu()):
        _no_fallback(check_dense_within_fp8_rounding, x, kernel, bias, 1e-3)


def test_bfloat16_step_is_as_close_to_unquantized_as_the_cpu():
    """Random data, bf16 compute, three layers: the GPU's FP8 step is not bit-equal to the
    CPU's (accumulation order moves FP8 roundings downstream), but it must be about as far
    from the unquantized (float32) step as the CPU's exact FP8 step is: at most twice the
    CPU's distance plus one bf16 rounding, per output and gradient."""
    x, params = make_stack(3, (128, 256, 256, 64), lead=(512,), dtype=np.float32)
    dy = random_cotangent(4, (512, 64))
    bf16 = lambda t: jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), t)
    step = _step("relu")
    on_gpu = _no_fallback(step, *jax.device_put((bf16(x), bf16(params), bf16(dy)), _gpu()))
    cpu = jax.devices("cpu")[0]
    on_cpu = step(*jax.device_put((bf16(x), bf16(params), bf16(dy)), cpu))
    with jax.default_device(cpu), jax.default_matmul_precision("float32"):
        y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p), jnp.asarray(x),
                         jax.tree.map(jnp.asarray, params))
        exact = (y, *vjp(jnp.asarray(dy)))
    for g, c, e in zip(jax.tree.leaves(on_gpu), jax.tree.leaves(on_cpu), jax.tree.leaves(exact)):
        cpu_error = close(np.asarray(c, np.float32), e, 1.0)
        close(np.asarray(g, np.float32), e, 2 * cpu_error + 2.0**-8)
    # FP8 ran on the CPU (y is more than a few bf16 roundings from the unquantized y)
    assert close(np.asarray(on_cpu[0], np.float32), exact[0], 1.0) > 2.0**-6


def test_fp8_training_converges_on_the_gpu():
    with jax.default_device(_gpu()):
        bf16_accuracy, _ = train_digits(None)
        fp8_accuracy, fp8_losses = train_digits(ALL)
    assert fp8_losses[-1] < fp8_losses[0] / 10
    assert fp8_accuracy >= bf16_accuracy - 0.01, (fp8_accuracy, bf16_accuracy)


@pytest.mark.parametrize("dtype, backward", [(jnp.bfloat16, "auto"), (jnp.bfloat16, "fused"),
                                             (jnp.float32, "auto")])
@pytest.mark.parametrize("widths, rows", [((33, 129, 10), 127), ((64, 129, 48), 2)])
def test_delayed_scaling_exact_steps_equal_the_model(widths, rows, dtype, backward):
    """Delayed scaling (`Fp8(scaling="delayed")`), two steps from a state warm at amax 7 (a
    cold history's GEMM-written tensors would take a power-of-two bound, not exact here):
    with bf16 compute the first GEMM writes the second layer's e4m3 input and its amax
    (cuBLASLt's FP8 result), all without a fallback, equal to the model bit for bit, and the
    next state records every amax (7)."""
    config = jax_epilog.Fp8(layers="all", scaling="delayed", amax_history_length=4)
    x, params, dy = exact_stack(2, widths, rows)
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)

    def step(x, params, dy, state):
        y, vjp = jax.vjp(lambda x, p, s: jax_epilog.mlp(x, p, fp8=config, fp8_state=s,
                                                        backward=backward), x, params, state)
        return (y, *vjp(dy))

    args = jax.device_put((cast(x), cast(params), cast(dy)), _gpu())
    state = tuple(h._replace(input=h.input.at[0].set(7.0), gradient=h.gradient.at[0].set(7.0))
                  for h in config.init_state(2))
    want = model_stack(x, params, ("relu", None), dy, [True, True], dtype=dtype)
    compiled = jax.jit(step)
    for t in range(2):
        *got, state = _no_fallback(compiled, *args, state)
        for g, w in zip(leaves(*got), leaves(*want)):
            assert g.dtype == dtype
            np.testing.assert_array_equal(np.asarray(g, np.float32), w)
        for history in state:
            np.testing.assert_array_equal(np.asarray(history.input)[:t + 2], 7.0)
            np.testing.assert_array_equal(np.asarray(history.gradient)[:t + 2], 7.0)
    hlo = compiled.lower(*args, state).as_text()
    if dtype == jnp.bfloat16:  # the first layer's GEMM writes e4m3 (cuBLASLt's FP8 result)
        assert re.search(r"jax_epilog_matmul[^\n]*-> \(tensor<[0-9x]+xf8E4M3FN>", hlo), hlo
