"""`jax_epilog.serve_fp8`: stock Flax models (nnx.Linear/LinearGeneral/Einsum, linen.Dense/
DenseGeneral/Einsum) served in FP8 by one call, their code unchanged.

Each served output is checked two ways: against the 16-bit model (close within FP8's
rounding), and against this package's own served layers on the same stored weights (the
same `Fp8Weight`, the same `jax_epilog.dense` call: equal).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import jax_epilog  # noqa: E402
import jax_epilog.linen  # noqa: E402
import jax_epilog.nnx  # noqa: E402
from jax_epilog.float8.weights import Fp8Weight, quantize_weight  # noqa: E402
from jax_epilog.layers.stock_serving import ServeRule, StockServingWarning  # noqa: E402
from stock_models import Scanned  # noqa: E402  (tests/support)

#: FP8's error on these random layers (e4m3 keeps 3 mantissa bits; K up to 60 terms), as a
#: share of the output's largest value.
FP8_TOLERANCE = 0.08


@pytest.fixture(autouse=True)
def _default_ways(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")  # the rows choose the way


def random(key, shape, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(key), shape) * scale).astype(dtype)


def assert_fp8_close(y, want):
    y, want = np.asarray(y, np.float64), np.asarray(want, np.float64)
    assert y.shape == want.shape
    error = np.max(np.abs(y - want))
    assert error <= FP8_TOLERANCE * np.max(np.abs(want)), error
    assert error > 0  # FP8 ran: a 16-bit layer would match exactly


class Mixed(nnx.Module):
    """Linear (odd features), LinearGeneral over two input dims to two output dims, and an
    Einsum whose output is laid out heads-first (a transposed result)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(44, 60, rngs=rngs)
        self.general = nnx.LinearGeneral((6, 10), (3, 7), axis=(-2, -1), rngs=rngs)
        self.heads = nnx.Einsum("btd,dnh->bnth", (21, 3, 5), (3, 5), rngs=rngs)
        for i, layer in enumerate((self.up, self.general, self.heads)):  # not zeros: checked
            layer.bias[...] = random(20 + i, layer.bias.shape, 0.5)

    def __call__(self, x):
        b, t, _ = x.shape
        h = jax.nn.gelu(self.up(x)).reshape(b, t, 6, 10)
        return self.heads(self.general(h).reshape(b, t, 21))


def test_nnx_model_serves_every_layer_kind_close_to_16_bit_and_leaves_the_model_alone():
    model = Mixed(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    served = jax_epilog.serve_fp8(model, rules=".*")
    x = random(1, (2, 5, 44))
    assert_fp8_close(served(x), model(x))
    assert type(served.up).__name__ == "ServedLinear" and isinstance(served.up, nnx.Linear)
    assert isinstance(served.heads, nnx.Einsum) and type(model.up) is nnx.Linear
    stored = {name: getattr(served, name).kernel.get_value() for name in ("up", "general", "heads")}
    assert {name: (type(w), w.shape) for name, w in stored.items()} == {
        "up": (Fp8Weight, (44, 60)), "general": (Fp8Weight, (60, 21)),
        "heads": (Fp8Weight, (21, 15))}
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray,
                                                                      nnx.state(model)))


@pytest.mark.parametrize("rows", [1, 127, 129])
def test_nnx_linear_equals_our_dense_on_the_same_stored_weight(rows):
    """Weight-only at 1 and 127... rows up to 64, our FP8 GEMM above: each the same call."""
    stock = nnx.Linear(44, 60, rngs=nnx.Rngs(0))
    ours = jax_epilog.nnx.Dense(44, 60, rngs=nnx.Rngs(0))
    nnx.update(ours, jax_epilog.quantize_params(nnx.state(ours, nnx.Param),
                                                include=lambda p, x: x.ndim == 2))
    served = jax_epilog.serve_fp8(stock, rules=".*")
    x = random(2, (rows, 44))
    np.testing.assert_array_equal(served(x), ours(x))
    assert_fp8_close(served(x), stock(x))


