"""`jax_epilog.dense`, `jax_epilog.mlp` and `jax.grad` of `jax_epilog.matmul` (SPEC §2).

Values and gradients are checked against the plain-JAX expressions (`act(x @ kernel + bias)`
and their stack) differentiated by JAX, and with finite differences (`check_grads`); on the GPU
in every dtype against a float64 NumPy model of the stack and its backward.
"""

from __future__ import annotations

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_epilog
from jaxprs import equations
import numpy_reference
from jax_epilog import Epilog
from jax_epilog.runtime import library as cuda_library
from jax_epilog.layers import functional as layers
from jax_epilog.planning import call_plan, context
@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """The plain-JAX expressions and ours both in full float32: on a GPU, DEFAULT would let
    each use TF32 in its own way (the GPU tests below set their dtypes explicitly)."""
    with jax.default_matmul_precision("float32"):
        yield

ACTIVATIONS = (None, "relu", "gelu")
PLAIN_ACTIVATION = {None: lambda z: z, "relu": jax.nn.relu,
                    "gelu": lambda z: jax.nn.gelu(z, approximate=True)}
DEEP_WIDTHS = (784, 129, 1, 300, 10)


# --- problems and references ----------------------------------------------------------------

def make_stack(seed, widths, *, lead=(2,), bias=True, bias_scale=0.5, dtype=np.float32):
    """x (*lead, widths[0]) and (kernel, bias) pairs with pre-activations of both signs.

    `bias` is a bool for every layer or a sequence of bools, one per layer.
    """
    rng = np.random.default_rng(seed)
    biases = [bias] * (len(widths) - 1) if isinstance(bias, bool) else list(bias)
    x = rng.standard_normal((*lead, widths[0])).astype(dtype)
    params = []
    for k, n, with_bias in zip(widths, widths[1:], biases):
        kernel = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
        b = (rng.standard_normal(n) * bias_scale).astype(dtype) if with_bias else None
        params.append((jnp.asarray(kernel), None if b is None else jnp.asarray(b)))
    return jnp.asarray(x), params


def plain_mlp(x, params, activation="relu", final_activation=None):
    """The stack as a JAX user writes it; JAX differentiates it."""
    h = x
    for i, (kernel, bias) in enumerate(params):
        z = h @ kernel if bias is None else h @ kernel + bias
        h = PLAIN_ACTIVATION[activation if i < len(params) - 1 else final_activation](z)
    return h


def pre_activations(x, params):
    """Every layer's pre-activation of `plain_mlp(..., "relu")` (for the distance to the kink)."""
    h, zs = x, []
    for kernel, bias in params:
        z = h @ kernel if bias is None else h @ kernel + bias
        zs.append(z)
        h = jax.nn.relu(z)
    return zs


def loss_of(fn):
    """A scalar loss whose cotangent differs per output element (so every path is exercised)."""
    def loss(x, params):
        y = fn(x, params)
        weights = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
        return jnp.sum(y.astype(jnp.float32) * weights)
    return loss


def assert_trees_close(actual, expected, *, rtol, atol):
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(actual_leaves, expected_leaves):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=rtol, atol=atol)


def mlp_fn(activation, final_activation, backward="auto", **kwargs):
    return lambda x, params: jax_epilog.mlp(x, params, activation=activation,
                                            final_activation=final_activation,
                                            backward=backward, **kwargs)


def check_against_plain(x, params, activation, final_activation, backwards=("auto",)):
    """Value and gradients of `mlp` for each strategy equal the plain stack's (one compile)."""
    def values_and_grads(fn):
        y, vjp = jax.vjp(fn, x, params)
        return y, vjp(jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape))

    @jax.jit
    def run(x, params):
        plain = values_and_grads(lambda x, p: plain_mlp(x, p, activation, final_activation))
        return plain, [values_and_grads(mlp_fn(activation, final_activation, backward))
                       for backward in backwards]

    expected, results = run(x, params)
    for result in results:
        assert_trees_close(result, expected, rtol=2e-5, atol=2e-5)


