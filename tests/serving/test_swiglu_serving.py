"""The SwiGLU block with kernels stored in FP8 (`Fp8Weight`): `swiglu`, the Linen and NNX
modules, `quantize_params` and `calibrate` on a block, and the errors.

The model every served block is checked against is `served_block`: test_serving.py's float64
models of one stored layer (the FP8 GEMM of the quantized input, or weight-only), chained
through h = silu(g)·u as the block computes it. The FP8 way quantizes h, which is computed
in float64 here and in float32 by the block: where the two land on either side of an e4m3
rounding boundary, one element of h moves by one e4m3 step, which `assert_block` allows for.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from conftest import HAS_CUDA
from jaxprs import traced_equations
from jax_epilog.float8.weights import Fp8Weight, key_names, quantize_weight
from test_serving import E4M3, random, served_model, weight_only_model

ALL_KERNELS = lambda path, leaf: key_names(path)[-1:] == ("kernel",)  # noqa: E731


@pytest.fixture(autouse=True)
def fp8_gemms(monkeypatch):
    """The FP8-GEMM way unless a test asks for another (`serving_plan`)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")


def make_block(seed, d, f, d_out, dtype=jnp.float32):
    """gate, up `(d, f)` and down `(f, d_out)`, random normal at a fan-in scale."""
    return (random(seed, (d, f), dtype, d ** -0.5), random(seed + 1, (d, f), dtype, d ** -0.5),
            random(seed + 2, (f, d_out), dtype, f ** -0.5))


def plain_block(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def served_block(way, x, gate_up, down, dtype):
    """(the float64 model of the served block, max |h|): `gate_up` one or two stored
    weights, each GEMM's result rounded to `dtype` as the block's is."""
    layer = weight_only_model if way == "weight_only" else served_model
    rounded = lambda a: np.asarray(jnp.asarray(a, jnp.float32).astype(dtype).astype(jnp.float32),
                                   np.float64)
    x = np.asarray(jnp.asarray(x, jnp.float32)).reshape(-1, np.shape(x)[-1])
    gu = np.concatenate([rounded(layer(x, w, None, None)) for w in gate_up], axis=1)
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    h = g / (1 + np.exp(-g)) * u
    if way in ("weight_only", "fp8_pallas"):  # h enters the down GEMM in the compute dtype
        h = rounded(h)
    return layer(h, down, None, None), np.max(np.abs(h))


def assert_block(y, want, h_max, down: Fp8Weight, dtype, way):
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64).reshape(want.shape)
    w_max = float(jnp.max(jnp.abs(down.data.astype(jnp.float32)))) * float(jnp.max(down.scale))
    rounding = (2 ** -7 if dtype == jnp.bfloat16 else 2 ** -20) * np.max(np.abs(want))
    flips = 0 if way == "weight_only" else 2 * 2 ** -3 * h_max * w_max  # two e4m3 steps of h
    np.testing.assert_allclose(y, want, rtol=0, atol=(rounding + flips) * (8 if HAS_CUDA else 1)
                               + 1e-6)


def relative_error(y, want) -> float:
    """|y - want| / |want| (Frobenius): FP8 rounding of x, the kernels and h is a few %."""
    y, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (y, want))
    return float(np.linalg.norm(y - want) / np.linalg.norm(want))


# --- the functional block -------------------------------------------------------------------

