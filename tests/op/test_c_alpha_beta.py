"""`matmul(a, b, c, alpha=..., beta=...)` (SPEC §6) on the CPU: R = epilog(alpha · a@b + beta · c).

Every epilog against the float64 NumPy model (`numpy_reference.matmul(..., c=, alpha=, beta=)`),
odd shapes, leading dims, transposes, traced alpha/beta, gradients (against `jax.grad` of
`reference_matmul` and numerically), vmap, jit, export for CUDA from this host, sharding on 8
CPU devices (`test_c_alpha_beta_sharding.py` in its own process) and bad inputs. Calls without
c lower exactly as before (checked on the exported CUDA module).
"""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_epilog
from jax_epilog import Epilog
from jax_epilog.op.activations import gelu_aux_columns, relu_mask_bytes

import numpy_reference

HIGHEST = "highest"
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _problem(rng, epilog: Epilog, *, m, n, k, lead=(), b_batched=False, transpose_a=False,
             transpose_b=False, dtype="float32"):
    a_shape = (*lead, k, m) if transpose_a else (*lead, m, k)
    b_lead = lead if b_batched else ()
    b_shape = (*b_lead, n, k) if transpose_b else (*b_lead, k, n)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = (rng.standard_normal(b_shape) / np.sqrt(max(k, 1))).astype(np.float32)
    c = rng.standard_normal((*lead, m, n)).astype(np.float32)
    inputs = {}
    if epilog.has_bias:
        inputs["bias"] = jnp.asarray(rng.standard_normal((n,)).astype(np.float32), dtype)
    if epilog.aux_input == "relu_aux":
        inputs["relu_aux"] = rng.integers(0, 256, (*lead, m, relu_mask_bytes(n)), dtype=np.uint8)
    if epilog.aux_input == "gelu_aux":
        inputs["gelu_aux"] = jnp.asarray(
            rng.standard_normal((*lead, m, gelu_aux_columns(n))).astype(np.float32), dtype)
    return (jnp.asarray(a, dtype), jnp.asarray(b, dtype), jnp.asarray(c, dtype), inputs)


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _model(epilog, a, b, c, inputs, alpha, beta, **kw):
    as64 = {k: np.asarray(v) if k == "relu_aux" else _f64(v) for k, v in inputs.items()}
    return numpy_reference.matmul(_f64(a), _f64(b), epilog=epilog.name, c=_f64(c),
                                  alpha=float(alpha), beta=float(beta), **kw, **as64)


