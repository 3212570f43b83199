"""`jax_epilog.swiglu` and the `SwiGLU` modules (issue 38), on the CPU.

The plain block `down(silu(x @ gate) * (x @ up))` under JAX's autodiff is the reference of
the compute-dtype path. On a CPU an FP8 `matmul` runs the exact reference, so the FP8 block
computes exactly the quantized math: `model_block` below is an independent NumPy model of it
(per-tensor current scaling, FP8 products summed in float64), which the block must match to
float32 rounding, while differing from the unquantized block by FP8 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.float8.recipe import Fp8History
from jax_epilog.layers import swiglu as swiglu_module
from jax_epilog.planning import block_plan
from test_fp8_layers import close, gemm, quantize
from test_layers import saved_residuals

ALL = Fp8(layers="all")
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


def make_block(seed, rows, d, f, d_out=None, lead=()):
    """x `(*lead, rows, d)`, gate and up `(d, f)`, down `(f, d_out)`, dy: random normal, the
    kernels scaled as a fan-in initialiser would."""
    keys = jax.random.split(jax.random.key(seed), 5)
    d_out = d if d_out is None else d_out
    x = jax.random.normal(keys[0], (*lead, rows, d))
    gate, up = (jax.random.normal(k, (d, f)) / np.sqrt(d) for k in keys[1:3])
    down = jax.random.normal(keys[3], (f, d_out)) / np.sqrt(f)
    dy = jax.random.normal(keys[4], (*lead, rows, d_out))
    return x, gate, up, down, dy


def plain_block(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def grads(fn, x, gate, up, down, dy):
    y, vjp = jax.vjp(fn, x, gate, up, down)
    return (y, *vjp(dy))


SHAPES = [(1, 20, 36), (127, 33, 50), (129, 16, 24)]  # rows, D, F: non-multiples of 8 too


@pytest.mark.parametrize("rows,d,f", SHAPES)
@pytest.mark.parametrize("concatenated", [False, True])
def test_matches_the_plain_block(rows, d, f, concatenated):
    x, gate, up, down, dy = make_block(0, rows, d, f, d_out=d + 3, lead=(2,))
    if concatenated:
        fn = lambda x, g, u, w: jax_epilog.swiglu(x, jnp.concatenate([g, u], 1), w)
    else:
        fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w)
    for got, want in zip(grads(fn, x, gate, up, down, dy),
                         grads(plain_block, x, gate, up, down, dy)):
        assert got.shape == want.shape and got.dtype == want.dtype
        close(got, want, 2e-6)


def test_bfloat16_compute_matches_the_plain_block():
    x, gate, up, down, dy = (a.astype(jnp.bfloat16) for a in make_block(1, 129, 40, 72))
    fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w)
    for got, want in zip(grads(fn, x, gate, up, down, dy),
                         grads(plain_block, x, gate, up, down, dy)):
        assert got.dtype == jnp.bfloat16
        close(got, want, 2e-2)  # bf16 roundings in different places


def test_dtype_casts_float32_kernels_and_their_gradients_come_back_float32():
    x, gate, up, down, dy = make_block(2, 33, 16, 24)
    fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, dtype=jnp.bfloat16)
    y, dx, dgate, dup, ddown = grads(fn, x, gate, up, down, dy.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and dgate.dtype == ddown.dtype == jnp.float32
    close(dgate, grads(plain_block, x, gate, up, down, dy)[2], 3e-2)


# --- FP8 ---------------------------------------------------------------------------------

def silu_and_derivative(g):
    s = 1.0 / (1.0 + np.exp(-g))
    return g * s, s * (1.0 + g * (1.0 - s))


def model_block(x, gate, up, down, dy):
    """(y, dx, dgate, dup, ddown) of the FP8 block under current scaling, in float64 with
    every GEMM result rounded to float32 (the compute dtype)."""
    f32 = lambda a: np.asarray(a, np.float32)
    amax = lambda a: np.float32(np.max(np.abs(a)))
    x, dy = f32(x), f32(dy)
    kernel = f32(np.concatenate([gate, up], 1))
    hidden = kernel.shape[1] // 2
    x8, sx = quantize(x, amax(x), E4M3)
    w8, sw = quantize(kernel, amax(kernel), E4M3)
    d8, sd = quantize(down, amax(down), E4M3)
    gu = f32(gemm(x8, sx, w8, sw))
    silu, _ = silu_and_derivative(gu[:, :hidden].astype(np.float64))
    h = f32(silu * gu[:, hidden:])
    h8, sh = quantize(h, amax(h), E4M3)
    y = f32(gemm(h8, sh, d8, sd))
    dy8, sdy = quantize(dy, amax(dy), E5M2)
    ddown = f32(gemm(h8.T, sh, dy8, sdy))
    dh = gemm(dy8, sdy, d8.T, sd).astype(np.float32).astype(np.float64)
    g, u = ((v8.astype(np.float64) * np.float64(scale))
            for v8, scale in (quantize(v, amax(v), E4M3) for v in (gu[:, :hidden],
                                                                  gu[:, hidden:])))
    silu, dsilu = silu_and_derivative(g)
    dgu = f32(np.concatenate([f32(dh * u * dsilu), f32(dh * silu)], 1))
    dgu8, sdgu = quantize(dgu, amax(dgu), E5M2)
    dkernel = f32(gemm(x8.T, sx, dgu8, sdgu))
    dx = f32(gemm(dgu8, sdgu, w8.T, sw))
    return y, dx, dkernel[:, :hidden], dkernel[:, hidden:], ddown


@pytest.mark.parametrize("rows,d,f", [(1, 32, 48), (127, 48, 80), (129, 20, 36)])
def test_fp8_is_the_quantized_block(rows, d, f):
    x, gate, up, down, dy = make_block(3, rows, d, f)
    fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=ALL)
    got = grads(fn, x, gate, up, down, dy)
    unquantized = grads(plain_block, x, gate, up, down, dy)
    for name, g, want, plain in zip(("y", "dx", "dgate", "dup", "ddown"), got,
                                    model_block(x, gate, up, down, dy), unquantized):
        close(g, want, 1e-5)
        # FP8 rounding, more than float32's (so the comparison with the model can fail),
        # within the bounds the FP8 layer tests allow
        assert 1e-4 < close(g, plain, 0.25), name


def test_fp8_saves_only_fp8_activations():
    """The residuals: x8 (M, D), g8, u8 and h8 (M, F), the two FP8 kernels, scalars."""
    rows, d, f = 64, 32, 48
    x, gate, up, down, _ = make_block(4, rows, d, f)
    found = saved_residuals(lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=ALL),
                            x, gate, up, down)
    arrays = sorted((dtype, shape) for dtype, shape in found if shape)
    assert arrays == sorted([("f8_e4m3fn", (rows, d)), *[("f8_e4m3fn", (rows, f))] * 3,
                             ("f8_e4m3fn", (d, 2 * f)), ("f8_e4m3fn", (f, d))]), found


def _residual_bytes(fn, *args) -> int:
    sizes = {"f8_e4m3fn": 1, "f8_e5m2": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4}
    return sum(sizes[dtype] * int(np.prod(shape)) for dtype, shape in saved_residuals(fn, *args))


def test_fp8_keeps_fewer_residual_bytes_than_three_fp8_dense_layers_or_flax_fp8():
    """What the backward keeps, in bytes (`print_saved_residuals`), of a bf16 block: ours
    against three `Dense(use_bias=False, fp8=...)` and against Flax's FP8 `nn.Dense`."""
    linen = pytest.importorskip("flax.linen")
    fp8_ops = pytest.importorskip("flax.linen.fp8_ops")
    rows, d, f = 256, 64, 192
    x, gate, up, down, _ = (a.astype(jnp.bfloat16) for a in make_block(5, rows, d, f))
    ours = _residual_bytes(lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=ALL),
                           x, gate, up, down)
    dense = lambda h, w: jax_epilog.dense(h, w, fp8=ALL)
    three = _residual_bytes(lambda x, g, u, w: dense(jax.nn.silu(dense(x, g)) * dense(x, u), w),
                            x, gate, up, down)

    class FlaxBlock(linen.Module):
        @linen.compact
        def __call__(self, x):
            layer = lambda n, name: linen.Dense(n, use_bias=False, dtype=jnp.bfloat16, name=name,
                                                dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
            return layer(d, "down")(linen.silu(layer(f, "gate")(x)) * layer(f, "up")(x))

    variables = FlaxBlock().init(jax.random.key(0), x)
    flax = _residual_bytes(lambda v: FlaxBlock().apply(v, x), variables)
    activations = rows * (d + 3 * f)  # x8, g8, u8, h8: one byte each
    assert ours == activations + 3 * d * f + 6 * 4  # + the FP8 kernels and the 6 scales
    assert ours < 0.6 * three and ours < 0.4 * flax, (ours, three, flax)


def test_fp8_auto_runs_small_blocks_in_the_compute_dtype_and_passes_the_state():
    x, gate, up, down, dy = make_block(6, 16, 32, 48)
    state = Fp8().init_state(2)
    fn = lambda x, g, u, w, s: jax_epilog.swiglu(x, (g, u), w, fp8=True, fp8_state=s)
    y, vjp = jax.vjp(fn, x, gate, up, down, state)
    close(y, plain_block(x, gate, up, down), 2e-6)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), vjp(dy)[-1], state))