def test_linear_general_with_two_contracting_dims_is_the_flattened_gemm():
    layer = nnx.LinearGeneral((6, 10), (3, 7), axis=(1, 2), rngs=nnx.Rngs(0))
    served = jax_epilog.serve_fp8(layer, rules=".*")
    x = random(3, (4, 6, 10))
    weight = quantize_weight(layer.kernel[...].reshape(60, 21))
    want = jax_epilog.dense(x.reshape(4, 60), weight, layer.bias[...].reshape(21))
    np.testing.assert_array_equal(served(x), want.reshape(4, 3, 7))
    assert_fp8_close(served(x), layer(x))


def test_einsum_contracting_the_kernels_middle_dim_and_an_ellipsis():
    """Kernel `ndf` contracts its middle dim (stored transposed); `...` takes any leading
    dims; the bias (in the output's order) is the GEMM's."""
    layer = nnx.Einsum("...d,ndf->...nf", (3, 20, 9), (3, 9), rngs=nnx.Rngs(0))
    layer.bias[...] = random(4, (3, 9))
    served = jax_epilog.serve_fp8(layer, rules=".*")
    x = random(5, (2, 3, 20))
    weight = quantize_weight(jnp.transpose(layer.kernel[...], (1, 0, 2)).reshape(20, 27))
    want = jax_epilog.dense(x.reshape(6, 20), weight, layer.bias[...].reshape(27))
    np.testing.assert_array_equal(served(x), want.reshape(2, 3, 3, 9))
    assert_fp8_close(served(x), layer(x))


