"""`serve_fp8` on stock layers it cannot take, beyond test_stock_serving.py's batch dims and
custom products: kernel dtypes (already FP8, integer), non-finite kernels, a compute dtype the
served GEMMs do not write, einsums that sum a dim of one operand alone or whose string comes
only at call time. Each stays its 16-bit self with a `StockServingWarning` naming its path and
why, or raises a `ValueError` naming it where asked for explicitly; never served wrong."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

import jax_epilog  # noqa: E402
from jax_epilog.float8.weights import Fp8Weight  # noqa: E402
from jax_epilog.layers.stock_serving import StockServingWarning  # noqa: E402


class Refused(nnx.Module):
    """One layer per reason (`REASONS`), and one the route takes."""

    def __init__(self, rngs):
        self.fp8_kernel = nnx.Linear(16, 24, rngs=rngs)
        self.fp8_kernel.kernel = nnx.Param(self.fp8_kernel.kernel[...].astype(jnp.float8_e4m3fn))
        self.int_kernel = nnx.Linear(16, 24, rngs=rngs)
        self.int_kernel.kernel = nnx.Param(jnp.ones((16, 24), jnp.int32))
        self.nan_kernel = nnx.Linear(16, 24, rngs=rngs)
        self.nan_kernel.kernel[...] = self.nan_kernel.kernel[...].at[3, 5].set(jnp.nan)
        self.fp8_compute = nnx.Linear(16, 24, dtype=jnp.float8_e5m2, rngs=rngs)
        self.lone = nnx.Einsum("bd,dfx->bf", (16, 24, 3), rngs=rngs)
        self.fine = nnx.Linear(16, 24, rngs=rngs)


REASONS = {"fp8_kernel": "its kernel is float8_e4m3fn",
           "int_kernel": "its kernel is int32",
           "nan_kernel": "non-finite values",
           "fp8_compute": "computes in float8_e5m2",
           "lone": "a dim summed over one operand alone"}


def test_each_layer_the_route_cannot_take_warns_naming_it_and_stays_as_it_is():
    model = Refused(nnx.Rngs(0))
    with pytest.warns(StockServingWarning) as caught:
        served = jax_epilog.serve_fp8(model, rules=".*")
    messages = "\n".join(str(w.message) for w in caught)
    for path, why in REASONS.items():
        assert re.search(rf"^{path} stays 16-bit: .*{re.escape(why)}", messages, re.M), messages
        layer, original = getattr(served, path), getattr(model, path)
        assert type(layer) is type(original)
        kernel = layer.kernel.get_value()
        assert not isinstance(kernel, Fp8Weight)
        np.testing.assert_array_equal(np.asarray(kernel, np.float32),
                                      np.asarray(original.kernel.get_value(), np.float32))
    assert len(caught) == len(REASONS)
    assert isinstance(served.fine.kernel.get_value(), Fp8Weight)


@pytest.mark.parametrize("path", sorted(REASONS))
def test_a_layer_asked_for_by_its_path_or_strictly_raises_naming_it(path):
    why = re.escape(REASONS[path])
    with pytest.raises(ValueError, match=rf"^{path}: cannot be served in FP8: .*{why}"):
        jax_epilog.serve_fp8(Refused(nnx.Rngs(0)), rules=path)
    with pytest.raises(ValueError, match=rf"^{path}: cannot be served in FP8: .*{why}"):
        jax_epilog.serve_fp8(Refused(nnx.Rngs(0)), rules=[path, "fine"], strict=True)


def test_linen_einsum_with_its_string_only_at_call_time_stays_16_bit():
    class Model(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Einsum((16, 24), name="late")(x, "bd,df->bf") + \
                linen.Dense(24, name="dense")(x)

    x = jax.random.normal(jax.random.key(0), (5, 16))
    variables = Model().init(jax.random.key(1), x)
    with pytest.warns(StockServingWarning, match=r"^late stays 16-bit: .*only at call time"):
        served, stored = jax_epilog.serve_fp8(Model(), variables, x, rules=".*")
    assert not isinstance(stored["params"]["late"]["kernel"], Fp8Weight)
    assert isinstance(stored["params"]["dense"]["kernel"], Fp8Weight)
    y, want = served.apply(stored, x), Model().apply(variables, x)
    assert 0 < float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want))) < 0.1
    with pytest.raises(ValueError, match=r"^late: cannot be served in FP8: .*call time"):
        jax_epilog.serve_fp8(Model(), variables, x, rules="late")
