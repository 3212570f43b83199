"""The Flax modules against stock Flax: same parameters, same outputs, same gradients.

Every comparison builds our module and the stock one (`nnx.Linear` / `linen.Dense` followed by
the activation), checks that their parameter trees are identical in structure, shape and dtype,
moves parameters from one to the other (both directions), and compares outputs and parameter
gradients on random inputs of odd shapes.
"""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import jax_epilog.linen as fused_linen
import jax_epilog.nnx as fused_nnx
from jax_epilog.runtime import library as cuda_library
from jax_epilog.runtime import targets
from jax_epilog.tools.demo import PlainMLP, accuracy, load_digits, train

ACTIVATION_FNS = {None: lambda x: x, "relu": jax.nn.relu,
                  "gelu": lambda x: jax.nn.gelu(x, approximate=True)}
TOLERANCE = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """Exact float32 GEMMs on every device (a GPU would otherwise use TF32 in both models, with
    different rounding), so float32 results agree to float32 accuracy."""
    with jax.default_matmul_precision("highest"):
        yield


def random(shape, seed, dtype=jnp.float32):
    """Standard normal values (NumPy's generator: no JAX compilation per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def trained_checkpoint(params):
    """Parameters as training might leave them: random, nonzero biases, kernels scaled by
    1/sqrt(fan-in) so activations stay O(1) through a stack."""
    def draw(p):
        scale = 1 / np.sqrt(p.shape[0]) if p.ndim == 2 else 0.5
        return (random(p.shape, seed=p.size) * scale).astype(p.dtype)
    return jax.tree.map(draw, params)


def assert_same_tree(ours, stock):
    """Identical structure (names), shapes and dtypes: either loads into the other."""
    assert jax.tree.structure(ours) == jax.tree.structure(stock)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(ours)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(stock)]


def assert_trees_close(ours, stock, **tolerance):
    assert_same_tree(ours, stock)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(stock)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   **tolerance)


class StockDense(nnx.Module):
    """What `jax_epilog.nnx.Dense` replaces: nnx.Linear, then the activation."""

    def __init__(self, *args, activation=None, **kwargs):
        self.linear = nnx.Linear(*args, **kwargs)
        self.activation = activation

    def __call__(self, x):
        return ACTIVATION_FNS[self.activation](self.linear(x))


@nnx.jit
def nnx_output_and_grads(model, x):
    """The model's output, and d(sum(output * weights))/d(params, x) for fixed random weights."""
    y = model(x)
    weights = random(y.shape, seed=99)

    def loss(model, x):
        return jnp.sum(model(x).astype(jnp.float32) * weights)

    grads, dx = nnx.grad(loss, argnums=(0, 1))(model, x)
    return y, grads, dx


# --- NNX ------------------------------------------------------------------------------------

# (activation, use_bias, x shape, output features): every activation with and without a bias.
DENSE_CASES = [(None, True, (5, 7), 129), ("relu", True, (2, 3, 127), 9),
               ("gelu", True, (33,), 1), ("relu", False, (1, 7), 129),
               ("gelu", False, (2, 3, 127), 9), (None, False, (129, 8), 17)]