def _rel(got, want):
    got, want = _f64(got), _f64(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def _assert_matches(epilog, got, a, b, c, inputs, alpha, beta, *, tol, **kw):
    want_y, want_aux = _model(epilog, a, b, c, inputs, alpha, beta, **kw)
    got_y, got_aux = got if isinstance(got, tuple) else (got, {})
    assert set(got_aux) == set(want_aux)
    n = want_y.shape[-1]
    assert got_y.dtype == a.dtype
    assert _rel(got_y, want_y) <= tol, ("y", _rel(got_y, want_y))
    for name, w in want_aux.items():
        g = np.asarray(got_aux[name])
        if name == "relu_aux":
            no_act = Epilog.BIAS if epilog.has_bias else Epilog.DEFAULT
            z, _ = _model(no_act, a, b, c, {k: v for k, v in inputs.items() if k == "bias"},
                          alpha, beta, **kw)
            decided = np.abs(z) > 1e-2 * max(1.0, float(np.abs(z).max(initial=0)))
            wrong = (numpy_reference.unpack_bits(g, n) != numpy_reference.unpack_bits(w, n))
            assert not np.count_nonzero(wrong & decided), "relu_aux bits differ"
        else:
            if name == "gelu_aux":
                g, w = g[..., :n], w[..., :n]
            assert _rel(g, w) <= 4 * tol, (name, _rel(g, w))


# --- values: every epilog, odd shapes, leading dims, transposes ------------------------------

@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
@pytest.mark.parametrize("shape", [(1, 1, 1), (127, 129, 33), (33, 127, 129)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_epilog_matches_the_model(epilog, shape):
    m, n, k = shape
    rng = np.random.default_rng(int(epilog) + m)
    a, b, c, inputs = _problem(rng, epilog, m=m, n=n, k=k)
    got = jax_epilog.matmul(a, b, c, alpha=0.75, beta=-1.5, epilog=epilog, epilog_inputs=inputs,
                            precision=HIGHEST)
    _assert_matches(epilog, got, a, b, c, inputs, 0.75, -1.5, tol=TOL["float32"])


@pytest.mark.parametrize("epilog", [Epilog.DEFAULT, Epilog.RELU_AUX_BIAS, Epilog.GELU_AUX_BIAS,
                                    Epilog.DRELU_BGRAD, Epilog.DGELU, Epilog.BGRADA,
                                    Epilog.BGRADB], ids=lambda e: e.name)
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("lead,b_batched", [((), False), ((3,), False), ((2, 3), True)])
def test_leading_dims_and_transposes(epilog, transpose_a, transpose_b, lead, b_batched):
    rng = np.random.default_rng(int(epilog) + 7 * transpose_a + 3 * transpose_b + len(lead))
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    a, b, c, inputs = _problem(rng, epilog, m=9, n=17, k=5, lead=lead, b_batched=b_batched, **kw)
    got = jax_epilog.matmul(a, b, c, alpha=2.0, beta=0.5, epilog=epilog, epilog_inputs=inputs,
                            precision=HIGHEST, **kw)
    _assert_matches(epilog, got, a, b, c, inputs, 2.0, 0.5, tol=TOL["float32"], **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS,
                                    Epilog.DGELU_BGRAD], ids=lambda e: e.name)
def test_low_precision(epilog, dtype):
    rng = np.random.default_rng(int(epilog) + len(dtype))
    a, b, c, inputs = _problem(rng, epilog, m=31, n=130, k=64, dtype=dtype)
    got = jax_epilog.matmul(a, b, c, beta=1.0, epilog=epilog, epilog_inputs=inputs)
    _assert_matches(epilog, got, a, b, c, inputs, 1.0, 1.0, tol=TOL[dtype])


def test_alpha_defaults_to_one_and_beta_zero_is_the_plain_call():
    rng = np.random.default_rng(1)
    a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=8, n=16, k=4)
    kw = dict(epilog="relu_bias", epilog_inputs=inputs, precision=HIGHEST)
    plain = jax_epilog.matmul(a, b, **kw)
    np.testing.assert_allclose(jax_epilog.matmul(a, b, c, alpha=1.0, beta=0.0, **kw), plain,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax_epilog.matmul(a, b, c, beta=0, **kw), plain,
                               rtol=1e-6, atol=1e-6)
    # the bias is added after beta · c, inside the activation
    want = jax.nn.relu(jnp.matmul(a, b, precision=HIGHEST) + 2 * c + inputs["bias"])
    np.testing.assert_allclose(jax_epilog.matmul(a, b, c, beta=2, **kw), want, rtol=1e-5,
                               atol=1e-5)


def test_reference_matmul_takes_c():
    rng = np.random.default_rng(2)
    a, b, c, inputs = _problem(rng, Epilog.GELU_AUX_BIAS, m=5, n=9, k=3)
    kw = dict(alpha=0.5, beta=3.0, epilog="gelu_aux_bias", epilog_inputs=inputs,
              precision=HIGHEST)
    got, want = jax_epilog.matmul(a, b, c, **kw), jax_epilog.reference_matmul(a, b, c, **kw)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


# --- traced alpha/beta, jit, vmap --------------------------------------------------------------

def test_traced_alpha_beta_under_jit_compile_once():
    rng = np.random.default_rng(3)
    a, b, c, inputs = _problem(rng, Epilog.GELU_BIAS, m=12, n=20, k=6)
    traces = []

    @jax.jit
    def f(alpha, beta):
        traces.append(1)
        return jax_epilog.matmul(a, b, c, alpha=alpha, beta=beta, epilog="gelu_bias",
                                 epilog_inputs=inputs, precision=HIGHEST)

    for alpha, beta in ((0.5, 2.0), (-1.0, 0.25), (3.0, 0.0)):
        got = f(jnp.float32(alpha), jnp.float32(beta))
        _assert_matches(Epilog.GELU_BIAS, got, a, b, c, inputs, alpha, beta, tol=TOL["float32"])
    assert len(traces) == 1
    jaxpr = str(jax.make_jaxpr(f)(jnp.float32(1), jnp.float32(1)))
    assert "has_c=True" in jaxpr and "alpha" not in re.findall(r"\[(.*?)\]", jaxpr)[0]


def test_vmap_over_c_and_over_alpha_beta():
    rng = np.random.default_rng(4)
    a, b, _, inputs = _problem(rng, Epilog.RELU_AUX_BIAS, m=6, n=130, k=5)
    cs = jnp.asarray(rng.standard_normal((3, 6, 130)).astype(np.float32))
    alphas = jnp.asarray([0.5, 1.0, -2.0], jnp.float32)
    betas = jnp.asarray([1.0, 0.0, 3.0], jnp.float32)
    kw = dict(epilog="relu_aux_bias", epilog_inputs=inputs, precision=HIGHEST)
    by_c = jax.vmap(lambda c: jax_epilog.matmul(a, b, c, alpha=2.0, beta=1.0, **kw))(cs)
    by_all = jax.vmap(lambda c, al, be: jax_epilog.matmul(a, b, c, alpha=al, beta=be, **kw))(
        cs, alphas, betas)
    for i in range(3):
        one = jax.tree.map(lambda x: x[i], by_c)
        _assert_matches(Epilog.RELU_AUX_BIAS, one, a, b, cs[i], inputs, 2.0, 1.0,
                        tol=TOL["float32"])
        one = jax.tree.map(lambda x: x[i], by_all)
        _assert_matches(Epilog.RELU_AUX_BIAS, one, a, b, cs[i], inputs, float(alphas[i]),
                        float(betas[i]), tol=TOL["float32"])


def test_vmap_folds_into_one_call_when_alpha_beta_are_shared():
    rng = np.random.default_rng(5)
    a, b, _, _ = _problem(rng, Epilog.DEFAULT, m=4, n=8, k=3)
    cs = jnp.asarray(rng.standard_normal((5, 4, 8)).astype(np.float32))
    f = jax.vmap(lambda c: jax_epilog.matmul(a, b, c, beta=1.0))
    text = str(jax.make_jaxpr(f)(cs))
    assert text.count("epilog_matmul[") == 1 and "has_c=True" in text
    assert "f32[5,4,8] = epilog_matmul[" in text  # the mapped axis folded into the batch


# --- gradients -------------------------------------------------------------------------------

def _loss(fn, epilog, inputs_of):
    def loss(a, b, c, bias, alpha, beta):
        out = fn(a, b, c, alpha=alpha, beta=beta, epilog=epilog, epilog_inputs=inputs_of(bias),
                 precision=HIGHEST)
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))
    return loss


