"""FP8 training in the layers on a CUDA device (Hopper or newer): `mlp(..., fp8=...)` must run
every GEMM of a training step as an FP8 cuBLASLt custom call (no reference fallback) and
compute what the CPU's exact model computes (`test_fp8_layers.model_stack`).

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
from jax_epilog import cuda_library
from test_fp8_layers import (ALL, close, leaves, make_stack, model_stack, random_cotangent,
                             run_stack, train_digits)

pytestmark = pytest.mark.gpu


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
    calls = [line for line in hlo.splitlines() if f"@{cuda_library.TARGET_NAME}" in line]
    fp8_calls = [line for line in calls if re.search(r"f8E(4M3FN|5M2)", line)]
    # 3 layers × (forward, weight gradient, data gradient)
    assert len(fp8_calls) == 9 == len(calls), calls
    assert all(np.all(np.isfinite(np.asarray(v, np.float32)))
               for v in jax.tree.leaves(_step(activation, "fused")(*args)))


def test_auto_backward_runs_xla_fp8_gemms_for_the_derivatives(monkeypatch):
    """Under "auto" the data gradients through ReLU are XLA's own FP8 GEMMs (cuBLASLt's
    `__cublas$lt$matmul$f8`, never a bf16 dot of dequantized values), the rest our kernels."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)  # conftest's, for the kernel tests
    x, params = make_stack(5, (256, 512, 384, 128), lead=(1024,), dtype=np.float32)
    x, params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), (x, params))
    args = jax.device_put((x, params, jnp.ones((1024, 128), jnp.bfloat16)), _gpu())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _step("relu").lower(*args).compile()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    hlo = compiled.as_text()
    assert hlo.count("__cublas$lt$matmul$f8") == 2, hlo.count("__cublas$lt$matmul$f8")
    assert hlo.count(f'custom_call_target="{cuda_library.TARGET_NAME}"') == 7


@pytest.mark.parametrize("widths, lead", [((64, 129, 48, 10), (127,)), ((32, 64, 1), (1,))])
def test_float32_step_matches_the_model(widths, lead):
    """Odd sizes (padded K and N), float32 results (the kernel, or the reference where
    cuBLASLt has no FP32-result FP8 kernel: the values are checked either way) against the
    NumPy model."""
    x, params = make_stack(1, widths, lead=lead)
    dy = random_cotangent(2, (*lead, widths[-1]))
    activations = ("relu",) * (len(widths) - 2) + (None,)
    with jax.default_device(_gpu()), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = run_stack(x, params, activations, dy, ALL)
    want = model_stack(np.asarray(x), params, activations, dy, [True] * (len(widths) - 1))
    for g, w in zip(leaves(*got), leaves(*want)):
        close(g, w, 1e-4)  # float32 sums in the kernel's order


def test_bfloat16_step_matches_the_cpu():
    x, params = make_stack(3, (128, 256, 256, 64), lead=(512,), dtype=np.float32)
    x, params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), (x, params))
    dy = jnp.asarray(random_cotangent(4, (512, 64)), jnp.bfloat16)
    step = _step("relu")
    on_gpu = step(*jax.device_put((x, params, dy), _gpu()))
    on_cpu = step(*jax.device_put((x, params, dy), jax.devices("cpu")[0]))
    for g, c in zip(jax.tree.leaves(on_gpu), jax.tree.leaves(on_cpu)):
        # bf16 roundings of float32 sums taken in another order may move a value across an
        # FP8 rounding boundary downstream: a few FP8 quanta of the largest value at most.
        close(np.asarray(g, np.float32), np.asarray(c, np.float32), 3e-2)


def test_fp8_training_converges_on_the_gpu():
    with jax.default_device(_gpu()):
        bf16_accuracy, _ = train_digits(None)
        fp8_accuracy, fp8_losses = train_digits(ALL)
    assert fp8_losses[-1] < fp8_losses[0] / 10
    assert fp8_accuracy >= bf16_accuracy - 0.01, (fp8_accuracy, bf16_accuracy)
