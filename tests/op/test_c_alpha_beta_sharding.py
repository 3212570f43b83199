"""`matmul(a, b, c, alpha=, beta=)` sharded (SPEC §6): c splits like y (batch, M, N); with K
sharded, beta · c is added once, after the psum. Values and gradients against the unsharded
call; no gathered operands.

Needs several devices: `test_c_alpha_beta.py` runs this file in its own pytest process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`. Skips itself with fewer than 2 devices.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_epilog

DEVICES = jax.devices()
if len(DEVICES) < 2:
    pytest.skip(f"needs at least 2 devices, sees {len(DEVICES)}", allow_module_level=True)

MESH = jax.sharding.Mesh(np.array(DEVICES), ("x",))
M, K, N = 64, 96, 256
# x spec, W spec, c spec (c like y)
LAYOUTS = {
    "data": (P("x", None), P(), P("x", None)),
    "column": (P(), P(None, "x"), P(None, "x")),
    "row": (P(None, "x"), P("x", None), P()),
}
TOL = dict(rtol=2e-5, atol=2e-4)


def _data(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.float32)
    c = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    return x, w, c, bias


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("epilog", ["default", "relu_bias", "gelu_aux_bias"])
def test_value_and_grad(layout, epilog):
    x, w, c, bias = _data(len(layout) + len(epilog))
    specs = LAYOUTS[layout]
    inputs_of = (lambda b: {"bias": b}) if "bias" in epilog else (lambda b: None)

    def loss(x, w, c, bias, alpha, beta):
        out = jax_epilog.matmul(x, w, c, alpha=alpha, beta=beta, epilog=epilog,
                                epilog_inputs=inputs_of(bias), precision="highest")
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(y)), y

    args = (x, w, c, bias, jnp.float32(0.5), jnp.float32(2.0))
    shardings = tuple(NamedSharding(MESH, s) for s in specs) + (NamedSharding(MESH, P()),) * 3
    placed = [jax.device_put(v, s) for v, s in zip(args, shardings)]
    f = jax.value_and_grad(loss, argnums=range(6), has_aux=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        (got_l, got_y), got_g = jax.jit(f)(*placed)
        (want_l, want_y), want_g = f(*args)
        forward = jax.jit(lambda *a: loss(*a)[1]).lower(*placed).compile().as_text()
    np.testing.assert_allclose(got_y, want_y, **TOL)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-4)
    for g, wg in zip(got_g, want_g):
        np.testing.assert_allclose(g, wg, rtol=2e-4, atol=2e-3)
    if layout in ("data", "column"):  # local GEMMs, no gathered operand
        assert "all-gather" not in forward


def test_row_parallel_adds_c_once():
    x, w, c, _ = _data(1)
    placed = [jax.device_put(v, NamedSharding(MESH, s))
              for v, s in zip((x, w, c), (P(None, "x"), P("x", None), P()))]
    f = jax.jit(lambda x, w, c: jax_epilog.matmul(x, w, c, beta=1.0, precision="highest"))
    np.testing.assert_allclose(f(*placed), np.asarray(x) @ np.asarray(w) + np.asarray(c), **TOL)