@pytest.mark.parametrize("epilog", [e for e in Epilog if not e.is_backward],
                         ids=lambda e: e.name)
@pytest.mark.parametrize("lead", [(), (2,)])
def test_grad_against_the_reference(epilog, lead):
    rng = np.random.default_rng(int(epilog) + 11 * len(lead))
    a, b, c, inputs = _problem(rng, epilog, m=7, n=13, k=5, lead=lead)
    bias = inputs.get("bias", jnp.zeros((13,), jnp.float32))
    inputs_of = (lambda bias: {"bias": bias}) if epilog.has_bias else (lambda bias: None)
    args = (a, b, c, bias, jnp.float32(0.75), jnp.float32(-1.25))
    got = jax.grad(_loss(jax_epilog.matmul, epilog, inputs_of), argnums=range(6))(*args)
    want = jax.grad(_loss(jax_epilog.reference_matmul, epilog, inputs_of),
                    argnums=range(6))(*args)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=f"argument {i}")


@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_check_grads_numerically(transpose_a, transpose_b):
    rng = np.random.default_rng(6)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    a, b, c, inputs = _problem(rng, Epilog.GELU_BIAS, m=3, n=5, k=4, lead=(2,), **kw)
    a64 = lambda x: jnp.asarray(x, jnp.float32)

    def f(a, b, c, bias, alpha, beta):
        return jax_epilog.matmul(a, b, c, alpha=alpha, beta=beta, epilog="gelu_bias",
                                 epilog_inputs={"bias": bias}, precision=HIGHEST, **kw)

    check_grads(f, (a, b, c, a64(inputs["bias"]), jnp.float32(0.7), jnp.float32(1.3)),
                order=1, modes=["rev"], eps=1e-2, atol=5e-2, rtol=5e-2)


def test_python_number_alpha_beta_are_not_differentiated_but_c_is():
    rng = np.random.default_rng(7)
    a, b, c, _ = _problem(rng, Epilog.RELU, m=4, n=8, k=3)
    dc = jax.grad(lambda c: jax_epilog.matmul(a, b, c, alpha=2.0, beta=3.0, epilog="relu",
                                              precision=HIGHEST).sum())(c)
    z = 2.0 * _f64(a) @ _f64(b) + 3.0 * _f64(c)
    np.testing.assert_allclose(dc, np.where(z > 0, 3.0, 0.0), rtol=1e-6)


