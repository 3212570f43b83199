"""The bias of a stock layer chosen by `fp8_training` in its FP8 GEMM's epilog
(`fp8_dot_general(bias=)`, `stock_training.fused_forward`): against the unfused route (the
same FP8 product, the bias added after it), on random inputs at odd shapes.

The arithmetic of the two differs in one place only: the fused bias is added to the float32
product before it is rounded once (XLA may contract that into one multiply-add), where the
unfused route rounds the product to the compute dtype and adds the bias then. So the results
agree within one rounding of the compute dtype; with the output gradient fixed, the data and
weight gradients (the same GEMMs on the same FP8 operands) are equal bit for bit, the FP8
state too, and the bias gradient (a float32 sum against XLA's own) is close.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.layers import stock_training
from jax_epilog.layers.stock_fp8 import fp8_dot_general
from jax_epilog.op.epilogs import Epilog
from stock_models import Scanned  # tests/support

ALL = Fp8(layers="all", scaling="current")
DENSE = (((1,), (0,)), ((), ()))
#: One rounding of the compute dtype (relative to the result's largest value).
ROUNDING = {jnp.float32: 2e-6, jnp.bfloat16: 2**-7}


def _random(seed, *shapes, dtype=jnp.float32):
    """Normal values, the i-th array scaled by 1 + i (NumPy's generator: jax.random would
    compile for every shape)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32) * (1 + i), dtype)
            for i, s in enumerate(shapes)]


def _close(got, want, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


def _equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _epilogs(fn, *args) -> list[int]:
    return [int(e) for e in re.findall(r"epilog=(\d+)", str(jax.make_jaxpr(fn)(*args)))]


@pytest.fixture
def unfused(monkeypatch):
    """Within the test, after calling it: `fp8_training` takes no layer whole (the route
    before the bias was fused: the layer's own call with the FP8 op, the bias after)."""
    return lambda: monkeypatch.setattr(stock_training, "whole_layer", lambda *a, **k: False)


# --- the product with its bias ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(127, 33, 129), (1, 16, 17)])
def test_bias_in_the_epilog_is_the_product_plus_bias_rounded_once(dtype, m, k, n):
    x, w, b, dy = _random(1, (m, k), (k, n), (n,), (m, n), dtype=dtype)

    def step(fused):
        def f(x, w, b):
            if fused:
                return fp8_dot_general(x, w, DENSE, fp8=ALL, bias=b)
            return fp8_dot_general(x, w, DENSE, fp8=ALL) + b
        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))

    (y, dx, dw, db), (y0, dx0, dw0, db0) = jax.jit(step, static_argnums=0)(True), \
        jax.jit(step, static_argnums=0)(False)
    assert y.dtype == dtype and db.dtype == dtype
    _close(y, y0, ROUNDING[dtype])
    _equal((dx, dw), (dx0, dw0))
    _close(db, db0, ROUNDING[dtype])
    np.testing.assert_allclose(np.float64(db), np.sum(np.float64(dy), 0),
                               rtol=ROUNDING[dtype], atol=ROUNDING[dtype] * m)
    forward, *backward = _epilogs(lambda x, w, b: jax.grad(
        lambda x, w, b: jnp.sum(fp8_dot_general(x, w, DENSE, fp8=ALL, bias=b) * dy),
        argnums=(0, 1, 2))(x, w, b), x, w, b)
    assert forward == Epilog.BIAS and backward == [Epilog.DEFAULT, Epilog.DEFAULT]


def test_a_batched_product_adds_its_bias_after_the_gemm_and_shapes_are_checked():
    x, w, b = _random(2, (3, 5, 16), (3, 16, 2, 7), (2, 7))
    dn = (((2,), (1,)), ((0,), (0,)))
    both = jax.jit(lambda x, w, b: (fp8_dot_general(x, w, dn, fp8=ALL, bias=b),
                                    fp8_dot_general(x, w, dn, fp8=ALL) + b,
                                    fp8_dot_general(x, w, dn, fp8=ALL, bias=b.reshape(-1))))
    y, unfused, flat = both(x, w, b)
    _equal(y, unfused)
    _equal(flat, y)
    with pytest.raises(ValueError, match=r"up: bias: expected shape \(2, 7\) or \(14,\)"):
        fp8_dot_general(x, w, dn, fp8=ALL, bias=b.T, name="up")


# --- whole layers through fp8_training ----------------------------------------------------------

