"""`jax_epilog.swiglu(..., fp8=...)` on a CUDA device (Hopper or newer): every GEMM of the
training step is an FP8 GEMM (no reference fallback), and the values and gradients are the
plain block's within FP8 rounding (Hopper's FP8 accumulation is not float32-exact, so random
data is judged against the unquantized block, as in test_fp8_layers_gpu.py).

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
from jax_epilog import Fp8
from jax_epilog.runtime import targets
from test_fp8_layers import close
from test_swiglu import grads, make_block, plain_block

pytestmark = pytest.mark.gpu
ALL = Fp8(layers="all")


@pytest.fixture(autouse=True)
def _block_chooses(monkeypatch):
    """The block's own choice of kernel or XLA per GEMM, not conftest's forced kernel."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)


def _on_gpu(*arrays):
    return jax.device_put(arrays, jax.devices("cuda")[0])


def _step(fp8):
    fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=fp8)
    return jax.jit(lambda x, g, u, w, dy: grads(fn, x, g, u, w, dy))


def test_every_gemm_of_the_fp8_step_is_an_fp8_gemm():
    """bf16 compute: 2 forward GEMMs (gate/up as one, down) and 4 backward, all FP8 custom
    calls or XLA FP8 dots, never a bf16 dot of dequantized values, no fallback."""
    args = _on_gpu(*(a.astype(jnp.bfloat16) for a in make_block(0, 1024, 256, 512)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = _step(ALL).lower(*args)
        compiled = lowered.compile()
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    hlo = lowered.as_text()
    ours = [line for line in hlo.splitlines() if f"@{targets.MATMUL.name}" in line]
    xla_fp8 = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line and
               re.search(r"f8E(4M3FN|5M2)", line)]
    bf16_dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line and
                 not re.search(r"f8E(4M3FN|5M2)", line)]
    assert len(ours) + len(xla_fp8) == 6 and not bf16_dots, (ours, xla_fp8, bf16_dots)
    assert all(re.search(r"f8E(4M3FN|5M2)", line) for line in ours)
    out = compiled(*args)
    assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in out)


@pytest.mark.parametrize("rows,d,f", [(1, 64, 96), (129, 48, 80), (1024, 256, 512)])
def test_fp8_step_is_the_plain_block_within_fp8_rounding(rows, d, f):
    args = _on_gpu(*make_block(1, rows, d, f))
    with jax.default_matmul_precision("float32"):
        got = _step(ALL)(*args)
        want = jax.jit(lambda x, g, u, w, dy: grads(plain_block, x, g, u, w, dy))(*args)
    for name, a, b in zip(("y", "dx", "dgate", "dup", "ddown"), got, want):
        assert close(a, b, 0.25) > 1e-4, name  # FP8, not a 16-bit path


def test_bf16_block_matches_the_plain_block():
    args = _on_gpu(*(a.astype(jnp.bfloat16) for a in make_block(2, 512, 128, 352)))
    got = _step(None)(*args)
    want = jax.jit(lambda x, g, u, w, dy: grads(plain_block, x, g, u, w, dy))(*args)
    for a, b in zip(got, want):
        close(a, b, 2e-2)


def test_linen_block_trains_under_delayed_scaling():
    from jax_epilog import linen as epilog_linen
    model = epilog_linen.SwiGLU(512, dtype=jnp.bfloat16, fp8=Fp8(layers="all"))
    x, = _on_gpu(jax.random.normal(jax.random.key(3), (4, 256, 256), jnp.bfloat16))
    variables = model.init(jax.random.key(0), x)
    step = jax.jit(jax.value_and_grad(
        lambda v: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)))
    for _ in range(3):
        loss, g = step(variables)
        variables = {**variables, epilog_linen.FP8_COLLECTION: g[epilog_linen.FP8_COLLECTION]}
    assert np.isfinite(float(loss))
    assert all(int(np.count_nonzero(h)) == 3
               for h in jax.tree.leaves(variables[epilog_linen.FP8_COLLECTION]))


def test_fp8_step_holds_no_more_temporaries_than_the_bf16_block():
    """The compiled FP8 training step's temporaries (XLA's memory analysis) at the benchmark's
    S1 shape are at most the 16-bit block's: the backward keeps FP8 residuals, so XLA must
    not keep the forward's 16-bit [g u] alive for the backward's fusions (it did, 864 MiB
    against 576 MiB on the H200, until the forward's casts were put behind a barrier)."""
    x = jax.ShapeDtypeStruct((8192, 2048), jnp.bfloat16)
    kernels = (jax.ShapeDtypeStruct((2048, 16384), jnp.float32),
               jax.ShapeDtypeStruct((8192, 2048), jnp.float32))
    cuda = jax.sharding.SingleDeviceSharding(jax.devices("cuda")[0])

    def temporaries(fp8):
        loss = lambda x, gu, down: jnp.mean(jax_epilog.swiglu(
            x, gu, down, dtype=jnp.bfloat16, fp8=fp8).astype(jnp.float32) ** 2)
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=cuda)
        return step.lower(x, *kernels).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(ALL) <= temporaries(None)
