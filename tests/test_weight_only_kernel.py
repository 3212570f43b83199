"""`float8.weight_only_kernel`, the Pallas weight-only GEMM for few rows, against XLA's
weight-only formula (`serving.weight_only(kernel="xla")`): interpreted on any CPU, lowered
for CUDA from this host, and run as a Triton kernel on a GPU."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_epilog.float8 import weight_only_kernel as wok
from jax_epilog.float8.weights import Fp8Weight
from jax_epilog.layers import serving

Config = wok.Config


def problem(seed: int, rows: int, k: int, n: int, dtype=jnp.bfloat16, bias: bool = True):
    """Random non-zero x (rows, K), FP8 data (N, K) spread over e4m3's range, a scale, bias
    (drawn where JAX runs: the GPU tests' weights are 60 MB)."""
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype)
    data = (jax.random.normal(kw, (n, k), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(kb, (n,), jnp.float32).astype(dtype) if bias else None
    return x, data, jnp.float32(0.25 / np.sqrt(k)), b


def reference(x, data, scale, bias, activation):
    return serving.weight_only(x, Fp8Weight(data, scale), bias, activation, kernel="xla")


def assert_close(got, want):
    """Equal up to the float32 sums' order: one rounding of the result's dtype apart."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = (np.asarray(a, np.float32) for a in (got, want))
    assert np.isfinite(got).all()
    eps = float(jnp.finfo(want.dtype if want.dtype != np.float32 else jnp.bfloat16).eps)
    bound = 2 * eps * np.abs(want) + 1e-4 * np.max(np.abs(want))
    worst = np.max(np.abs(got - want) - bound)
    assert worst <= 0, f"off by {worst} beyond the bound"


# Each config a different path: one K chunk (the epilog in the kernel), split K (float32
# partials), K past the last chunk masked, N past the last stripe masked, 32- and 64-row tiles,
# elementwise FMAs instead of the dot (1 row, 3 rows in a tile of 4).
CASES = [
    ((1, 129, 127), Config(block_n=32, block_k=32, split_k=1)),
    ((5, 1000, 129), Config(block_n=32, block_k=128, split_k=3)),
    ((16, 256, 96), Config(block_n=64, block_k=64, split_k=2)),
    ((33, 127, 200), Config(block_n=128, block_k=64, split_k=1)),
    ((64, 300, 64), None),
    ((1, 129, 127), Config(block_n=32, block_k=32, split_k=1, mma=False)),
    ((3, 1000, 129), Config(block_n=32, block_k=128, split_k=3, mma=False)),
]


@pytest.mark.parametrize("shape,config", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_interpreted_kernel_is_the_weight_only_formula(shape, config, activation):
    x, data, scale, bias = problem(sum(shape), *shape)
    got = wok.dense(x, data, scale, bias, activation=activation, config=config,
                    interpret=True)
    assert_close(got, reference(x, data, scale, bias, activation))


@pytest.mark.parametrize("config", [Config(32, 64, 1), Config(32, 64, 4)], ids=lambda c: c.name)
def test_float16_without_bias(config):
    x, data, scale, _ = problem(7, 3, 200, 72, jnp.float16, bias=False)
    got = wok.dense(x, data, scale, None, activation="gelu", config=config, interpret=True)
    assert_close(got, reference(x, data, scale, None, "gelu"))


def test_config_by_rule_fills_the_sms():
    """`config_for`: K split until the grid has `SMS` programs, in chunks of >= 1024."""
    assert wok.config_for(1, 4096, 14336).split_k == 1  # 224 stripes already
    down = wok.config_for(16, 14336, 4096)
    assert down.split_k > 1 and 4096 // down.block_n * down.split_k >= wok.SMS
    assert wok.config_for(1, 1024, 128).split_k == 1
    for rows in (1, 16, 17, 64):  # the pipeline's buffers fit
        c = wok.config_for(rows, 4096, 14336)
        stage = c.block_k * (c.block_n + 2 * wok.row_tile(rows))
        assert 2 <= c.num_stages and c.num_stages * stage <= wok.SHARED_MEMORY
    assert [wok.row_tile(r) for r in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("change,match", [
    (dict(x=jnp.ones((2, 32), jnp.float32)), "x: expected a .rows, K. array of bfloat16"),
    (dict(data=jnp.ones((16, 32), jnp.bfloat16)), "data: expected an .N, K. array"),
    (dict(data=jnp.ones((16, 31), jnp.float8_e4m3fn)), "data: the weight's K .* is 31, but x"),
    (dict(scale=jnp.ones((1,), jnp.float32)), "scale: expected a float32 scalar"),
    (dict(bias=jnp.ones((15,), jnp.bfloat16)), r"bias: expected shape \(16,\)"),
    (dict(config=Config(block_n=24)), "config: block_n and block_k must be powers of two"),
    (dict(x=jnp.ones((5, 32), jnp.bfloat16), config=Config(mma=False)),
     "config: mma=False takes at most 4 rows, x has 5"),
    (dict(activation="tanh"), "activation: expected None or one of"),
])
def test_bad_input_names_the_argument(change, match):
    args = dict(x=jnp.ones((2, 32), jnp.bfloat16), data=jnp.ones((16, 32), jnp.float8_e4m3fn),
                scale=jnp.float32(1), bias=jnp.ones((16,), jnp.bfloat16), config=None,
                activation=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        wok.dense(args["x"], args["data"], args["scale"], args["bias"],
                  activation=args["activation"], config=args["config"], interpret=True)


def test_weight_only_kernel_argument_is_checked():
    x, data, scale, bias = problem(0, 2, 32, 16)
    with pytest.raises(ValueError, match="kernel: expected one of"):
        serving.weight_only(x, Fp8Weight(data, scale), bias, None, kernel="triton")


@pytest.mark.parametrize("config,activation,dtype", [
    (None, "gelu", jnp.bfloat16), (None, "relu", jnp.float16), (None, None, jnp.bfloat16),
    (Config(64, 128, 4, num_warps=8, num_stages=3), "gelu", jnp.bfloat16),
    (Config(64, 128, 2, num_stages=3, mma=False), "gelu", jnp.bfloat16)],
    ids=["rule-gelu", "rule-relu-f16", "rule", "split", "fma"])
def test_cuda_lowering_of_the_kernel(config, activation, dtype, monkeypatch):
    """The kernel lowered for CUDA from this host (JAX's Triton lowering told it is on a
    Hopper GPU): every primitive of it, the in-kernel epilog and the masks included, has a
    Triton lowering, and the module holds one Triton call with the config's warps."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    if not hasattr(registration, "gpu_info_lib"):
        pytest.skip("this jax asks the GPU's compute capability another way")
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    x, data, scale, bias = (jax.ShapeDtypeStruct(s, d) for s, d in (
        ((3, 1000), dtype), ((129, 1000), jnp.float8_e4m3fn), ((), jnp.float32),
        ((129,), dtype)))
    f = jax.jit(lambda *a: wok.dense(*a, activation=activation, config=config))
    text = f.trace(x, data, scale, bias).lower(lowering_platforms=("cuda",)).as_text()
    warps = (config or wok.config_for(3, 1000, 129)).num_warps
    assert text.count("__gpu$xla.gpu.triton") == 1 and f"num_warps = {warps}" in text


# --- the GPU --------------------------------------------------------------------------------

#: (K, N): a Llama FFN's up and down projections, a fused QKV, and odd ones.
GPU_SHAPES = [(4096, 14336), (14336, 4096), (4096, 6144), (1000, 129), (127, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", GPU_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_gpu_kernel_matches_xla_weight_only(k, n, rows):
    """On the GPU, by rule (at 16 rows with K split too, at 1 row with FMAs too), the kernel
    gives XLA's weight-only result up to the sums' order, and really runs as a Triton
    kernel."""
    assert wok.runs_here(), "the kernel does not run on this GPU (compute capability < 8.9)"
    x, data, scale, bias = problem(k + n + rows, rows, k, n)
    want = jax.jit(reference, static_argnums=4)(x, data, scale, bias, "gelu")
    more = {16: [Config(64, 256, 4, num_stages=3)], 1: [Config(64, 128, 2, 4, 3, mma=False)]}
    for config in [None] + more.get(rows, []):
        f = jax.jit(lambda *a: serving.weight_only(a[0], Fp8Weight(a[1], a[2]), a[3], "gelu",
                                                   kernel="pallas", config=config))
        assert "__gpu$xla.gpu.triton" in f.lower(x, data, scale, bias).as_text()
        assert_close(f(x, data, scale, bias), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_served_dense_takes_the_kernel_when_switched(rows, monkeypatch):
    """`serving_plan.SMALL_ROWS_KERNEL = "pallas"`: a served `dense` over few rows runs the
    Triton kernel and gives XLA's weight-only result."""
    import jax_epilog
    from jax_epilog.float8.weights import quantize_weight
    from jax_epilog.planning import serving_plan
    monkeypatch.setenv("JAX_EPILOG_SERVING", "auto")
    monkeypatch.setattr(serving_plan, "SMALL_ROWS_KERNEL", "pallas")
    x, _, _, bias = problem(rows, rows, 1024, 1536)
    weight = quantize_weight(jnp.asarray(np.random.default_rng(1).standard_normal((1024, 1536))
                                         * 0.03, jnp.bfloat16))
    fn = jax.jit(lambda x, w, b: jax_epilog.dense(x, w, b, activation="relu"))
    assert "__gpu$xla.gpu.triton" in fn.lower(x, weight, bias).as_text()
    assert_close(fn(x, weight, bias), jax.jit(reference, static_argnums=4)(
        x, weight.data, weight.scale, bias, "relu"))