class _Linen(nn.Module):
    """Dense, DenseGeneral over two dims, Einsum with a bias (and one bias-less Dense)."""

    dtype: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(33, name="up", dtype=self.dtype)(x))
        h = nn.DenseGeneral((3, 16), name="split", dtype=self.dtype)(h)
        h = nn.Einsum((3, 16, 17), "bthd,hdn->btn", name="merge", dtype=self.dtype)(h)
        return nn.Dense(9, use_bias=False, name="out", dtype=self.dtype)(h)


class _Nnx(nnx.Module):
    def __init__(self, rngs, dtype=None):
        self.up = nnx.Linear(20, 33, dtype=dtype, rngs=rngs)
        self.split = nnx.LinearGeneral(33, (3, 16), dtype=dtype, rngs=rngs)
        self.merge = nnx.Einsum("bthd,hdn->btn", (3, 16, 17), (17,), dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(17, 9, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(self.merge(self.split(nnx.relu(self.up(x)))))


@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow),
                                   jnp.bfloat16])
def test_linen_layers_with_a_bias_run_whole_and_match_the_unfused_route(dtype, unfused):
    x, = _random(3, (2, 7, 20))
    dy, = _random(4, (2, 7, 9), dtype=dtype)
    variables = _Linen(dtype).init(jax.random.key(0), x)
    trained = jax_epilog.linen.fp8_training(_Linen(dtype), fp8=ALL)

    def step(v):
        y, vjp = jax.vjp(lambda v: trained.apply(v, x), v)
        return y, vjp(dy)[0]

    # Forward: three BIAS epilogs and the bias-less layer's plain GEMM.
    assert _epilogs(lambda v: trained.apply(v, x), variables) == [Epilog.BIAS] * 3 + \
        [Epilog.DEFAULT]
    fused = jax.jit(step)(variables)
    unfused()
    plain = jax.jit(step)(variables)
    assert _epilogs(lambda v: trained.apply(v, x), variables) == [Epilog.DEFAULT] * 4
    _close(fused[0], plain[0], 8 * ROUNDING[dtype])  # three layers' roundings, propagated
    _close(fused[1], plain[1], 8 * ROUNDING[dtype] if dtype == jnp.bfloat16 else 1e-5)


def test_an_nnx_linear_with_a_bias_runs_whole_under_its_own_class(unfused):
    x, = _random(11, (3, 7, 20))
    layer = nnx.Linear(20, 33, rngs=nnx.Rngs(0))
    trained = jax_epilog.nnx.fp8_training(layer, fp8=ALL)
    assert type(trained).__name__ == "TrainedLinear" and isinstance(trained, nnx.Linear)
    assert type(layer) is nnx.Linear  # the model itself is unchanged
    assert _epilogs(lambda x: trained(x), x) == [Epilog.BIAS]
    unfused()
    _close(trained(x), jax_epilog.nnx.fp8_training(layer, fp8=ALL)(x), ROUNDING[jnp.float32])


@pytest.mark.slow
def test_nnx_layers_with_a_bias_run_whole_and_keep_delayed_state_as_the_unfused_route(
        unfused):
    x, dy = _random(5, (2, 7, 20), (2, 7, 9))
    model = _Nnx(nnx.Rngs(0))
    recipe = Fp8(layers="all")  # delayed scaling: the ops hold Flax's state in the model
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, jax_epilog.nnx.OverwriteWithGradient))

    def step(model):
        @nnx.jit
        def run(model):
            def loss(m):
                return jnp.sum(m(x) * dy)
            return nnx.grad(loss, argnums=diff)(model)
        grads = run(model)
        jax_epilog.nnx.overwrite_with_gradient(model, grads)
        return nnx.state(model), grads

    fused_model = jax_epilog.nnx.fp8_training(model, fp8=recipe)
    assert [type(m).__name__ for m in (fused_model.up, fused_model.split, fused_model.merge,
                                        fused_model.out)] == \
        ["TrainedLinear", "TrainedLinearGeneral", "TrainedEinsum", "Linear"]
    assert isinstance(fused_model.up, nnx.Linear) and fused_model.up.dot_general.name == "up"
    assert _epilogs(lambda x: fused_model(x), x) == [Epilog.BIAS] * 3 + [Epilog.DEFAULT]
    unfused()
    plain_model = jax_epilog.nnx.fp8_training(model, fp8=recipe)
    assert type(plain_model.up) is nnx.Linear
    for _ in range(2):  # the second step scales from the first one's histories
        (fused_state, fused_grads), (plain_state, plain_grads) = step(fused_model), \
            step(plain_model)
    state = lambda s: nnx.filter_state(s, jax_epilog.nnx.OverwriteWithGradient)
    assert len(jax.tree.leaves(state(fused_state))) == 6 * 4
    # The layers' inputs differ by the roundings of the layers before, so their amaxes and
    # everything after may move by as much.
    _close(state(fused_state), state(plain_state), 1e-5)
    _close(nnx.filter_state(fused_grads, nnx.Param), nnx.filter_state(plain_grads, nnx.Param),
           1e-5)


