"""`jax_epilog.matmul` on the CPU (the reference lowering) against the float64 NumPy model.

Covers every epilog of SPEC §1, the mask bit layout, bias along N, sums over the right axes,
leading dims (shared and batched b, per-batch bias), transposes, jit, vmap, export and grad.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from numpy_reference import unpack_bits
from problems import TOLERANCE, assert_matches_model, make_problem

# Every size of {1, 7, 127, 128, 129, 300} appears as M, as N and as K.
SIZES = [(1, 7, 127), (7, 127, 128), (127, 128, 129), (128, 129, 300), (129, 300, 1),
         (300, 1, 7)]
LAYOUTS = {  # lead dims, b batched, bias batched
    "2d": ((), False, False),
    "lead_shared_b": ((2, 3), False, False),
    "batched_b": ((3,), True, False),
    "batched_bias": ((2,), False, True),
}


def check(epilog, *, m, n, k, lead=(), b_batched=False, bias_batched=False, transpose_a=False,
          transpose_b=False, seed=0, fn=None):
    rng = np.random.default_rng(seed)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, lead=lead, b_batched=b_batched,
                                bias_batched=bias_batched, transpose_a=transpose_a,
                                transpose_b=transpose_b)
    fn = fn or jax_epilog.matmul
    got = fn(a, b, epilog=epilog, epilog_inputs=inputs or None, transpose_a=transpose_a,
             transpose_b=transpose_b, precision=jax.lax.Precision.HIGHEST)
    assert_matches_model(epilog, got, a, b, inputs, tol=TOLERANCE["float32"], n=n,
                         transpose_a=transpose_a, transpose_b=transpose_b)


@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
@pytest.mark.parametrize("m,n,k", SIZES)
def test_every_epilog_every_size(epilog, m, n, k):
    check(epilog, m=m, n=n, k=k)


@pytest.mark.parametrize("epilog,layout", [
    (e, layout) for e in Epilog for layout in LAYOUTS if e.has_bias or not LAYOUTS[layout][2]],
    ids=str)
@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True], repeat=2)))
def test_layouts_and_transposes(epilog, layout, transpose_a, transpose_b):
    lead, b_batched, bias_batched = LAYOUTS[layout]
    check(epilog, m=9, n=130, k=17, lead=lead, b_batched=b_batched, bias_batched=bias_batched,
          transpose_a=transpose_a, transpose_b=transpose_b, seed=1)


@pytest.mark.parametrize("epilog", [Epilog.RELU_AUX_BIAS, Epilog.DRELU_BGRAD, Epilog.GELU_AUX_BIAS,
                                    Epilog.BGRADA, Epilog.BGRADB], ids=lambda e: e.name)
def test_under_jit(epilog):
    jitted = jax.jit(jax_epilog.matmul, static_argnames=("epilog", "transpose_a", "transpose_b",
                                                         "precision"))
    check(epilog, m=33, n=129, k=20, lead=(2,), fn=jitted, seed=2)


def test_mask_bit_layout_by_hand():
    """Bit j % 8 of byte j // 8, least significant first, rows padded to 128 bits."""
    a = jnp.eye(3, dtype=jnp.float32)
    b = jnp.full((3, 10), -1.0, jnp.float32).at[0, 0].set(1.0).at[1, 9].set(2.0)
    b = b.at[2, 8].set(5.0)
    y, aux = jax_epilog.matmul(a, b, epilog="relu_aux")
    mask = np.asarray(aux["relu_aux"])
    assert mask.shape == (3, 16) and mask.dtype == np.uint8
    low = np.uint8(0b11)  # byte 1 holds columns 8..15; only 8 and 9 exist (bits past N are free)
    assert mask[0, 0] == 0b1 and mask[0, 1] & low == 0
    assert mask[1, 0] == 0 and mask[1, 1] & low == 0b10
    assert mask[2, 0] == 0 and mask[2, 1] & low == 0b1
    np.testing.assert_array_equal(np.asarray(y), np.maximum(np.asarray(b), 0))
    zero = jax_epilog.matmul(a, jnp.zeros((3, 10), jnp.float32), epilog="relu_aux")[1]
    assert (np.asarray(zero["relu_aux"])[:, 0] == 0xFF).all()  # the bit means "z is not < 0"


def test_bias_runs_along_n():
    a = jnp.ones((4, 2), jnp.float32)
    b = jnp.ones((2, 3), jnp.float32)
    bias = jnp.array([10.0, 20.0, 30.0], jnp.float32)
    y = jax_epilog.matmul(a, b, epilog=Epilog.BIAS, epilog_inputs={"bias": bias})
    np.testing.assert_array_equal(np.asarray(y), np.tile([12.0, 22.0, 32.0], (4, 1)))