def test_grad_under_jit_and_checkpoint():
    rng = np.random.default_rng(8)
    a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=6, n=10, k=4)

    def loss(fn, alpha, beta, c):
        return jnp.sum(fn(a, b, c, alpha=alpha, beta=beta, epilog="relu_bias",
                          epilog_inputs=inputs, precision=HIGHEST) ** 2)

    g = jax.jit(jax.grad(jax.checkpoint(lambda *x: loss(jax_epilog.matmul, *x)),
                         argnums=(0, 1, 2)))(jnp.float32(0.5), jnp.float32(2.0), c)
    w = jax.grad(lambda *x: loss(jax_epilog.reference_matmul, *x), argnums=(0, 1, 2))(
        jnp.float32(0.5), jnp.float32(2.0), c)
    for x, y in zip(g, w):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-5)


# --- FP8 operands with c ---------------------------------------------------------------------

def test_fp8_operands_with_a_16_bit_c():
    rng = np.random.default_rng(9)
    a = jnp.asarray(rng.standard_normal((16, 32)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((32, 16)) / 4, jnp.float8_e4m3fn)
    c = jnp.asarray(rng.standard_normal((16, 16)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(16), jnp.bfloat16)
    y = jax_epilog.matmul(a, b, c, alpha=0.5, beta=2.0, epilog="relu_bias",
                          epilog_inputs={"bias": bias},
                          quantization_scales={"a": 2.0, "b": 0.5})
    assert y.dtype == jnp.bfloat16
    z = 0.5 * (2.0 * _f64(a)) @ (0.5 * _f64(b)) + 2.0 * _f64(c) + _f64(bias)
    assert _rel(y, np.maximum(z, 0)) <= 1e-2
    with pytest.raises(TypeError, match=r"c: an FP8 result"):
        jax_epilog.matmul(a, b, c, beta=1.0, quantization_scales={"a": 1.0, "b": 1.0},
                          preferred_element_type=jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"c: expected dtype bfloat16"):
        jax_epilog.matmul(a, b, c.astype(jnp.float32), beta=1.0,
                          quantization_scales={"a": 1.0, "b": 1.0})


# --- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    a = jnp.ones((2, 4, 3), jnp.float32)
    b = jnp.ones((3, 5), jnp.float32)
    c = jnp.ones((2, 4, 5), jnp.float32)
    with pytest.raises(TypeError, match=r"beta: required when c is given"):
        jax_epilog.matmul(a, b, c)
    with pytest.raises(TypeError, match=r"beta: only with c"):
        jax_epilog.matmul(a, b, beta=1.0)
    with pytest.raises(TypeError, match=r"alpha: only with c"):
        jax_epilog.matmul(a, b, alpha=2.0)
    with pytest.raises(ValueError, match=r"c: expected shape \(2, 4, 5\).*got \(4, 5\)"):
        jax_epilog.matmul(a, b, c[0], beta=1.0)
    with pytest.raises(ValueError, match=r"c: expected shape"):
        jax_epilog.matmul(a, b, jnp.ones((2, 4, 6), jnp.float32), beta=1.0)
    with pytest.raises(TypeError, match=r"c: expected dtype float32 .*got bfloat16"):
        jax_epilog.matmul(a, b, c.astype(jnp.bfloat16), beta=1.0)
    with pytest.raises(TypeError, match=r"c: expected dtype float32 .*got float64"):
        jax_epilog.matmul(a, b, np.ones((2, 4, 5)), beta=1.0)
    with pytest.raises(TypeError, match=r"beta: expected dtype float32"):
        jax_epilog.matmul(a, b, c, beta=jnp.ones((), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"alpha: expected a scalar"):
        jax_epilog.matmul(a, b, c, alpha=jnp.ones((1,), jnp.float32), beta=1.0)
    with pytest.raises(TypeError, match=r"alpha: expected a float32 scalar"):
        jax_epilog.matmul(a, b, c, alpha="2", beta=1.0)
    with pytest.raises(TypeError, match=r"beta: expected a float32 scalar"):
        jax_epilog.matmul(a, b, c, beta=True)


# --- CUDA lowering from this host ---------------------------------------------------------------

def _export_for_cuda(f, *args):
    return jax.export.export(jax.jit(f), platforms=("cuda",),
                             disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(*args)


def test_export_for_cuda_has_the_c_custom_call_and_round_trips_on_cpu():
    rng = np.random.default_rng(10)
    a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=12, n=130, k=9)

    def f(a, b, c, bias, alpha, beta):
        return jax_epilog.matmul(a, b, c, alpha=alpha, beta=beta, epilog="relu_bias",
                                 epilog_inputs={"bias": bias}, precision=HIGHEST)

    args = (a, b, c, inputs["bias"], jnp.float32(0.5), jnp.float32(2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = _export_for_cuda(f, *args).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and "@jax_epilog_matmul_c(" in calls[0], calls
    # K 9 -> 12 and N 130 -> 132 (float32 pads to 4): c is padded like y; alpha and beta are
    # the function's own arguments (traced, so a new value does not recompile).
    signature = calls[0].rsplit(" : ", 1)[1]
    assert ("(tensor<1x12x12xf32>, tensor<1x12x132xf32>, tensor<1x132xf32>, "
            "tensor<1x12x132xf32>, tensor<f32>, tensor<f32>) -> (tensor<1x12x132xf32>, "
            "tensor<") in signature, signature
    assert re.search(r"custom_call @jax_epilog_matmul_c\(.*%arg4, %arg5\)", calls[0]), calls[0]
    both = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"),
                             disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))
    restored = jax.export.deserialize(both(*args).serialize())
    np.testing.assert_allclose(restored.call(*args), f(*args), rtol=1e-6, atol=1e-6)


def test_calls_without_c_still_lower_to_the_same_custom_call():
    rng = np.random.default_rng(11)
    a, b, _, inputs = _problem(rng, Epilog.RELU_AUX_BIAS, m=16, n=128, k=16)

    def f(a, b, bias):
        return jax_epilog.matmul(a, b, epilog="relu_aux_bias", epilog_inputs={"bias": bias})

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = _export_for_cuda(f, a, b, inputs["bias"]).mlir_module()
    calls = [line for line in text.splitlines() if "jax_epilog_matmul" in line]
    assert len(calls) == 1
    # a, b, bias: three operands, as before (no c, alpha, beta)
    operands = re.search(r"stablehlo.custom_call @jax_epilog_matmul\((.*?)\)", calls[0])
    assert operands and len(operands.group(1).split(",")) == 3, calls[0]
    # the same attributes as before c existed (and fast_accumulation, false without FP8)
    attributes = re.search(r"backend_config = \{(.*?)\}", calls[0])
    assert attributes and attributes.group(1) == (
        "allow_tf32 = true, epilog = 134 : i32, fast_accumulation = false, transpose_a = false, "
        "transpose_b = false"), calls[0]


# --- sharding on 8 CPU devices ---------------------------------------------------------------

@pytest.mark.slow
def test_sharded_on_8_host_cpu_devices():
    checks = Path(__file__).with_name("test_c_alpha_beta_sharding.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    # The child imports the jax_epilog this process imported (installed or the source tree).
    package_root = str(Path(jax_epilog.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                        if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", str(checks), "-q", "-p",
                           "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"],
                          env=env, cwd=checks.parent, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


# --- edge cases -------------------------------------------------------------------------------

def test_empty_problems():
    y = jax_epilog.matmul(jnp.ones((0, 3)), jnp.ones((3, 5)), jnp.ones((0, 5)), beta=1.0)
    assert y.shape == (0, 5)
    # K = 0: P = 0, so R = relu(beta · c)
    y = jax_epilog.matmul(jnp.ones((4, 0)), jnp.ones((0, 5)), jnp.full((4, 5), -2.0),
                          beta=-1.5, epilog="relu")
    np.testing.assert_array_equal(y, np.full((4, 5), 3.0))


def test_per_batch_bias_with_a_shared_b():
    rng = np.random.default_rng(12)
    a = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((2, 5)), jnp.float32)
    y = jax_epilog.matmul(a, b, c, alpha=0.5, beta=2.0, epilog="bias",
                          epilog_inputs={"bias": bias}, precision=HIGHEST)
    want = 0.5 * _f64(a) @ _f64(b) + 2 * _f64(c) + _f64(bias)[:, None, :]
    assert _rel(y, want) <= TOL["float32"]
    dbias, dc = jax.grad(lambda bias, c: jax_epilog.matmul(
        a, b, c, beta=2.0, epilog="bias", epilog_inputs={"bias": bias}).sum(),
        argnums=(0, 1))(bias, c)
    np.testing.assert_allclose(dbias, np.full((2, 5), 3.0))
    np.testing.assert_allclose(dc, np.full((2, 3, 5), 2.0))


def test_grad_of_per_example_alpha_through_vmap():
    rng = np.random.default_rng(13)
    a, b, c, _ = _problem(rng, Epilog.DEFAULT, m=3, n=5, k=4)
    alphas = jnp.asarray([1.0, 2.0], jnp.float32)
    g = jax.grad(lambda al: jax.vmap(lambda x: jax_epilog.matmul(
        a, b, c, alpha=x, beta=1.0, precision=HIGHEST).sum())(al).sum())(alphas)
    np.testing.assert_allclose(g, np.full(2, (_f64(a) @ _f64(b)).sum()), rtol=1e-5)
