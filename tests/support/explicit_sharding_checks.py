"""jax-epilog under Explicit mesh axes, against one device and the same program under Auto axes.

`jax.make_mesh` gives Explicit axes by default (JAX 0.10 and 0.12 alike), and under
`jax.set_mesh` an array's type then says how it is split: JAX's own ops compute the split of
their results, and refuse what they cannot type. The op computes its results' splits as its
partitioner lays them out; the block-scaled recipe and the SwiGLU block's compute-dtype path,
written for Auto axes, run with the axes made Auto inside (`manual_axes.rows_in_auto_axes`).
Until 2026-12-06 every call with a bias failed to compile under `jax.set_mesh` of such a
mesh, and the FP8 layers' results were typed replicated (every device then held all of them).

Needs several devices: `tests/op/test_sharding.py` runs this file in its own pytest process, as it
does `sharding_checks.py`, whose meshes, layouts and tolerances these checks share.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import collectives
import jax_epilog
import swiglu_sharding_checks as swiglu_checks
from sharding_checks import (FP8_TOL, HIGHEST, K, LAYOUTS, MESHES, M, N, TOL, _assert_close,
                             _forward_loss, _fp8_error, _normal)


def _explicit(mesh):
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


EXPLICIT = {name: _explicit(mesh) for name, mesh in MESHES.items()}
# y's split, as its type says, for each of sharding_checks' layouts: K's axis is summed away
Y_SPECS = {"data": P("data", None), "column": P(None, "model"), "row": P(None, None),
           "data_model": P("data", "model"), "data_row": P("data", None)}


def _put(mesh, arrays, specs):
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))


def _split(x) -> tuple:
    """The mesh axes x's type splits each dimension over (None: whole)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _all_gather_bytes(text: str) -> int:
    return collectives.summarize(collectives.collectives(text)).bytes["all-gather"]


@pytest.mark.parametrize("epilog", ["relu_aux_bias", "gelu_bias"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matmul_under_explicit_axes(layout, epilog):
    """Values and gradients are the reference's; y's type says the layout's split; the
    compiled program gathers nothing."""
    mesh_name, *specs = LAYOUTS[layout]
    mesh = EXPLICIT[mesh_name]
    rng = np.random.default_rng(10)
    x, w, bias, weights = _normal(rng, M, K), _normal(rng, K, N), _normal(rng, N), \
        _normal(rng, M, N)
    args = _put(mesh, (x, w, bias, weights), (*specs, P()))
    loss = functools.partial(_forward_loss, jax_epilog.matmul, epilog)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    want = jax.value_and_grad(functools.partial(_forward_loss, jax_epilog.reference_matmul,
                                                epilog), argnums=(0, 1, 2))(x, w, bias, weights)
    with jax.set_mesh(mesh):
        got = f(*args)
        y = jax.jit(lambda x, w, b: jax_epilog.matmul(
            x, w, epilog=epilog, epilog_inputs={"bias": b}, precision=HIGHEST))(*args[:3])
        text = f.lower(*args).compile().as_text()
    _assert_close(got, want)
    y = y[0] if isinstance(y, tuple) else y
    assert _split(y) == tuple(Y_SPECS[layout])
    assert "all-gather" not in text, [l for l in text.splitlines() if "all-gather" in l][:3]


def _layer_step(block: str, fp8):
    """(loss, gradients of x and the kernels) of `swiglu` or a two-layer GELU `mlp`."""
    if block == "swiglu":
        return swiglu_checks._step(fp8)

    def loss(x, gate, up, down, target, state=None):
        del up, state
        y = jax_epilog.mlp(x, [(gate, None), (down, None)], activation="gelu", fp8=fp8)
        return jnp.sum(jnp.square((y - target).astype(jnp.float32))) / swiglu_checks.M
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))


@pytest.mark.parametrize("block", ["swiglu", "mlp"])
@pytest.mark.parametrize("recipe", list(swiglu_checks.RECIPES))
@pytest.mark.parametrize("layout", list(swiglu_checks.LAYOUTS))
def test_layers_under_explicit_axes(layout, recipe, block):
    """A training step of the SwiGLU block or an MLP (bf16, per-tensor and block-scaled FP8)
    under `jax.set_mesh` of an Explicit mesh: one device's step (to the order of its sums),
    the gradients typed with their parameters' splits, and no more gathered than the same
    step under Auto axes."""
    mesh_name, (x_spec, gate_up_spec, down_spec) = swiglu_checks.LAYOUTS[layout]
    data = swiglu_checks._data(40)
    specs = (x_spec, gate_up_spec, gate_up_spec, down_spec, x_spec)
    step = jax.jit(_layer_step(block, swiglu_checks.RECIPES[recipe]))
    want_value, want_grads = step(*data, None)
    auto = step.lower(*_put(MESHES[mesh_name], data, specs), None).compile().as_text()
    mesh = EXPLICIT[mesh_name]
    args = _put(mesh, data, specs)
    with jax.set_mesh(mesh):
        value, grads = step(*args, None)
        text = step.lower(*args, None).compile().as_text()
    assert _fp8_error((value, grads[:4]), (want_value, want_grads[:4])) <= FP8_TOL
    used = (0, 1, 2, 3) if block == "swiglu" else (0, 1, 3)
    for i in used:
        want = tuple(specs[i]) + (None,) * (grads[i].ndim - len(specs[i]))
        assert _split(grads[i]) == want, (i, jax.typeof(grads[i]))
    assert _all_gather_bytes(text) <= _all_gather_bytes(auto)