# --- dense ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backward", ["fused", "xla"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_dense_matches_plain_expression(activation, with_bias, backward):
    x, [(kernel, bias)] = make_stack(1, (37, 129), lead=(2, 3), bias=with_bias)
    dense = jax.jit(lambda x, k, b: jax_epilog.dense(x, k, b, activation=activation,
                                                      backward=backward))
    plain = jax.jit(lambda x, k, b: PLAIN_ACTIVATION[activation](
        x @ k if b is None else x @ k + b))
    np.testing.assert_allclose(dense(x, kernel, bias), plain(x, kernel, bias), rtol=2e-5,
                               atol=2e-5)
    argnums = (0, 1, 2) if with_bias else (0, 1)
    grads = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums)(x, kernel, bias)
    expected = jax.grad(lambda *a: jnp.sum(jnp.sin(plain(*a))), argnums)(x, kernel, bias)
    assert_trees_close(grads, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(7,), (1, 7), (4, 1, 3, 7)])
def test_dense_leading_dims(shape):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(5), jnp.float32)
    dense = jax.jit(lambda *a: jax_epilog.dense(*a, activation="relu"))
    y = dense(x, kernel, bias)
    assert y.shape == (*shape[:-1], 5)
    np.testing.assert_allclose(y, jax.nn.relu(x @ kernel + bias), rtol=2e-5, atol=2e-5)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) ** 2), (0, 1, 2)))(x, kernel, bias)
    expected = jax.grad(lambda x, k, b: jnp.sum(jax.nn.relu(x @ k + b) ** 2), (0, 1, 2))(
        x, kernel, bias)
    assert_trees_close(grads, expected, rtol=2e-5, atol=2e-5)


# --- mlp ------------------------------------------------------------------------------------