def test_delayed_scaling_records_the_amaxes_and_reads_its_histories():
    x, gate, up, down, dy = make_block(7, 65, 32, 48)
    delayed = Fp8(scaling="delayed", layers="all")
    fn = lambda x, g, u, w, s: jax_epilog.swiglu(x, (g, u), w, fp8=delayed, fp8_state=s)
    cold = delayed.init_state(2)
    y, vjp = jax.vjp(fn, x, gate, up, down, cold)
    # a cold history calibrates from this step's amaxes: current scaling's result
    close(y, jax_epilog.swiglu(x, (gate, up), down, fp8=ALL), 1e-7)
    gate_up, down_state = vjp(dy)[-1]
    h = jax.nn.silu(x @ gate) * (x @ up)
    np.testing.assert_allclose(gate_up.input[0], jnp.max(jnp.abs(x)), rtol=1e-6)
    np.testing.assert_allclose(down_state.input[0], jnp.max(jnp.abs(h)), rtol=0.07)
    np.testing.assert_allclose(down_state.gradient[0], jnp.max(jnp.abs(dy)), rtol=1e-6)
    assert float(gate_up.gradient[0]) > 0 and not np.any(gate_up.input[1:])
    # a warm history's scale is the history's: a 3x larger recorded amax (not a power of
    # two, which would only shift exponents) rounds x differently, so the result moves
    warm = (Fp8History(gate_up.input.at[0].multiply(3.0), gate_up.gradient), down_state)
    assert not np.allclose(fn(x, gate, up, down, warm), y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad,kwargs,error,match", [
    ("gate_up", {}, ValueError, r"gate_up: expected shape \(32, 2F\)"),
    ("pair", {}, ValueError, r"gate and up must have the same shape"),
    ("down", {}, ValueError, r"down: expected shape \(48, D_out\)"),
    ("x", {}, ValueError, r"gate_up \(gate\): expected shape \(7, F\)"),
    ("triple", {}, TypeError, r"gate_up: expected a \(D, 2F\) kernel or a \(gate, up\) pair"),
    ("stored", {}, TypeError, r"gate_up \(gate\), gate_up \(up\): a 16-bit kernel in a block"),
    (None, {"fp8": "yes"}, TypeError, r"fp8: expected None, a bool"),
    (None, {"fp8": ALL, "fp8_state": Fp8().init_state(1)}, ValueError,
     r"fp8_state: expected 2 Fp8History"),
    (None, {"fp8_state": Fp8().init_state(2)}, ValueError, r"fp8_state: .* only with fp8="),
    (None, {"dtype": jnp.int32}, TypeError, r"dtype: expected a computation dtype"),
])
def test_bad_inputs_raise_clear_errors(bad, kwargs, error, match):
    x, gate, up, down, _ = make_block(8, 4, 32, 48)
    gate_up = (gate, up)
    if bad == "gate_up":
        gate_up = jnp.ones((32, 95))
    elif bad == "pair":
        gate_up = (gate, up[:, :40])
    elif bad == "down":
        down = down[:40]
    elif bad == "x":
        x = x[:, :7]
    elif bad == "triple":
        gate_up = (gate, up, up)
    elif bad == "stored":
        down = jax_epilog.float8.weights.quantize_weight(down)
    with pytest.raises(error, match=match):
        jax_epilog.swiglu(x, gate_up, down, **kwargs)