@pytest.mark.parametrize("activation, use_bias, x_shape, out_features", DENSE_CASES)
def test_nnx_dense_matches_linear(activation, use_bias, x_shape, out_features):
    in_features = x_shape[-1]
    ours = fused_nnx.Dense(in_features, out_features, activation=activation, use_bias=use_bias,
                           rngs=nnx.Rngs(0))
    stock = StockDense(in_features, out_features, activation=activation, use_bias=use_bias,
                       rngs=nnx.Rngs(0))
    # Same initialisers, same RNG draws: identical starting weights.
    assert_trees_close(nnx.state(ours), nnx.state(stock.linear), rtol=0, atol=0)

    # Load a stock checkpoint trained elsewhere (other weights, nonzero bias) into ours.
    checkpoint = trained_checkpoint(nnx.state(stock.linear))
    nnx.update(stock.linear, checkpoint)
    nnx.update(ours, checkpoint)
    x = random(x_shape, seed=1)
    y, grads, dx = nnx_output_and_grads(ours, x)
    y_stock, grads_stock, dx_stock = nnx_output_and_grads(stock, x)
    assert y.shape == y_stock.shape == (*x_shape[:-1], out_features)
    np.testing.assert_allclose(y, y_stock, **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(dx, dx_stock, **TOLERANCE[jnp.float32])
    assert_trees_close(grads, grads_stock["linear"], **TOLERANCE[jnp.float32])

    # And back: ours -> stock, from a differently initialised stock layer.
    fresh = StockDense(in_features, out_features, activation=activation, use_bias=use_bias,
                       rngs=nnx.Rngs(5))
    nnx.update(fresh.linear, nnx.state(ours))
    np.testing.assert_allclose(fresh(x), y, **TOLERANCE[jnp.float32])


@pytest.mark.parametrize("dtype, param_dtype, x_dtype", [(jnp.bfloat16, jnp.float32, jnp.float32),
                                                         (None, jnp.bfloat16, jnp.bfloat16)])
def test_nnx_dense_dtypes_match_linear(dtype, param_dtype, x_dtype):
    kwargs = dict(activation="relu", dtype=dtype, param_dtype=param_dtype)
    ours = fused_nnx.Dense(31, 17, **kwargs, rngs=nnx.Rngs(3))
    stock = StockDense(31, 17, **kwargs, rngs=nnx.Rngs(3))
    assert_same_tree(nnx.state(ours), nnx.state(stock.linear))
    x = random((6, 31), seed=2, dtype=x_dtype)
    y, grads, _ = nnx_output_and_grads(ours, x)
    y_stock, grads_stock, _ = nnx_output_and_grads(stock, x)
    assert y.dtype == y_stock.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_stock, np.float32),
                               **TOLERANCE[jnp.bfloat16])
    assert_trees_close(grads, grads_stock["linear"], **TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("activation, final_activation", [("relu", None), ("gelu", "relu")])
def test_nnx_mlp_matches_stock_layers(activation, final_activation):
    features = [129, 7, 10]
    ours = fused_nnx.MLP(65, features, activation=activation, final_activation=final_activation,
                         rngs=nnx.Rngs(0))
    stock = PlainMLP(65, features, activation=activation, final_activation=final_activation,
                     rngs=nnx.Rngs(0))
    stock_state = nnx.state(stock)
    assert_trees_close(nnx.state(ours), stock_state, rtol=0, atol=0)
    assert "kernel" in stock_state["layers"][0] and "bias" in stock_state["layers"][2]

    checkpoint = trained_checkpoint(stock_state)
    nnx.update(stock, checkpoint)
    nnx.update(ours, checkpoint)
    x = random((3, 11, 65), seed=4)
    y, grads, dx = nnx_output_and_grads(ours, x)
    y_stock, grads_stock, dx_stock = nnx_output_and_grads(stock, x)
    np.testing.assert_allclose(y, y_stock, **TOLERANCE[jnp.float32])
    np.testing.assert_allclose(dx, dx_stock, **TOLERANCE[jnp.float32])
    assert_trees_close(grads, grads_stock, **TOLERANCE[jnp.float32])

    fresh = PlainMLP(65, features, activation=activation, final_activation=final_activation,
                     rngs=nnx.Rngs(8))
    nnx.update(fresh, nnx.state(ours))
    np.testing.assert_allclose(fresh(x), y, **TOLERANCE[jnp.float32])


def test_nnx_mlp_without_bias_and_errors():
    ours = fused_nnx.MLP(9, [5, 3], use_bias=False, rngs=nnx.Rngs(0))
    assert [set(layer) for layer in nnx.state(ours)["layers"].values()] == [{"kernel"}] * 2
    x = random((4, 9), seed=6)
    kernels = [layer.kernel[...] for layer in ours.layers]
    np.testing.assert_allclose(ours(x), jax.nn.relu(x @ kernels[0]) @ kernels[1],
                               **TOLERANCE[jnp.float32])
    with pytest.raises(ValueError, match="features"):
        fused_nnx.MLP(9, [], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="activation"):
        fused_nnx.Dense(9, 3, activation="tanh", rngs=nnx.Rngs(0))(x)


def test_nnx_jit_value_and_grad_step():
    """A hand-written SGD step under nnx.jit: same loss and update as the stock model."""
    x, labels = random((37, 20), seed=7), jnp.arange(37) % 10

    def loss_fn(model, x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

    @nnx.jit
    def sgd_step(model, x, labels):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, labels)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        return loss

    ours = fused_nnx.MLP(20, [33, 10], rngs=nnx.Rngs(1))
    stock = PlainMLP(20, [33, 10], rngs=nnx.Rngs(1))
    losses = [(sgd_step(ours, x, labels), sgd_step(stock, x, labels)) for _ in range(5)]
    np.testing.assert_allclose(*zip(*losses), rtol=1e-4)
    assert losses[-1][0] < losses[0][0]
    assert_trees_close(nnx.state(ours), nnx.state(stock), rtol=1e-4, atol=1e-5)


def test_nnx_sharding_metadata_passes_through():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("data", "model"))
    bias_init = nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",))
    with jax.set_mesh(mesh):
        ours = fused_nnx.Dense(8, 16, kernel_init=init, bias_init=bias_init, rngs=nnx.Rngs(0))
        stock = nnx.Linear(8, 16, kernel_init=init, bias_init=bias_init, rngs=nnx.Rngs(0))
        ours_mlp = fused_nnx.MLP(8, [16, 4], kernel_init=init, rngs=nnx.Rngs(0))
    assert nnx.get_partition_spec(nnx.state(ours)) == nnx.get_partition_spec(nnx.state(stock))
    expected = jax.sharding.PartitionSpec("data", "model")
    assert ours.kernel[...].sharding.spec == stock.kernel[...].sharding.spec == expected
    assert ours.bias[...].sharding.spec == jax.sharding.PartitionSpec("model")
    assert ours_mlp.layers[1].kernel[...].sharding.spec == expected