@pytest.mark.parametrize("fp8", [None, True])
def test_nnx_megatron_block_trains_under_explicit_axes(fp8):
    """An NNX block (ReLU Dense by columns, Dense by rows over "model"), created and trained
    under `jax.set_mesh` of an Explicit mesh as Flax's guides do: one device's step, the
    kernels' splits kept."""
    from flax import nnx

    import jax_epilog.nnx as en

    mesh = EXPLICIT["data_model"]
    init, part = nnx.initializers.lecun_normal(), nnx.with_partitioning

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = en.Dense(K, N, activation="relu", fp8=fp8, rngs=rngs,
                               kernel_init=part(init, (None, "model")),
                               bias_init=part(nnx.initializers.normal(), ("model",)))
            self.down = en.Dense(N, K, fp8=fp8, rngs=rngs,
                                 kernel_init=part(init, ("model", None)))

        def __call__(self, x):
            return self.down(self.up(x))

    rng = np.random.default_rng(41)
    x, target = _normal(rng, M, K), _normal(rng, M, K)

    def step(graphdef, state, x, target):
        loss = lambda params: jnp.mean(  # noqa: E731
            (nnx.merge(graphdef, params, rest)(x) - target) ** 2)
        params, rest = state
        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    with jax.set_mesh(mesh):  # Flax places annotated parameters when they are created
        graphdef, *state = nnx.split(Block(nnx.Rngs(0)), nnx.Param, ...)
    plain = jax.tree.map(np.asarray, state)  # one device's copy
    want_value, want_params = jax.jit(step, static_argnums=0)(graphdef, plain, x, target)
    with jax.set_mesh(mesh):
        data = NamedSharding(mesh, P("data", None))
        value, params = jax.jit(step, static_argnums=0)(
            graphdef, state, jax.device_put(x, data), jax.device_put(target, data))
    assert _fp8_error((value, params), (want_value, want_params)) <= (
        FP8_TOL if fp8 else TOL["atol"])
    assert _split(params["up"]["kernel"][...]) == (None, "model")
    assert _split(params["down"]["kernel"][...]) == ("model", None)


@pytest.mark.parametrize("quantizer", ["quantize_1x128", "quantize_1x128 transposed",
                                       "quantize_128x128", "quantize_rows", "quantize"])
@pytest.mark.parametrize("spec", [P("data", None), P(None, "model"), P("data", "model")])
def test_quantizers_under_explicit_axes(spec, quantizer):
    """The public quantizers on a split x: one device's bytes and scales, x8 split as x is
    (transposed with it)."""
    name, transposed = quantizer.split()[0], quantizer.endswith("transposed")
    f = jax.jit(functools.partial(getattr(jax_epilog, name),
                                  **({"transposed": True} if transposed else {})))
    rng = np.random.default_rng(42)
    x = jnp.asarray(rng.normal(size=(256, 512)) * rng.lognormal(size=(1, 512)), jnp.bfloat16)
    want = f(x)
    mesh = EXPLICIT["data_model"]
    with jax.set_mesh(mesh):
        got = f(jax.device_put(x, NamedSharding(mesh, spec)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    split = tuple(spec) + (None,) * (2 - len(spec))
    assert _split(got[0]) == (split[::-1] if transposed else split)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("layout", ["data", "column", "row", "data_model"])
def test_fp8_matmul_under_explicit_axes(layout, scaling):
    """`matmul` of FP8 operands, per-tensor and block-scaled (bound whole on every device
    where it is not partitioned): one device's product, typed as the layout splits it."""
    mesh_name, x_spec, w_spec, _ = LAYOUTS[layout]
    quantize = {"tensor": (jax_epilog.quantize, jax_epilog.quantize),
                "block": (jax_epilog.quantize_1x128, jax_epilog.quantize_128x128)}[scaling]

    def f(x, w):
        (x8, sx), (w8, sw) = quantize[0](x), quantize[1](w.T)
        return jax_epilog.matmul(x8, w8, transpose_b=True, quantization_scales={"a": sx, "b": sw},
                                 preferred_element_type=jnp.bfloat16)

    rng = np.random.default_rng(43)
    x, w = jnp.asarray(rng.normal(size=(M, 256)), jnp.bfloat16), \
        jnp.asarray(rng.normal(size=(256, N)), jnp.bfloat16)
    want = jax.jit(f)(x, w)
    mesh = EXPLICIT[mesh_name]
    with jax.set_mesh(mesh):
        got = jax.jit(f)(*_put(mesh, (x, w), (x_spec, w_spec)))
    assert _fp8_error(got, want) <= FP8_TOL
    assert _split(got) == tuple(Y_SPECS[layout])