# --- the Flax modules ----------------------------------------------------------------------

def test_linen_swiglu_has_three_dense_parameters_and_trains_its_state():
    linen = pytest.importorskip("flax.linen")
    from jax_epilog import linen as epilog_linen

    class Stock(linen.Module):
        @linen.compact
        def __call__(self, x):
            g = linen.Dense(48, use_bias=False, name="gate")(x)
            u = linen.Dense(48, use_bias=False, name="up")(x)
            return linen.Dense(32, use_bias=False, name="down")(linen.silu(g) * u)

    x, *_ = make_block(9, 7, 32, 48, lead=(3,))
    key = jax.random.key(0)
    stock = Stock().init(key, x)
    model = epilog_linen.SwiGLU(48, fp8=ALL)
    variables = model.init(key, x)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), variables["params"],
                                     stock["params"]))
    state = variables[epilog_linen.FP8_COLLECTION]
    assert sorted(state) == sorted(f"{g}_{f}_amax_history" for g in ("gate_up", "down")
                                   for f in ("input", "gradient"))
    y = model.apply(variables, x)
    p = variables["params"]
    close(y, jax_epilog.swiglu(x, (p["gate"]["kernel"], p["up"]["kernel"]), p["down"]["kernel"],
                               fp8=ALL), 1e-7)
    close(y, Stock().apply(stock, x), 0.25)
    g = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)
    assert all(float(h[0]) > 0 for h in g[epilog_linen.FP8_COLLECTION].values())
    assert set(g["params"]) == {"gate", "up", "down"}