class Stack(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = linen.Dense(60, name="up")(x)
        b, t, _ = x.shape
        h = linen.DenseGeneral((3, 7), axis=(-2, -1), name="general")(h.reshape(b, t, 6, 10))
        return linen.Einsum((21, 3, 5), "btd,dnh->bnth", name="heads")(h.reshape(b, t, 21))


def with_random_biases(variables):
    """Linen `variables` with every bias drawn (not zeros, so that a bias served in the wrong
    order or dropped shows)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: random(len(path) + leaf.size, leaf.shape, 0.5)
        if getattr(path[-1], "key", None) == "bias" else leaf, variables)


@pytest.mark.parametrize("rows", [1, 129])
def test_linen_module_serves_by_one_call_and_under_jit(rows):
    x = random(6, (rows, 1, 44))
    variables = with_random_biases(Stack().init(jax.random.key(0), x))
    served, stored = jax_epilog.serve_fp8(Stack(), variables, x, rules=".*")
    assert all(isinstance(stored["params"][name]["kernel"], Fp8Weight)
               for name in ("up", "general", "heads"))
    y = served.apply(stored, x)
    assert_fp8_close(y, Stack().apply(variables, x))
    # jitted, XLA may contract the scale and bias into one multiply-add: rounding apart
    np.testing.assert_allclose(jax.jit(served.apply)(stored, x), y, rtol=1e-6, atol=1e-6)


def test_linen_dense_equals_our_linen_dense_on_the_same_stored_weight():
    x = random(7, (129, 44))
    variables = with_random_biases(linen.Dense(60).init(jax.random.key(0), x))
    served, stored = jax_epilog.serve_fp8(linen.Dense(60), variables["params"], x, rules=".*")
    ours = jax_epilog.linen.Dense(60).apply({"params": stored}, x)
    np.testing.assert_array_equal(served.apply({"params": stored}, x), ours)


def test_intercepted_serves_a_served_module_inside_a_larger_one():
    x = random(8, (3, 44))
    variables = linen.Dense(60).init(jax.random.key(0), x)
    _, stored = jax_epilog.serve_fp8(linen.Dense(60), variables, x, rules=".*")
    from jax_epilog.layers.stock_serving import intercepted
    with intercepted():
        y = linen.Dense(60).apply(stored, x)
    assert_fp8_close(y, linen.Dense(60).apply(variables, x))


def test_rules_choose_by_path_first_match_and_size():
    model = Mixed(nnx.Rngs(0))
    served = jax_epilog.serve_fp8(model, rules=[ServeRule("general", serve=False),
                                                ServeRule("up|general"),
                                                ServeRule("heads", min_features=16)])
    assert [type(m).__name__ for m in (served.up, served.general, served.heads)] == \
        ["ServedLinear", "LinearGeneral", "Einsum"]  # heads: N 15 < 16
    # the default rule: K and N both at least MIN_FEATURES (512), so none here, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        default = jax_epilog.serve_fp8(model)
    assert type(default.up) is nnx.Linear


class Doubled(nnx.Linear):
    """A user's layer on top of a stock one: its call is its own."""

    def __call__(self, x):
        return 2 * super().__call__(x)


class Unservable(nnx.Module):
    """Layers the route cannot take: batched weights, a batch-dim einsum, a custom product, a
    subclass with its own call."""

    def __init__(self, rngs):
        self.doubled = Doubled(8, 8, rngs=rngs)
        self.batched = nnx.LinearGeneral(8, 4, batch_axis={0: 2}, rngs=rngs)
        self.per_head = nnx.Einsum("bhd,hdf->bhf", (2, 8, 4), rngs=rngs)
        self.custom = nnx.Linear(8, 8, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                                 rngs=rngs)
        self.fine = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return (self.batched(x), self.per_head(x), self.custom(x), self.doubled(x),
                self.fine(x))


def test_layers_the_route_cannot_take_stay_16_bit_with_a_warning_naming_them():
    model = Unservable(nnx.Rngs(0))
    with pytest.warns(StockServingWarning) as caught:
        served = jax_epilog.serve_fp8(model, rules=".*")
    messages = "\n".join(str(w.message) for w in caught)
    for path, why in (("batched", "batch dims"), ("per_head", "batch dims"),
                      ("custom", "custom dot_general"),
                      ("doubled", "overrides Linear.__call__")):
        assert re.search(rf"^{path} stays 16-bit: .*{why}", messages, re.M), messages
    assert type(served.fine).__name__ == "ServedLinear"
    x = random(9, (2, 2, 8))
    for got, want in zip(served(x)[:4], model(x)[:4]):
        np.testing.assert_array_equal(got, want)  # exactly the 16-bit layers


@pytest.mark.parametrize("rules,strict", [("per_head", False), (".*", True)])
def test_a_layer_asked_for_explicitly_raises_naming_it(rules, strict):
    with pytest.raises(ValueError, match=r"^(batched|per_head): cannot be served in FP8: "
                                         r".*batch dims"):
        jax_epilog.serve_fp8(Unservable(nnx.Rngs(0)), rules=rules, strict=strict)


def test_bad_rules_and_arguments_are_named():
    model = Mixed(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'upp' names no stock dense layer .*general, heads"):
        jax_epilog.serve_fp8(model, rules="upp")
    with pytest.raises(ValueError, match=r"module_path: '\(' is not a regex"):
        ServeRule("(")
    with pytest.raises(TypeError, match="rules"):
        jax_epilog.serve_fp8(model, rules=[3])
    with pytest.raises(TypeError, match="takes its variables and sample inputs"):
        jax_epilog.serve_fp8(linen.Dense(4))
    with pytest.raises(TypeError, match="model: expected a flax"):
        jax_epilog.serve_fp8(object())
    with pytest.raises(ValueError, match="granularity: expected one of"):
        jax_epilog.serve_fp8(model, granularity="row")
    with pytest.raises(ValueError, match="dtype"):
        jax_epilog.serve_fp8(model, dtype="int8")


def test_linen_unservable_layer_warns_with_its_path_and_stays_16_bit():
    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            y = linen.DenseGeneral(4, batch_dims=(0,), name="batched")(x)
            return y + linen.Dense(4, name="plain")(x)

    x = random(10, (2, 3, 8))
    variables = Model().init(jax.random.key(0), x)
    with pytest.warns(StockServingWarning, match=r"^batched stays 16-bit: batch dims"):
        served, stored = jax_epilog.serve_fp8(Model(), variables, x, rules=".*")
    assert not isinstance(stored["params"]["batched"]["kernel"], Fp8Weight)
    assert isinstance(stored["params"]["plain"]["kernel"], Fp8Weight)
    assert_fp8_close(served.apply(stored, x), Model().apply(variables, x))


def test_served_calls_name_their_layer_on_a_wrong_input():
    served = jax_epilog.serve_fp8(nnx.Linear(44, 60, rngs=nnx.Rngs(0)), rules=".*")
    with pytest.raises(ValueError, match=r"^\(the model itself\): the stored FP8 kernel is "
                                         r"\(K, N\) = \(44, 60\)"):
        served(random(0, (2, 40)))
    model = Mixed(nnx.Rngs(0))
    served = jax_epilog.serve_fp8(model, rules=".*")
    with pytest.raises(ValueError, match=r"^heads: called with einsum"):
        served.heads(random(0, (2, 5, 21)), "btd,dnh->btnh")


def test_nnx_jit_and_calibrate_run_the_served_model():
    model = Mixed(nnx.Rngs(0))
    served = jax_epilog.serve_fp8(model, rules=".*")
    x = random(11, (2, 5, 44))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(served, x), served(x), rtol=1e-6,
                               atol=1e-7)
    graphdef, params, rest = nnx.split(served, nnx.Param, ...)
    params = jax_epilog.calibrate(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, [x])
    nnx.update(served, params)
    assert served.up.kernel.get_value().input_scale is not None
    assert_fp8_close(served(x), model(x))
    with pytest.raises(TypeError, match="inference only"):
        jax.grad(lambda x: served(x).sum())(x)


def test_the_example_stock_gpt_serves_by_one_call_its_code_unchanged():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from gpt import model as gpt
    config = gpt.ModelConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16, vocab_size=64,
                             arch="llama", tie_head=False, n_kv_heads=1)
    model = gpt.GPT(config, impl="stock", attention="xla", rngs=nnx.Rngs(0))
    served = jax_epilog.serve_fp8(model, rules=ServeRule(r"blocks/\d+/.*"))
    names = sorted(type(m).__name__ for _, m in nnx.iter_modules(served)
                   if isinstance(m, nnx.Linear))
    assert names == ["Linear"] + ["ServedLinear"] * 5  # the head stays 16-bit
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)
    logits = np.asarray(served(tokens))
    # 18 rows: weight-only, so the served model is the stock one with the stored kernels
    # dequantized; FP8's rounding of them moves its logits by a few percent
    rounded = nnx.clone(model)
    for (_, layer), (_, stored) in zip(nnx.iter_modules(rounded), nnx.iter_modules(served)):
        if isinstance(stored, nnx.Linear) and isinstance(stored.kernel.get_value(), Fp8Weight):
            weight = stored.kernel.get_value()
            layer.kernel[...] = (weight.data.astype(jnp.float32) * weight.scale).T
    np.testing.assert_allclose(logits, rounded(tokens), rtol=2e-5, atol=2e-5)
    want = np.asarray(model(tokens))
    assert 0 < np.linalg.norm(logits - want) / np.linalg.norm(want) < 0.15