def test_names_and_values_are_accepted():
    rng = np.random.default_rng(3)
    a, b, inputs = make_problem(rng, Epilog.RELU_BIAS, m=5, n=6, k=7)
    by_enum = jax_epilog.matmul(a, b, epilog=Epilog.RELU_BIAS, epilog_inputs=inputs)
    by_name = jax_epilog.matmul(a, b, epilog="relu_bias", epilog_inputs=inputs)
    by_value = jax_epilog.matmul(a, b, epilog=6, epilog_inputs=inputs)
    np.testing.assert_array_equal(np.asarray(by_enum), np.asarray(by_name))
    np.testing.assert_array_equal(np.asarray(by_enum), np.asarray(by_value))


@pytest.mark.parametrize("epilog", [Epilog.RELU_AUX_BIAS, Epilog.DRELU_BGRAD, Epilog.GELU_AUX,
                                    Epilog.BGRADB], ids=lambda e: e.name)
def test_vmap_matches_loop(epilog):
    rng = np.random.default_rng(4)
    a, b, inputs = make_problem(rng, epilog, m=7, n=129, k=11, lead=(3,), b_batched=True,
                                bias_batched=True)

    def one(a, b, inputs):
        return jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=inputs or None,
                                 precision="highest")

    mapped = jax.vmap(one)(a, b, inputs)
    looped = [one(a[i], b[i], {k_: v[i] for k_, v in inputs.items()}) for i in range(3)]
    assert_same_results(mapped, jax.tree.map(lambda *xs: jnp.stack(xs), *looped), n=129)


def assert_same_results(got, want, *, n, rtol=1e-5):
    """Equal up to float32 rounding; masks compared bit by bit up to N (later bits are free)."""
    got_y, got_aux = got if isinstance(got, tuple) else (got, {})
    want_y, want_aux = want if isinstance(want, tuple) else (want, {})
    np.testing.assert_allclose(np.asarray(got_y, np.float32), np.asarray(want_y, np.float32),
                               rtol=rtol, atol=rtol)
    assert set(got_aux) == set(want_aux)
    for name in got_aux:
        if name == "relu_aux":
            np.testing.assert_array_equal(unpack_bits(np.asarray(got_aux[name]), n),
                                          unpack_bits(np.asarray(want_aux[name]), n))
        else:
            x, y = np.asarray(got_aux[name], np.float32), np.asarray(want_aux[name], np.float32)
            if name == "gelu_aux":
                x, y = x[..., :n], y[..., :n]
            np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol)


def test_vmap_over_weights_only_and_nested():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((4, 5, 3)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((3,)), jnp.float32)
    f = lambda w: jax_epilog.matmul(x, w, epilog="relu_bias", epilog_inputs={"bias": bias},
                                    precision="highest")
    want = jax.nn.relu(jnp.matmul(x, ws, precision="highest") + bias)
    np.testing.assert_allclose(jax.vmap(f)(ws), want, rtol=1e-5, atol=1e-5)
    xs = jnp.asarray(rng.standard_normal((2, 3, 6, 5)), jnp.float32)
    g = jax.vmap(jax.vmap(lambda x: jax_epilog.matmul(x, ws[0], epilog="relu",
                                                      precision="highest")))
    want = jax.nn.relu(jnp.matmul(xs, ws[0], precision="highest"))
    np.testing.assert_allclose(g(xs), want, rtol=1e-5, atol=1e-5)


def test_vmap_folds_into_one_kernel_call():
    rng = np.random.default_rng(6)
    a, b, inputs = make_problem(rng, Epilog.RELU_AUX_BIAS, m=4, n=8, k=3, lead=(5,))
    f = jax.vmap(lambda a: jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs=inputs))
    calls = kernel_calls(jax.make_jaxpr(f)(a).jaxpr)
    assert len(calls) == 1 and calls[0].invars[0].aval.shape == (5, 4, 3)