@pytest.mark.parametrize("rows,d,f,d_out", [(1, 33, 50, 35), (127, 40, 72, 40),
                                            (129, 16, 24, 21)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("way", ["fp8", "xla_fp8", "weight_only"])
@pytest.mark.parametrize("concatenated", [False, True])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_stored_block_is_its_way_s_formula_and_the_16_bit_block_to_fp8_rounding(
        rows, d, f, d_out, dtype, way, concatenated, granularity, monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    gate, up, down = make_block(1, d, f, d_out)
    x = random(4, (2, rows, d), dtype)
    store = lambda kernel: quantize_weight(kernel, granularity=granularity)  # noqa: E731
    stored_down = store(down)
    if concatenated:
        gate_up = (store(jnp.concatenate([gate, up], axis=1)),)
        argument = gate_up[0]
    else:
        gate_up = argument = (store(gate), store(up))
    y = jax.jit(lambda x, gu, w: jax_epilog.swiglu(x, gu, w))(x, argument, stored_down)
    assert y.shape == (2, rows, d_out) and y.dtype == dtype
    want, h_max = served_block(way, x, gate_up, stored_down, dtype)
    assert_block(y, want, h_max, stored_down, dtype, way)
    assert relative_error(y, jax_epilog.swiglu(x, (gate, up), down, dtype=jnp.float32)) < 0.08


@pytest.mark.parametrize("rows,way", [(16, "weight_only"), (64, "weight_only"), (65, "fp8")])
def test_the_block_chooses_its_way_by_the_rows(rows, way, monkeypatch):
    """The served `dense`'s ways: the values of the way, and its three GEMMs in the call."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")
    gate, up, down = (quantize_weight(w) for w in make_block(1, 24, 40, 24))
    x = random(2, (rows, 24))
    f = lambda x, gate, up, down: jax_epilog.swiglu(x, (gate, up), down)  # noqa: E731
    want, h_max = served_block(way, x, (gate, up), down, jnp.float32)
    assert_block(jax.jit(f)(x, gate, up, down), want, h_max, down, jnp.float32, way)
    dots = [e for e in traced_equations(f, x, gate, up, down)
            if e.primitive.name == "dot_general"]
    fp8_dots = [e for e in dots if all(v.aval.dtype == jnp.float8_e4m3fn for v in e.invars)]
    assert (len(dots), len(fp8_dots)) == {"weight_only": (3, 0), "xla_fp8": (3, 3),
                                          "fp8": (0, 0)}[way]


def test_bad_stored_blocks_raise_the_served_layers_errors():
    gate, up, down = make_block(1, 32, 48, 32)
    stored = [quantize_weight(w) for w in (gate, up, down)]
    x = random(2, (4, 32))
    with pytest.raises(TypeError, match=r"^down: a 16-bit kernel in a block whose other "
                                        r"kernels are stored in FP8"):
        jax_epilog.swiglu(x, (stored[0], stored[1]), down)
    with pytest.raises(TypeError, match=r"^gate_up \(up\): a 16-bit kernel"):
        jax_epilog.swiglu(x, (stored[0], up), stored[2])
    with pytest.raises(ValueError, match=r"gate_up \(gate\).scale: expected a finite positive"):
        jax_epilog.swiglu(x, (Fp8Weight(stored[0].data, jnp.float32(jnp.nan)), stored[1]),
                          stored[2])
    with pytest.raises(ValueError, match=r"down.input_scale: expected a finite positive"):
        jax_epilog.swiglu(x, stored[:2], Fp8Weight(stored[2].data, stored[2].scale,
                                                   jnp.float32(jnp.inf)))
    with pytest.raises(ValueError, match=r"gate_up \(gate\): the stored FP8 kernel is "
                                         r"\(K, N\) = \(32, 48\), but x has 7 features"):
        jax_epilog.swiglu(x[:, :7], stored[:2], stored[2])
    with pytest.raises(ValueError, match=r"down: the stored FP8 kernel is \(K, N\) = "
                                         r"\(40, 32\), but h = silu\(g\)·u has 48 features"):
        jax_epilog.swiglu(x, stored[:2], quantize_weight(random(3, (40, 32))))
    with pytest.raises(ValueError, match=r"gate_up: gate and up must have the same shape"):
        jax_epilog.swiglu(x, (stored[0], quantize_weight(up[:, :40])), stored[2])
    with pytest.raises(TypeError, match="run inference only: differentiate the 16-bit"):
        jax.grad(lambda x: jax_epilog.swiglu(x, stored[:2], stored[2]).sum())(x)


# --- quantize_params and calibrate ----------------------------------------------------------

def test_quantize_params_stores_a_block_s_three_kernels_together_or_none():
    gate, up, down = make_block(1, 512, 1024, 512)
    block = {"gate": {"kernel": gate}, "up": {"kernel": up}, "down": {"kernel": down}}
    stored = jax_epilog.quantize_params({"mlp": block})["mlp"]
    assert all(isinstance(stored[part]["kernel"], Fp8Weight) for part in block)
    # down (1024, 256) is below the default rule's 512: gate and up stay 16-bit with it
    narrow = dict(block, down={"kernel": down[:, :256]})
    kept = jax_epilog.quantize_params({"mlp": narrow})["mlp"]
    assert not any(isinstance(kept[part]["kernel"], Fp8Weight) for part in block)
    no_down = lambda path, leaf: "down" not in key_names(path)  # noqa: E731
    assert not any(isinstance(leaf, Fp8Weight) for leaf in jax.tree.leaves(
        jax_epilog.quantize_params({"mlp": block}, include=no_down),
        is_leaf=lambda x: isinstance(x, Fp8Weight)))


def test_calibrate_sets_the_block_s_static_scales():
    gate, up, down = make_block(1, 24, 40, 24)
    params = {"gate": quantize_weight(gate), "up": quantize_weight(up),
              "down": quantize_weight(down)}
    apply = lambda p, x: jax_epilog.swiglu(x, (p["gate"], p["up"]), p["down"])  # noqa: E731
    batch = random(2, (96, 24), scale=3.0)
    calibrated = jax_epilog.calibrate(apply, params, [batch * 0.5, batch])
    x_scale = float(jnp.max(jnp.abs(batch))) / E4M3
    for part in ("gate", "up"):
        np.testing.assert_allclose(float(calibrated[part].input_scale), x_scale, rtol=1e-6)
    h = jax.nn.silu(batch @ gate) * (batch @ up)  # the largest h: its scale, to FP8 rounding
    np.testing.assert_allclose(float(calibrated["down"].input_scale),
                               float(jnp.max(jnp.abs(h))) / E4M3, rtol=0.1)
    # The largest inputs seen set the scales: the same batch gives current scaling's result.
    np.testing.assert_array_equal(np.asarray(jax.jit(apply)(calibrated, batch)),
                                  np.asarray(jax.jit(apply)(params, batch)))


# --- the Flax modules -----------------------------------------------------------------------

def test_nnx_swiglu_serves_its_quantized_state_under_nnx_jit():
    nnx = pytest.importorskip("flax.nnx")
    import jax_epilog.nnx
    block = jax_epilog.nnx.SwiGLU(40, 72, 33, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = random(3, (3, 43, 40), jnp.bfloat16)
    unquantized = block(x)
    nnx.update(block, jax_epilog.quantize_params(nnx.state(block, nnx.Param),
                                                 include=ALL_KERNELS))
    kernels = [layer.kernel.get_value() for layer in (block.gate, block.up, block.down)]
    assert all(isinstance(k, Fp8Weight) for k in kernels)
    y = nnx.jit(lambda m, x: m(x))(block, x)
    assert y.shape == (3, 43, 33) and y.dtype == jnp.bfloat16
    want, h_max = served_block("fp8", x, kernels[:2], kernels[2], jnp.bfloat16)
    assert_block(y, want, h_max, kernels[2], jnp.bfloat16, "fp8")
    assert relative_error(y, unquantized) < 0.08


def test_linen_swiglu_serves_quantized_and_calibrated_variables():
    pytest.importorskip("flax.linen")
    import jax_epilog.linen
    block = jax_epilog.linen.SwiGLU(72, dtype=jnp.bfloat16)
    x = random(3, (129, 40), jnp.bfloat16)
    variables = block.init(jax.random.key(1), x)
    quantized = jax_epilog.quantize_params(variables, include=ALL_KERNELS)
    stored = [quantized["params"][part]["kernel"] for part in ("gate", "up", "down")]
    want, h_max = served_block("fp8", x, stored[:2], stored[2], jnp.bfloat16)
    assert_block(jax.jit(block.apply)(quantized, x), want, h_max, stored[2], jnp.bfloat16,
                 "fp8")
    calibrated = jax_epilog.calibrate(block.apply, quantized, [x])
    assert all(calibrated["params"][part]["kernel"].input_scale is not None
               for part in ("gate", "up", "down"))
    np.testing.assert_array_equal(np.asarray(jax.jit(block.apply)(calibrated, x)),
                                  np.asarray(jax.jit(block.apply)(quantized, x)))


# --- the GPU kernels ------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("rows", [127, 2048])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_served_block_runs_the_kernels_on_a_gpu(granularity, rows, monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)  # the FP8 calls' own choice
    stored = [quantize_weight(w, granularity=granularity)
              for w in make_block(1, 1024, 1536, 1024)]
    x = random(3, (rows, 1024), jnp.bfloat16)
    fn = jax.jit(lambda x, gu, w: jax_epilog.swiglu(x, gu, w))
    assert fn.lower(x, stored[:2], stored[2]).compile().as_text().count(
        'custom_call_target="jax_epilog_matmul') == 3  # gate, up, down
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no reference fallback
        y = fn(x, stored[:2], stored[2])
    want, h_max = served_block("fp8", x, stored[:2], stored[2], jnp.bfloat16)
    assert_block(y, want, h_max, stored[2], jnp.bfloat16, "fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,way", [(1, "fp8_pallas"), (16, "fp8_pallas"),
                                      (17, "weight_only"), (64, "xla_fp8")])
def test_served_block_over_few_rows_runs_no_cublaslt_call_on_a_gpu(rows, way, monkeypatch):
    """Each way of few rows, asked for by JAX_EPILOG_SERVING (the Pallas kernel, XLA's GEMMs):
    no cuBLASLt call, values as the model's."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", way)
    stored = [quantize_weight(w) for w in make_block(1, 1024, 1536, 1024)]
    x = random(3, (rows, 1024), jnp.bfloat16)
    fn = jax.jit(lambda x, gu, w: jax_epilog.swiglu(x, gu, w))
    assert 'custom_call_target="jax_epilog_matmul' not in fn.lower(
        x, stored[:2], stored[2]).compile().as_text()
    want, h_max = served_block(way, x, stored[:2], stored[2], jnp.bfloat16)
    assert_block(fn(x, stored[:2], stored[2]), want, h_max, stored[2], jnp.bfloat16, way)