@pytest.mark.slow
def test_layers_stacked_by_vmap_and_run_by_scan_run_whole_one_slice_at_a_time(unfused):
    x, dy = _random(10, (5, 20), (5, 20))
    model = Scanned(nnx.Rngs(0))
    trained = jax_epilog.nnx.fp8_training(model, fp8=ALL)
    assert type(trained.layers).__name__ == "TrainedLinear"
    step = lambda m: (m(x), nnx.grad(lambda m: jnp.sum(m(x) * dy))(m))
    y, grads = step(trained)
    graphdef, state = nnx.split(trained)
    assert _epilogs(lambda s: nnx.merge(graphdef, s)(x), state) == [Epilog.BIAS]  # in the scan
    unfused()
    y0, grads0 = step(jax_epilog.nnx.fp8_training(model, fp8=ALL))
    _close(y, y0, 1e-5)
    _close(nnx.filter_state(grads, nnx.Param), nnx.filter_state(grads0, nnx.Param), 1e-5)


def test_a_layer_the_whole_route_cannot_take_runs_its_own_call_with_the_fp8_op():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.typed = nnx.Linear(16, 24, preferred_element_type=jnp.float32, rngs=rngs)
            self.batched = nnx.LinearGeneral(16, 24, batch_axis={0: 5}, rngs=rngs)

        def __call__(self, x):
            return self.typed(x) + self.batched(x)

    model = Model(nnx.Rngs(0))
    trained = jax_epilog.nnx.fp8_training(model, fp8=ALL)
    assert type(trained.typed) is nnx.Linear and type(trained.batched) is nnx.LinearGeneral
    x, = _random(6, (5, 16))
    assert _epilogs(lambda x: trained(x), x) == [Epilog.DEFAULT] * 2
    _close(trained(x), model(x), 2**-3)  # FP8 rounding of the 16-bit model


def test_a_linen_einsum_given_its_string_at_call_time_runs_its_own_call():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Einsum((16, 24), name="late")(x, "bd,df->bf")

    x, = _random(9, (5, 16))
    variables = Model().init(jax.random.key(0), x)
    trained = jax_epilog.linen.fp8_training(Model(), fp8=ALL)
    assert _epilogs(lambda v: trained.apply(v, x), variables) == [Epilog.DEFAULT]


def test_a_layer_that_cannot_run_fp8_names_its_path_through_the_whole_route():
    """Through the whole-layer route too, a layer computing in a dtype the FP8 GEMM does not
    read (here float8 itself) runs as its own product with a warning naming it, or raises
    strictly."""
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="proj", dtype=jnp.float8_e4m3fn)(x)

    x, = _random(7, (2, 5))
    variables = Model().init(jax.random.key(0), x)
    trained = jax_epilog.linen.fp8_training(Model(), fp8=ALL)
    with pytest.warns(jax_epilog.linen.Fp8FallbackWarning,
                      match=r"^proj \(float8_e4m3fn\[2, 5\] x float8_e4m3fn\[5, 3\]\) runs "
                            r"jax.lax.dot_general in its operands' dtype.*float8_e4m3fn"):
        y = trained.apply(variables, x)
    _equal(y.astype(jnp.float32), Model().apply(variables, x).astype(jnp.float32))
    strict = jax_epilog.linen.fp8_training(Model(), fp8=ALL, strict=True)
    with pytest.raises(ValueError, match=r"^proj \(float8_e4m3fn.*\): cannot run in FP8"):
        strict.apply(variables, x)


def test_the_keyword_route_sees_no_bias_and_adds_it_after():
    """`dot_general_cls=` is handed the product only: the bias stays an XLA add (use
    `fp8_training`, or this package's layers, to fuse it)."""
    x, = _random(8, (5, 16))
    layer = nn.Dense(24, dot_general_cls=lambda: jax_epilog.linen.Fp8DotGeneral(fp8=ALL))
    variables = layer.init(jax.random.key(0), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _epilogs(lambda v: layer.apply(v, x), variables) == [Epilog.DEFAULT]
        whole = jax_epilog.linen.fp8_training(nn.Dense(24), fp8=ALL)
        assert _epilogs(lambda v: whole.apply(v, x), variables) == [Epilog.BIAS]