# --- Linen ----------------------------------------------------------------------------------

class StockLinenDense(linen.Module):
    features: int
    activation: str = None
    use_bias: bool = True
    dtype: object = None
    param_dtype: object = jnp.float32

    @linen.compact
    def __call__(self, x):
        dense = linen.Dense(self.features, use_bias=self.use_bias, dtype=self.dtype,
                            param_dtype=self.param_dtype, name="linear")
        return ACTIVATION_FNS[self.activation](dense(x))


class StockLinenMLP(linen.Module):
    features: tuple
    activation: str = "relu"

    def setup(self):
        self.layers = [linen.Dense(f) for f in self.features]

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = ACTIVATION_FNS[self.activation](x) if i < len(self.layers) - 1 else x
        return x


@functools.partial(jax.jit, static_argnums=0)
def linen_output_and_grads(module, params, x):
    y = module.apply(params, x)
    weights = random(y.shape, seed=98)

    def loss(params, x):
        return jnp.sum(module.apply(params, x).astype(jnp.float32) * weights)

    grads, dx = jax.grad(loss, argnums=(0, 1))(params, x)
    return y, grads, dx


def check_linen_pair(ours, stock, x, wrap_stock, tolerance):
    """Initialise both; compare trees, then outputs and gradients on a stock checkpoint, then
    load ours into stock. `wrap_stock` maps our params tree to the stock module's."""
    key = jax.random.key(0)
    params = ours.init(key, x)
    stock_params = stock.init(key, x)
    assert_same_tree(wrap_stock(params), stock_params)
    checkpoint = trained_checkpoint(stock_params)
    unwrapped = jax.tree.map(lambda p: p, params)  # our tree's layout, the checkpoint's values
    unwrapped = jax.tree.unflatten(jax.tree.structure(unwrapped), jax.tree.leaves(checkpoint))
    y, grads, dx = linen_output_and_grads(ours, unwrapped, x)
    y_stock, grads_stock, dx_stock = linen_output_and_grads(stock, checkpoint, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_stock, np.float32),
                               **tolerance)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_stock, np.float32),
                               **tolerance)
    assert_trees_close(wrap_stock(grads), grads_stock, **tolerance)
    # Our parameters load into the stock module unchanged.
    np.testing.assert_allclose(np.asarray(stock.apply(wrap_stock(unwrapped), x), np.float32),
                               np.asarray(y, np.float32), **tolerance)
    return params


@pytest.mark.parametrize("activation, use_bias, x_shape, features", DENSE_CASES)
def test_linen_dense_matches_dense(activation, use_bias, x_shape, features):
    params = check_linen_pair(
        fused_linen.Dense(features, activation=activation, use_bias=use_bias),
        StockLinenDense(features, activation=activation, use_bias=use_bias),
        random(x_shape, seed=11),
        wrap_stock=lambda p: {"params": {"linear": p["params"]}},
        tolerance=TOLERANCE[jnp.float32])
    # Same key, same path, same initialisers: the stock layer's exact starting weights.
    stock = linen.Dense(features, use_bias=use_bias).init(jax.random.key(0),
                                                          random(x_shape, seed=11))
    assert_trees_close(params, stock, rtol=0, atol=0)


