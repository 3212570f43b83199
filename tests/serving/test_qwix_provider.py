"""`EpilogProvider`: Qwix's `quantize_model` with jax-epilog's served FP8 layers, NNX and
Linen, against `serve_fp8` on the same model (the same stored weights and served calls:
equal) and the 16-bit model. Skipped where Qwix is not installed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

qwix = pytest.importorskip("qwix")
from flax import linen, nnx  # noqa: E402

import jax_epilog  # noqa: E402
from jax_epilog.float8.weights import Fp8Weight  # noqa: E402
from jax_epilog.layers.qwix_serving import EpilogProvider  # noqa: E402
from jax_epilog.layers.stock_serving import StockServingWarning  # noqa: E402


@pytest.fixture(autouse=True)
def _default_ways(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")


def fp8_rule(path=".*", **options):
    return qwix.QuantizationRule(module_path=path, weight_qtype=jnp.float8_e4m3fn,
                                 act_qtype=jnp.float8_e4m3fn, **options)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(44, 60, rngs=rngs)
        self.heads = nnx.Einsum("btd,dnh->btnh", (60, 3, 5), (3, 5), rngs=rngs)
        self.out = nnx.Linear(15, 20, rngs=rngs)

    def __call__(self, x):
        h = self.heads(jax.nn.gelu(self.up(x)))
        return self.out(h.reshape(*h.shape[:2], 15))


@pytest.mark.parametrize("rows", [1, 129])
def test_nnx_quantize_model_serves_as_serve_fp8_does(rows):
    model = Model(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (rows, 1, 44))
    rules = [qwix.QuantizationRule(module_path="out"), fp8_rule("up|heads")]
    quantized = qwix.quantize_model(model, EpilogProvider(rules), x)
    served = jax_epilog.serve_fp8(model, rules="up|heads")
    assert [type(m).__name__ for m in (quantized.up, quantized.heads, quantized.out)] == \
        ["ServedLinear", "ServedEinsum", "Linear"]
    np.testing.assert_array_equal(quantized(x), served(x))
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(quantized, x), served(x))
    want = np.asarray(model(x))
    assert 0 < np.max(np.abs(np.asarray(quantized(x)) - want)) < 0.08 * np.max(np.abs(want))


class Stack(linen.Module):
    @linen.compact
    def __call__(self, x):
        h = linen.Dense(60, name="up")(x)
        return linen.Einsum((60, 3, 5), "btd,dnh->btnh", name="heads")(h)


def test_linen_quantize_model_stores_fp8_at_init_and_serves_at_apply():
    x = jax.random.normal(jax.random.key(2), (3, 5, 44))
    quantized = qwix.quantize_model(Stack(), EpilogProvider([fp8_rule()]))
    stored = quantized.init(jax.random.key(0), x)
    assert all(isinstance(stored["params"][name]["kernel"], Fp8Weight) for name in ("up", "heads"))
    variables = Stack().init(jax.random.key(0), x)
    served, expected = jax_epilog.serve_fp8(Stack(), variables, x, rules=".*")
    np.testing.assert_array_equal(quantized.apply(stored, x), served.apply(expected, x))
    np.testing.assert_array_equal(jax.jit(quantized.apply)(stored, x), served.apply(expected, x))


def test_provider_refuses_what_it_cannot_serve_and_names_layers():
    with pytest.raises(ValueError, match=r"rules\[0\].weight_qtype: .*got int8"):
        EpilogProvider([qwix.QuantizationRule(weight_qtype=jnp.int8)])
    with pytest.raises(ValueError, match=r"rules\[0\].tile_size=128 has no counterpart"):
        EpilogProvider([fp8_rule(tile_size=128)])
    with pytest.raises(ValueError, match=r"rules\[0\].act_qtype: .*got int8"):
        EpilogProvider([qwix.QuantizationRule(weight_qtype=jnp.float8_e4m3fn,
                                              act_qtype=jnp.int8)])

    class Doubled(nnx.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    class Batched(nnx.Module):
        def __init__(self, rngs):
            self.batched = nnx.LinearGeneral(8, 4, batch_axis={0: 2}, rngs=rngs)
            self.doubled = Doubled(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.batched(x) + self.doubled(x)

    x = jnp.ones((2, 3, 8))
    with pytest.warns(StockServingWarning) as caught:
        qwix.quantize_model(Batched(nnx.Rngs(0)), EpilogProvider([fp8_rule()]), x)
    assert sorted(str(w.message).split(":")[0] for w in caught
                  if w.category is StockServingWarning) == [
        "batched stays 16-bit", "doubled stays 16-bit"]
    with pytest.raises(ValueError, match=r"^batched: cannot be served in FP8"):
        qwix.quantize_model(Batched(nnx.Rngs(0)), EpilogProvider([fp8_rule()], strict=True), x)


def test_nnx_layers_stacked_by_vmap_and_run_by_scan_are_served_too():
    from stock_models import Scanned  # tests/support: the scanned model serve_fp8's test uses
    model = Scanned(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (5, 20))
    quantized = qwix.quantize_model(model, EpilogProvider([fp8_rule()]), x)
    assert quantized.layers.kernel.get_value().data.shape == (3, 20, 20)
    np.testing.assert_array_equal(quantized(x), jax_epilog.serve_fp8(model, rules=".*")(x))