def kernel_calls(jaxpr):
    """Every epilog_matmul equation in a jaxpr, nested jaxprs (custom_vjp, jit) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "epilog_matmul":
            found.append(eqn)
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += kernel_calls(inner)
    return found


@pytest.mark.parametrize("epilog", [Epilog.DEFAULT, Epilog.BIAS, Epilog.RELU_BIAS,
                                    Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS, Epilog.GELU_AUX_BIAS,
                                    Epilog.RELU, Epilog.GELU_AUX], ids=lambda e: e.name)
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_grad_matches_plain_jax(epilog, transpose_a, transpose_b):
    rng = np.random.default_rng(7)
    a, b, inputs = make_problem(rng, epilog, m=6, n=9, k=5, lead=(2,), transpose_a=transpose_a,
                                transpose_b=transpose_b)
    probe = jnp.asarray(rng.standard_normal((2, 6, 9)), jnp.float32)

    def loss(fn):
        def f(a, b, inputs):
            out = fn(a, b, epilog=epilog, epilog_inputs=inputs or None, transpose_a=transpose_a,
                     transpose_b=transpose_b, precision="highest")
            y, aux = out if isinstance(out, tuple) else (out, {})
            total = jnp.sum(y * probe)
            if "gelu_aux" in aux:  # the pre-activation output is differentiable too
                total = total + jnp.sum(aux["gelu_aux"][..., :9] ** 2)
            return total
        return f

    got = jax.grad(loss(jax_epilog.matmul), argnums=(0, 1, 2))(a, b, inputs)
    want = jax.grad(loss(jax_epilog.reference_matmul), argnums=(0, 1, 2))(a, b, inputs)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4), got, want)


def test_grad_of_backward_epilog_raises():
    rng = np.random.default_rng(8)
    a, b, inputs = make_problem(rng, Epilog.DRELU_BGRAD, m=4, n=8, k=3)
    f = lambda a: jax_epilog.matmul(a, b, epilog="drelu_bgrad", epilog_inputs=inputs)[0].sum()
    with pytest.raises(TypeError, match="DRELU_BGRAD.*cannot be differentiated"):
        jax.grad(f)(a)


def test_export_round_trip():
    rng = np.random.default_rng(9)
    a, b, inputs = make_problem(rng, Epilog.RELU_AUX_BIAS, m=12, n=130, k=9)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias},
                                 precision="highest")

    exported = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        a, b, inputs["bias"])
    restored = jax.export.deserialize(exported.serialize())
    assert_same_results(restored.call(a, b, inputs["bias"]), f(a, b, inputs["bias"]), n=130)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_on_cpu(dtype):
    rng = np.random.default_rng(10)
    for epilog in (Epilog.RELU_AUX_BIAS, Epilog.GELU_AUX_BIAS, Epilog.DRELU_BGRAD):
        a, b, inputs = make_problem(rng, epilog, m=31, n=130, k=64, dtype=dtype)
        got = jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=inputs)
        assert got[0].dtype == jnp.dtype(dtype)
        assert_matches_model(epilog, got, a, b, inputs, tol=TOLERANCE[dtype], n=130)


# --- XLA's way (backend="xla" on CUDA): the reference as the plain expression --------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
def test_xla_way_matches_the_exact_reference_within_a_rounding(epilog, dtype):
    from jax_epilog.op import reference
    from jax_epilog.op.arguments import prepare as _prepare
    rng = np.random.default_rng(int(epilog) + len(dtype))
    a, b, inputs = make_problem(rng, epilog, m=33, n=129, k=40, dtype=dtype)
    call = _prepare(a, b, epilog, inputs, False, False, None)
    kw = dict(epilog=int(epilog), transpose_a=False, transpose_b=False)
    exact = reference.epilog_matmul(call.a, call.b, *call.inputs, exact=True, **kw)
    xla = reference.epilog_matmul(call.a, call.b, *call.inputs, exact=False, **kw)
    tol = 1e-6 if dtype == "float32" else 2e-2
    for name, e, x in zip(("y", *epilog.output_names), exact, xla):
        assert e.dtype == x.dtype and e.shape == x.shape, name
        if name == "relu_aux":  # bits can differ only where z rounds across zero
            agree = np.mean(unpack_bits(np.asarray(e), 129) == unpack_bits(np.asarray(x), 129))
            assert agree > 0.995, (name, agree)
        else:
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(e, np.float32),
                                       rtol=tol, atol=tol * 10, err_msg=name)


def test_xla_way_is_the_plain_expression_in_the_operand_dtype():
    """`relu(x @ w + b)` as a user writes it: a bf16 dot, a bf16 add, no float32 in between, so
    XLA fuses the bias and ReLU into its GEMM as it does for the user's own code."""
    from jax_epilog.op import reference
    a = jnp.ones((1, 8, 16), jnp.bfloat16)
    b = jnp.ones((1, 16, 24), jnp.bfloat16)
    bias = jnp.ones((1, 24), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda a, b, bias: reference.epilog_matmul(
        a, b, bias, epilog=int(Epilog.RELU_BIAS), transpose_a=False, transpose_b=False,
        exact=False))(a, b, bias)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [d.outvars[0].aval.dtype for d in dots] == [jnp.bfloat16]
    assert all(v.aval.dtype != jnp.float32 for e in jaxpr.eqns for v in e.outvars)


def test_nvmath_matmul_epilog_members_are_accepted_by_name():
    """nvmath-python's `MatmulEpilog` members name the same epilogs (checked by module and name,
    so nvmath need not be installed here: a stand-in enum from an `nvmath` module)."""
    import enum
    from jax_epilog.op.epilogs import as_epilog
    members = {e.name: e.value + 1000 for e in Epilog}  # values need not match; names do
    members["ALPHA_SCALE"] = 1
    stand_in = enum.IntEnum("MatmulEpilog", members, module="nvmath.bindings.cublasLt")
    for e in Epilog:
        assert as_epilog(stand_in[e.name]) is e
    with pytest.raises(ValueError, match="^epilog: nvmath-python's ALPHA_SCALE has no"):
        as_epilog(stand_in.ALPHA_SCALE)
    a = jnp.ones((4, 8), jnp.float32)
    y = jax_epilog.matmul(a, a.T, epilog=stand_in.RELU)
    np.testing.assert_allclose(np.asarray(y), np.full((4, 4), 8.0))