def test_linen_dense_dtypes_match_dense():
    kwargs = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    check_linen_pair(fused_linen.Dense(17, activation="relu", **kwargs),
                     StockLinenDense(17, activation="relu", **kwargs),
                     random((6, 31), seed=12),
                     wrap_stock=lambda p: {"params": {"linear": p["params"]}},
                     tolerance=TOLERANCE[jnp.bfloat16])


def test_linen_mlp_matches_stock_layers():
    features = (129, 7, 10)
    params = check_linen_pair(fused_linen.MLP(features), StockLinenMLP(features),
                              random((3, 11, 65), seed=13), wrap_stock=lambda p: p,
                              tolerance=TOLERANCE[jnp.float32])
    assert sorted(params["params"]) == ["layers_0", "layers_1", "layers_2"]


def test_linen_sharding_metadata_passes_through():
    init = linen.with_partitioning(linen.initializers.lecun_normal(), ("data", "model"))
    x = random((4, 8), seed=14)
    ours = fused_linen.Dense(16, kernel_init=init).init(jax.random.key(0), x)
    stock = linen.Dense(16, kernel_init=init).init(jax.random.key(0), x)
    assert linen.get_partition_spec(ours) == linen.get_partition_spec(stock)
    assert tuple(linen.get_partition_spec(ours)["params"]["kernel"]) == ("data", "model")
    mlp = fused_linen.MLP((16, 4), kernel_init=init).init(jax.random.key(0), x)
    assert tuple(linen.get_partition_spec(mlp)["params"]["layers_1"]["kernel"]) == \
        ("data", "model")


# --- training on scikit-learn's digits ------------------------------------------------------

@pytest.fixture(scope="module")
def digits():
    return load_digits(seed=0)


def test_nnx_mlp_learns_digits(digits):
    model = fused_nnx.MLP(64, [128, 128, 10], rngs=nnx.Rngs(0))
    losses = train(model, digits, epochs=20, progress=False)
    assert losses[-1] < losses[0] / 10
    assert accuracy(model, digits.x_test, digits.y_test) >= 0.95


def test_linen_mlp_train_state_learns_digits(digits):
    model = fused_linen.MLP((128, 128, 10))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), digits.x_train[:1]),
        tx=optax.adam(3e-3))

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    batch = 64
    for _ in range(20):
        order = rng.permutation(len(digits.x_train))
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start:start + batch]
            state, loss = train_step(state, digits.x_train[rows], digits.y_train[rows])
    logits = model.apply(state.params, digits.x_test)
    assert float(jnp.mean(jnp.argmax(logits, -1) == digits.y_test)) >= 0.95


# --- packaging and the GPU ------------------------------------------------------------------

def test_flax_is_optional():
    """Without Flax, `import jax_epilog` works and the Flax modules say what to install."""
    script = (
        "import sys; sys.modules['flax'] = None\n"
        "import jax_epilog\n"
        "for name in ('nnx', 'linen'):\n"
        "    try:\n"
        "        __import__('jax_epilog.' + name)\n"
        "    except ImportError as e:\n"
        "        assert 'pip install \".[flax]\"' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(name + ' imported without flax')\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.gpu
def test_nnx_mlp_runs_custom_call_on_gpu():
    assert cuda_library.available(), cuda_library.unavailable_reason()
    features = [1024, 512, 10]
    ours = fused_nnx.MLP(256, features, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    stock = PlainMLP(256, features, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = random((4096, 256), seed=15)
    graphdef, params = nnx.split(ours)
    step = jax.jit(lambda p, x: nnx_output_and_grads(nnx.merge(graphdef, p), x))
    assert targets.MATMUL.name in step.lower(params, x).as_text()
    y, grads, _ = step(params, x)
    y_stock, grads_stock, _ = nnx_output_and_grads(stock, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_stock, np.float32),
                               rtol=5e-2, atol=5e-2)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_stock)):
        scale = float(jnp.max(jnp.abs(b))) + 1e-6
        assert float(jnp.max(jnp.abs(a - b))) / scale < 5e-2