def test_nnx_swiglu_matches_three_linears_and_updates_its_histories():
    nnx = pytest.importorskip("flax.nnx")
    from jax_epilog import nnx as epilog_nnx

    block = epilog_nnx.SwiGLU(32, 48, 40, rngs=nnx.Rngs(0), fp8=ALL)
    rngs = nnx.Rngs(0)
    linears = [nnx.Linear(i, o, use_bias=False, rngs=rngs) for i, o in ((32, 48), (32, 48),
                                                                         (48, 40))]
    for layer, stock in zip((block.gate, block.up, block.down), linears):
        np.testing.assert_array_equal(layer.kernel[...], stock.kernel[...])
    x, *_ = make_block(10, 9, 32, 48, lead=(2,))
    close(block(x), jax_epilog.swiglu(x, (linears[0].kernel[...], linears[1].kernel[...]),
                                      linears[2].kernel[...], fp8=ALL), 1e-7)
    with pytest.raises(ValueError, match="x has 31 features; this SwiGLU"):
        block(x[..., :31])
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, epilog_nnx.AmaxHistory))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=wrt)(block)
    epilog_nnx.update_amax_histories(block, grads)
    assert float(block.gate_up_input_amax_history[...][0]) == pytest.approx(
        float(jnp.max(jnp.abs(x))))
    assert float(block.down_gradient_amax_history[...][0]) > 0
    assert epilog_nnx.SwiGLU(8, 16, rngs=nnx.Rngs(0)).fp8_state() is None


def test_the_block_runs_fp8_by_the_layer_rule():
    def way(fp8, rows, d, f, d_out):
        return block_plan.swiglu_plan(fp8, rows, d, f, d_out, "bfloat16").way.choice

    assert way(None, 8192, 2048, 8192, 2048) == "compute"
    assert way(Fp8(), 8192, 2048, 8192, 2048) == "fp8"
    assert way(Fp8(), 16, 2048, 8192, 2048) == "compute"  # too small to pay
    assert way(Fp8(), 8192, 2040, 8192, 2040) == "compute"  # D not a multiple of 16
    assert way(ALL, 1, 20, 36, 20) == "fp8"
    # the block is one custom VJP: FP8 only where both GEMMs would run it
    assert way(Fp8(), 4096, 1024, 4096, 1024) == "compute"  # the down GEMM is too small
    assert [g.choice.choice for g in block_plan.swiglu_plan(
        Fp8(), 4096, 1024, 4096, 1024, "bfloat16").gemms] == ["fp8", "bf16"]


def test_jit_vmap_and_checkpoint_give_the_same_gradients():
    """A remat policy changes nothing; under vmap each slice is a block of its own (its own
    amaxes, so its own scales), as a loop over the slices computes it."""
    x, gate, up, down, dy = make_block(11, 17, 32, 48, lead=(2,))
    fn = lambda x, g, u, w: jax_epilog.swiglu(x, (g, u), w, fp8=ALL)
    run = jax.jit(grads, static_argnums=0)
    want = run(fn, x, gate, up, down, dy)
    policy = jax.checkpoint_policies.save_only_these_names(swiglu_module.SWIGLU_HIDDEN_NAME)
    for got, w in zip(run(jax.checkpoint(fn, policy=policy), x, gate, up, down, dy), want):
        close(got, w, 1e-6)
    batched = run(jax.vmap(fn, in_axes=(0, None, None, None)), x, gate, up, down, dy)
    slices = [run(fn, x[i], gate, up, down, dy[i]) for i in range(2)]
    for got, per_slice in zip(batched, zip(*slices)):
        close(got, jnp.stack(per_slice) if got.ndim == 3 else sum(per_slice), 1e-5)


def test_modules_annotate_down_apart_for_sharding():
    nnx = pytest.importorskip("flax.nnx")
    linen = pytest.importorskip("flax.linen")
    from jax_epilog import linen as epilog_linen
    from jax_epilog import nnx as epilog_nnx

    spec = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("embed", "mlp"))
    init = nnx.initializers.lecun_normal()
    with jax.set_mesh(mesh):
        block = epilog_nnx.SwiGLU(
            16, 32, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            down_kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))
    for layer in (block.gate, block.up):
        assert layer.kernel[...].sharding.spec == spec("embed", "mlp")
    assert block.down.kernel[...].sharding.spec == spec("mlp", "embed")
    model = epilog_linen.SwiGLU(32, kernel_init=linen.with_partitioning(init, ("embed", "mlp")),
                                down_kernel_init=linen.with_partitioning(init, ("mlp", "embed")))
    params = model.init(jax.random.key(0), jnp.ones((2, 16)))["params"]
    assert params["gate"]["kernel"].names == params["up"]["kernel"].names == ("embed", "mlp")
    assert params["down"]["kernel"].names == ("mlp", "embed")