@pytest.mark.parametrize("final_activation", ACTIVATIONS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_deep_mlp_matches_plain_stack(activation, final_activation):
    # Uneven widths, a 1-wide layer, and the 1-wide layer without a bias.
    x, params = make_stack(3, DEEP_WIDTHS, lead=(3,), bias=(True, True, False, True))
    check_against_plain(x, params, activation, final_activation, ("fused", "xla"))


@pytest.mark.parametrize("final_activation", ACTIVATIONS)
def test_one_layer_mlp_is_dense(final_activation):
    x, params = make_stack(4, (129, 127), lead=(2, 5))
    check_against_plain(x, params, "relu", final_activation)
    (kernel, bias), = params
    np.testing.assert_array_equal(
        jax_epilog.mlp(x, params, final_activation=final_activation),
        jax_epilog.dense(x, kernel, bias, activation=final_activation))


def test_mlp_without_any_bias():
    x, params = make_stack(5, (17, 9, 33, 8), lead=(6,), bias=False)
    for activation in ("relu", "gelu"):
        check_against_plain(x, params, activation, "relu", ("fused", "xla"))


def test_fused_and_unfused_backward_agree_and_differ_in_kernels():
    x, params = make_stack(6, DEEP_WIDTHS, lead=(4,))
    grads = {}
    for backward in ("fused", "xla"):
        fn = jax.grad(loss_of(mlp_fn("relu", "relu", backward)), argnums=(0, 1))
        grads[backward] = jax.jit(fn)(x, params)
        backends = backends_by_epilog(jax.make_jaxpr(fn)(x, params))
        want = "cublaslt" if backward == "fused" else "xla"
        assert backends[Epilog.DRELU_BGRAD] == backends[Epilog.BGRADB] == {want}
        assert backends[Epilog.RELU_AUX_BIAS] == {"auto"}  # the forward: its own choice
    assert_trees_close(grads["fused"], grads["xla"], rtol=2e-5, atol=2e-5)


def kink_free_stack(widths, margin=0.5):
    """One row through a stack whose ReLU pre-activations all keep |z| >= margin, both signs.

    Finite differences are only valid away from ReLU's kink. With a single row, each bias can
    place its layer's pre-activation exactly: z = sign * (margin + |noise|), random signs.
    """
    rng = np.random.default_rng(24)
    x, params = make_stack(24, widths, lead=(1,))
    h, placed = x, []
    for kernel, _ in params:
        target = rng.choice([-1.0, 1.0], kernel.shape[1]) * (margin + rng.exponential(
            size=kernel.shape[1]))
        bias = jnp.asarray(target, jnp.float32) - (h @ kernel)[0]
        placed.append((kernel, bias))
        h = jax.nn.relu(h @ kernel + bias)
    return x, placed


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_check_grads_finite_differences(activation):
    x, params = kink_free_stack(DEEP_WIDTHS)
    zs = pre_activations(x, params)
    assert min(float(jnp.min(jnp.abs(z))) for z in zs) > 0.4
    assert all(bool(jnp.any(z > 0)) and bool(jnp.any(z < 0)) for z in zs if z.size > 1)
    for backward in ("fused", "xla"):
        check_grads(jax.jit(mlp_fn(activation, activation, backward)), (x, params), order=1,
                    modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)
    (kernel, bias) = params[0]
    check_grads(jax.jit(lambda x, k, b: jax_epilog.dense(x, k, b, activation=activation)),
                (x, kernel, bias), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


# --- what the backward keeps ----------------------------------------------------------------

def saved_residuals(fn, *args):
    """[(dtype string, shape)] of what `jax.vjp(fn, *args)` keeps for the backward."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    found = []
    for line in out.getvalue().splitlines():
        short = line.split(" ", 1)[0]  # e.g. "u8[6,16]" or "f32[]"
        dtype, _, dims = short.partition("[")
        found.append((dtype, tuple(int(d) for d in dims.rstrip("]").split(",") if d)))
    return found


def test_relu_residual_is_the_packed_mask():
    x, [(kernel, bias)] = make_stack(7, (37, 300), lead=(6,))
    residuals = saved_residuals(
        lambda x, k, b: jax_epilog.dense(x, k, b, activation="relu"), x, kernel, bias)
    assert ("u8", (6, jax_epilog.relu_mask_bytes(300))) in residuals
    assert not [r for r in residuals if r[0] != "u8" and r[1] == (6, 300)], residuals
    mask_bytes = sum(np.prod(shape) for dtype, shape in residuals if dtype == "u8")
    assert mask_bytes == 6 * 48  # 300 bits per row, padded to 384 bits, as cuBLASLt writes it


def test_mlp_residuals_are_inputs_and_masks():
    x, params = make_stack(8, DEEP_WIDTHS, lead=(5,))
    residuals = saved_residuals(lambda x, p: jax_epilog.mlp(x, p), x, params)
    for width in DEEP_WIDTHS[1:-1]:
        floats = [r for r in residuals if r[0] == "f32" and r[1] == (5, width)]
        assert len(floats) == 1, (width, residuals)  # the next layer's input, not Z as well
        assert ("u8", (5, jax_epilog.relu_mask_bytes(width))) in residuals
    gelu = saved_residuals(lambda x, p: jax_epilog.mlp(x, p, activation="gelu"), x, params)
    assert ("f32", (5, jax_epilog.gelu_aux_columns(129))) in gelu


def test_remat_policy_saving_the_mask():
    x, params = make_stack(9, (33, 64, 10), lead=(4,))
    policy = jax.checkpoint_policies.save_only_these_names(layers.RELU_MASK_NAME)
    remat = jax.checkpoint(lambda x, p: jax_epilog.mlp(x, p), policy=policy)
    residuals = saved_residuals(remat, x, params)
    assert ("u8", (4, jax_epilog.relu_mask_bytes(64))) in residuals
    assert ("f32", (4, 64)) not in residuals  # the hidden activation is recomputed
    expected = jax.grad(loss_of(lambda x, p: plain_mlp(x, p)), (0, 1))(x, params)
    for fn in (remat, jax.checkpoint(lambda x, p: jax_epilog.mlp(x, p))):
        assert_trees_close(jax.jit(jax.grad(loss_of(fn), (0, 1)))(x, params), expected,
                           rtol=2e-5, atol=2e-5)


# --- transforms -----------------------------------------------------------------------------

def test_vmap_over_examples_and_over_kernels():
    x, [(kernel, bias)] = make_stack(10, (19, 23), lead=(5, 3))
    dense = lambda x, k, b: jax_epilog.dense(x, k, b, activation="gelu")
    plain = lambda x, k, b: PLAIN_ACTIVATION["gelu"](x @ k + b)
    np.testing.assert_allclose(jax.vmap(dense, (0, None, None))(x, kernel, bias),
                               plain(x, kernel, bias), rtol=2e-5, atol=2e-5)
    kernels = jnp.stack([kernel, 2 * kernel, -kernel, kernel + 1, kernel * 0.5])
    per_example = jax.vmap(jax.grad(lambda x, k, b: jnp.sum(dense(x, k, b) ** 2), (0, 1, 2)),
                           (0, 0, None))
    expected = jax.vmap(jax.grad(lambda x, k, b: jnp.sum(plain(x, k, b) ** 2), (0, 1, 2)),
                        (0, 0, None))
    assert_trees_close(jax.jit(per_example)(x, kernels, bias), expected(x, kernels, bias),
                       rtol=5e-5, atol=5e-5)


def test_scan_over_layers():
    rng = np.random.default_rng(11)
    kernels = jnp.asarray(rng.standard_normal((4, 24, 24)) / np.sqrt(24), jnp.float32)
    biases = jnp.asarray(rng.standard_normal((4, 24)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.standard_normal((7, 24)), jnp.float32)

    def scanned(layer_fn):
        def network(x, params):
            h, _ = jax.lax.scan(lambda h, kb: (layer_fn(h, *kb), None), x, params)
            return jnp.sum(jnp.tanh(h))
        return jax.jit(jax.value_and_grad(network, (0, 1)))

    ours = scanned(lambda h, k, b: jax_epilog.dense(h, k, b, activation="relu"))
    plain = scanned(lambda h, k, b: jax.nn.relu(h @ k + b))
    assert_trees_close(ours(x, (kernels, biases)), plain(x, (kernels, biases)), rtol=2e-5,
                       atol=2e-5)


def test_forward_mode_is_refused():
    x, [(kernel, bias)] = make_stack(12, (8, 8))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: jax_epilog.dense(x, kernel, bias, activation="relu"), (x,), (x,))


# --- dtypes ---------------------------------------------------------------------------------

def test_float32_params_bfloat16_compute():
    x, [(kernel, bias)] = make_stack(13, (64, 48), lead=(8,))
    bf16 = jnp.bfloat16
    y = jax_epilog.dense(x, kernel, bias, activation="relu", dtype=bf16)
    assert y.dtype == bf16
    plain = jax.nn.relu(x.astype(bf16) @ kernel.astype(bf16) + bias.astype(bf16))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(plain, np.float32),
                               rtol=2e-2, atol=2e-2)
    grads = jax.grad(lambda x, k, b: jnp.sum(jax_epilog.dense(x, k, b, activation="relu",
                                                              dtype=bf16)), (0, 1, 2))(
        x, kernel, bias)
    assert [g.dtype for g in grads] == [jnp.float32] * 3  # each in its parameter's dtype
    # Without dtype, promotion as in `x @ kernel + bias`: bf16 input, float32 params -> float32.
    assert jax_epilog.dense(x.astype(bf16), kernel, bias).dtype == jnp.float32


def test_bad_arguments_name_themselves():
    x, [(kernel, bias)] = make_stack(14, (8, 4))
    with pytest.raises(ValueError, match="activation: expected None, 'relu' or 'gelu'"):
        jax_epilog.dense(x, kernel, bias, activation="tanh")
    with pytest.raises(ValueError, match=r"final_activation"):
        jax_epilog.mlp(x, [(kernel, bias)], final_activation="swish")
    with pytest.raises(ValueError, match=r"layers\[1\] kernel: expected shape \(4, N\)"):
        jax_epilog.mlp(x, [(kernel, bias), (kernel, bias)])
    with pytest.raises(ValueError, match=r"layers\[0\] bias: expected shape \(4,\)"):
        jax_epilog.dense(x, kernel, bias[:3])
    with pytest.raises(TypeError, match="layers: expected a non-empty sequence"):
        jax_epilog.mlp(x, [])
    with pytest.raises(ValueError, match="backward: expected one of"):
        jax_epilog.dense(x, kernel, bias, backward="fast")
    with pytest.raises(TypeError, match="dtype: expected a computation dtype"):
        jax_epilog.dense(x, kernel, bias, dtype=jnp.int32)


# --- forward= / backward=: the backend of each GEMM -----------------------------------------

def backends_by_epilog(closed_jaxpr) -> dict:
    """{epilog: {backend, ...}} of every epilog_matmul in a jaxpr, nested jaxprs included."""
    found: dict = {}
    for eqn in equations(closed_jaxpr):
        if eqn.primitive.name == "epilog_matmul":
            found.setdefault(Epilog(eqn.params["epilog"]), set()).add(eqn.params["backend"])
    return found


@pytest.mark.parametrize("forward,backward", [("auto", "auto"), ("fused", "xla"),
                                              ("xla", "fused")])
def test_forward_and_backward_choose_the_backends(forward, backward):
    x, params = make_stack(15, (129, 300, 10), lead=(6,))
    fn = jax.grad(loss_of(mlp_fn("relu", None, backward, forward=forward)), (0, 1))
    backends = backends_by_epilog(jax.make_jaxpr(fn)(x, params))
    as_backend = {"auto": "auto", "fused": "cublaslt", "xla": "xla"}
    assert backends[Epilog.RELU_AUX_BIAS] == backends[Epilog.BIAS] == {as_backend[forward]}
    assert backends[Epilog.DRELU_BGRAD] == backends[Epilog.BGRADB] == {as_backend[backward]}


@pytest.mark.parametrize("argument,value", [("forward", "unfused"), ("backward", "cublaslt"),
                                            ("forward", None), ("backward", True)])
def test_bad_backend_choice_names_itself(argument, value):
    x, params = make_stack(16, (8, 8), lead=(2,))
    with pytest.raises(ValueError, match=f"^{argument}: expected one of"):
        jax_epilog.mlp(x, params, **{argument: value})


def test_the_old_backward_spelling_warns_and_runs_xla():
    """`backward="unfused"` (the old name of "xla") still runs, as "xla", with a warning."""
    x, params = make_stack(17, (8, 8), lead=(2,))

    def backends(backward):
        fn = jax.grad(loss_of(mlp_fn("relu", None, backward)), (0, 1))
        return backends_by_epilog(jax.make_jaxpr(fn)(x, params))

    with pytest.warns(DeprecationWarning, match='backward="unfused" is spelled "xla"'):
        old = backends("unfused")
    assert old == backends("xla")


# --- jax.grad of jax_epilog.matmul ----------------------------------------------------------

FORWARD_EPILOGS = [e for e in Epilog if not e.is_backward]


@pytest.mark.parametrize("epilog", FORWARD_EPILOGS, ids=lambda e: e.name)
def test_matmul_gradient_of_forward_epilogs(epilog):
    rng = np.random.default_rng(int(epilog))
    a = jnp.asarray(rng.standard_normal((2, 7, 13)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((13, 129)) / 4, jnp.float32)
    inputs = {"bias": jnp.asarray(rng.standard_normal(129), jnp.float32)} \
        if epilog.has_bias else {}

    def loss(matmul_fn):
        def fn(a, b, inputs):
            out = matmul_fn(a, b, epilog=epilog, epilog_inputs=inputs or None,
                            precision=jax.lax.Precision.HIGHEST)
            y = out[0] if epilog.output_names else out
            return jnp.sum(jnp.sin(y))
        return fn

    grads = jax.jit(jax.grad(loss(jax_epilog.matmul), (0, 1, 2)))(a, b, inputs)
    expected = jax.grad(loss(jax_epilog.reference_matmul), (0, 1, 2))(a, b, inputs)
    # cuBLASLt's GELU epilogs evaluate tanh their own way: ~1e-5 apart in float32 (H200).
    tol = 1e-4 if epilog.activation == "gelu" else 1e-5
    assert_trees_close(grads, expected, rtol=tol, atol=tol)


def test_matmul_gradient_with_transposes_and_batched_b():
    rng = np.random.default_rng(16)
    a = jnp.asarray(rng.standard_normal((3, 11, 5)), jnp.float32)  # (..., K, M), transposed
    b = jnp.asarray(rng.standard_normal((3, 9, 11)), jnp.float32)  # (..., N, K), transposed

    def loss(matmul_fn):
        return lambda a, b: jnp.sum(matmul_fn(a, b, epilog="relu", transpose_a=True,
                                              transpose_b=True) ** 2)

    assert_trees_close(jax.grad(loss(jax_epilog.matmul), (0, 1))(a, b),
                       jax.grad(loss(jax_epilog.reference_matmul), (0, 1))(a, b),
                       rtol=1e-5, atol=1e-5)


def test_matmul_gradient_of_backward_epilog_raises():
    rng = np.random.default_rng(17)
    dz = jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((12, 10)), jnp.float32)
    mask = jnp.full((6, jax_epilog.relu_mask_bytes(12)), 0b10110101, jnp.uint8)
    with pytest.raises(TypeError, match="cannot be differentiated"):
        jax.grad(lambda dz: jnp.sum(jax_epilog.matmul(
            dz, kernel, transpose_b=True, epilog=Epilog.DRELU_BGRAD,
            epilog_inputs={"relu_aux": mask})[0]))(dz)


# --- GPU: every dtype against a float64 model of the stack -----------------------------------

# ||got - want|| / ||want|| against float64 on the same rounded inputs, through 5 layers and
# back: a few roundings of the dtype (bf16 2^-9, fp16 2^-12, float32 at DEFAULT precision runs
# TF32 on the GPU, 2^-11 on the inputs).
# Measured on the H200 for the 5-layer ReLU stack: dx 3.4e-2 (bf16) and 9.2e-3 (fp16): a
# pre-activation within rounding of 0 flips its mask bit between the two computations, and
# that difference then travels through every later layer.
GPU_TOLERANCE = {"bfloat16": 5e-2, "float16": 1.5e-2, "float32": 3e-3}


def numpy_mlp(x, params, activation, final_activation):
    """The stack in float64 NumPy (independent of JAX): (y, backward(cotangent) -> (dx, grads))."""
    act = {None: lambda z: z, "relu": lambda z: np.maximum(z, 0), "gelu": numpy_reference.gelu}
    act_grad = {None: np.ones_like, "relu": lambda z: (z > 0).astype(np.float64),
                "gelu": numpy_reference.gelu_grad}
    names = [activation] * (len(params) - 1) + [final_activation]
    hs, zs = [x], []
    for (kernel, bias), name in zip(params, names):
        zs.append(hs[-1] @ kernel + (0 if bias is None else bias))
        hs.append(act[name](zs[-1]))

    def backward(cotangent):
        dh, grads = cotangent, []
        for i in reversed(range(len(params))):
            dz = dh * act_grad[names[i]](zs[i])
            grads.append((hs[i].T @ dz, None if params[i][1] is None else dz.sum(0)))
            dh = dz @ params[i][0].T
        return dh, grads[::-1]

    return hs[-1], backward


def relative_error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_gpu_mlp_against_float64(dtype, activation, monkeypatch):
    # "auto" here is the per-problem choice of this GPU's table (conftest makes it the kernel).
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    x, params = make_stack(20, (784, 129, 1, 300, 10), lead=(256,), bias=(True, True, False, True))
    x, params = jax.tree.map(lambda a: a.astype(dtype), (x, params))
    to64 = lambda a: None if a is None else np.asarray(a.astype(jnp.float32), np.float64)
    cotangent = jnp.asarray(np.random.default_rng(21).standard_normal((256, 10)), dtype)
    value, pullback = numpy_mlp(to64(x), [(to64(k), to64(b)) for k, b in params], activation,
                                activation)
    dx, grads = pullback(to64(cotangent))
    results = {}
    for backward in ("fused", "xla", "auto"):
        fn = jax.jit(lambda x, p: jax.vjp(mlp_fn(activation, activation, backward), x, p))
        y, vjp = fn(x, params)
        results[backward] = (y, *vjp(cotangent))
        got_dx, got_grads = results[backward][1:]
        tolerance = GPU_TOLERANCE[dtype]
        assert relative_error(y, value) < tolerance
        assert relative_error(got_dx, dx) < tolerance
        for (dk, db), (want_dk, want_db) in zip(got_grads, grads):
            assert dk.dtype == jnp.dtype(dtype)
            assert relative_error(dk, want_dk) < tolerance
            if want_db is not None:
                assert relative_error(db, want_db) < tolerance
    fused, unfused = (jax.tree.leaves(results[b]) for b in ("fused", "xla"))
    for a, b in zip(fused, unfused):
        assert relative_error(a, b) < GPU_TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_dense_mixed_dtypes_against_float64(activation):
    x, [(kernel, bias)] = make_stack(22, (1024, 4097), lead=(4, 129))
    fn = jax.jit(jax.value_and_grad(
        lambda x, k, b: jnp.sum(jax_epilog.dense(x, k, b, activation=activation,
                                                 dtype=jnp.bfloat16).astype(jnp.float32) ** 2),
        (0, 1, 2)))
    value, grads = fn(x, kernel, bias)
    rounded = [np.asarray(a.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
               for a in (x, kernel, bias)]
    y, pullback = numpy_mlp(rounded[0].reshape(-1, 1024), [(rounded[1], rounded[2])], None,
                            activation)
    dx, [(dk, db)] = pullback(2 * y)
    assert relative_error(value, np.sum(y ** 2)) < 1e-2
    for got, want in zip(grads, (dx.reshape(x.shape), dk, db)):
        assert got.dtype == jnp.float32
        assert relative_error(got, want) < 2e-2


@pytest.mark.gpu
def test_gpu_hlo_calls_the_cublaslt_kernel():
    x, params = make_stack(23, (256, 512, 128), lead=(64,))
    x, params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, params))
    step = jax.jit(jax.grad(loss_of(mlp_fn("relu", None, "fused", forward="fused")), (0, 1)))
    hlo = step.lower(x, params).as_text()
    assert "jax_epilog_matmul" in hlo


# --- where every GEMM runs XLA's way on a GPU: the plain expression -------------------------

@pytest.mark.parametrize("xla_gemms,plain", [("all", True), ("all but one", False)])
def test_plain_expression_where_every_gemm_runs_xla(monkeypatch, xla_gemms, plain):
    from jax_epilog.planning import decisions
    from jax_epilog.planning import table_format
    seen = []

    def decision(epilog, dtype, *problem):
        seen.append(epilog)
        choice = "cublaslt" if xla_gemms == "all but one" and len(seen) == 2 else "xla"
        return table_format.Decision(choice, "test")

    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cuda_library, "available", lambda: True)
    monkeypatch.setattr(decisions, "decision", decision)
    # The layers' choices are under test, not matmul's own for a call whose step runs XLA.
    monkeypatch.setattr(call_plan, "plan_matmul_step", lambda *args: context.Choice("fused", "test"))
    x, params = make_stack(17, (24, 40, 16), lead=(6,))
    fn = jax.grad(loss_of(mlp_fn("relu", None)), (0, 1))
    backends = backends_by_epilog(jax.make_jaxpr(fn)(x, params))
    assert (backends == {}) == plain
    assert len(seen) == 8  # the plan asks for each GEMM: 3 per layer in a step, 1 inference
    got = jax.jit(fn)(x, params)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert_trees_close(got, jax.jit(fn)(x, params), rtol=2e-5, atol=2e-5)


def test_forced_backends_decide_without_dispatch(monkeypatch):
    from jax_epilog.planning import decisions
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cuda_library, "available", lambda: True)
    monkeypatch.setattr(decisions, "decision", lambda *a: pytest.fail("dispatch asked"))
    # The layers' choices are under test, not matmul's own for a call whose step runs XLA.
    monkeypatch.setattr(call_plan, "plan_matmul_step", lambda *args: context.Choice("fused", "test"))
    x, params = make_stack(18, (24, 40, 16), lead=(6,))
    plain = mlp_fn("relu", None, "xla", forward="xla")
    assert backends_by_epilog(jax.make_jaxpr(plain)(x, params)) == {}
    fused = mlp_fn("relu", None, "fused", forward="xla")
    assert backends_by_epilog(jax.make_jaxpr(fused)(x, params))