def dequantized(weight: Fp8Weight, shape):
    """A stored (possibly stacked) weight as the 16-bit kernel it rounds: `scale · dataᵀ`."""
    data = jnp.swapaxes(weight.data.astype(jnp.float32), -1, -2)
    return (data * jnp.asarray(weight.scale)[..., None, None]).reshape(shape)


def test_layers_stacked_by_scan_are_stored_slice_by_slice_nnx_and_linen():
    """Each layer's slice its own weight and scale; weight-only (5 rows) the served model is
    the stock one with the stored kernels dequantized."""
    x = random(12, (5, 20))
    model = Scanned(nnx.Rngs(0))
    served = jax_epilog.serve_fp8(model, rules="layers")
    weight = served.layers.kernel.get_value()
    assert (weight.data.shape, weight.scale.shape) == ((3, 20, 20), (3,))
    rounded = nnx.clone(model)
    rounded.layers.kernel[...] = dequantized(weight, (3, 20, 20))
    np.testing.assert_allclose(served(x), rounded(x), rtol=1e-5, atol=1e-5)
    assert_fp8_close(served(x), model(x))

    class Body(linen.Module):
        @linen.compact
        def __call__(self, x, _):
            return x + jnp.tanh(linen.Dense(20, name="layer")(x)), None

    class Stack(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.scan(Body, variable_axes={"params": 0}, split_rngs={"params": True},
                              length=3)(name="blocks")(x, None)[0]

    variables = Stack().init(jax.random.key(0), x)
    served, stored = jax_epilog.serve_fp8(Stack(), variables, x, rules="blocks/layer")
    weight = stored["params"]["blocks"]["layer"]["kernel"]
    assert (weight.data.shape, weight.scale.shape) == ((3, 20, 20), (3,))
    rounded = {"params": {"blocks": {"layer": {
        "kernel": dequantized(weight, (3, 20, 20)),
        "bias": variables["params"]["blocks"]["layer"]["bias"]}}}}
    np.testing.assert_allclose(served.apply(stored, x), Stack().apply(rounded, x), rtol=1e-5,
                               atol=1e-5)
