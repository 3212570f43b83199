"""`matmul(a, b, c, alpha=, beta=)` (SPEC §6) on a CUDA device: the cuBLASLt custom call
`jax_epilog_matmul_c` (c as cuBLASLt's C, alpha and beta device scalars) against the float64
model, for every epilog, dtype, layout, FP8 operands, traced alpha/beta and autotuning.

Marked `gpu`: skipped where JAX sees no CUDA device. Run on the GPU machine with
    JAX_EPILOG_BACKEND=cublaslt pytest tests/op/test_c_alpha_beta_gpu.py -q -s -p no:cacheprovider
(`-s` shows the bias-gradient relation `test_bias_gradient_and_alpha` prints).
"""

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog, config
from jax_epilog.runtime import targets
from jax_epilog.runtime import library as cuda_library
from test_c_alpha_beta import _assert_matches, _f64, _model, _problem, _rel

pytestmark = pytest.mark.gpu

DTYPES = {"float16": ("float16", None, 4e-3), "bfloat16": ("bfloat16", None, 2e-2),
          "float32": ("float32", "highest", 1e-4)}
ALPHA, BETA = 0.75, -1.5


def _gpu():
    return jax.devices("cuda")[0]


def _run(epilog, a, b, c, inputs, alpha=ALPHA, beta=BETA, **kw):
    """The call on the GPU (no fallback warning allowed), and its lowered module's text."""
    f = jax.jit(lambda a, b, c, inputs, alpha, beta: jax_epilog.matmul(
        a, b, c, alpha=alpha, beta=beta, epilog=epilog, epilog_inputs=inputs or None, **kw))
    args = jax.device_put((a, b, c, inputs, jnp.float32(alpha), jnp.float32(beta)), _gpu())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = f.lower(*args).as_text()
        return jax.device_get(f(*args)), text


def _assert_kernel(text: str, what: str):
    """`text`: a lowered module (StableHLO)."""
    assert f"stablehlo.custom_call @{targets.MATMUL_C.name}(" in text, \
        f"{what}: the reference ran, not the cuBLASLt kernel with c"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
@pytest.mark.parametrize("shape", [(127, 129, 300, ()), (1, 8, 16, ()), (33, 136, 64, (3,))])
def test_matches_the_model(epilog, dtype, shape):
    m, n, k, lead = shape
    name, precision, tol = DTYPES[dtype]
    rng = np.random.default_rng(int(epilog) + m + n)
    a, b, c, inputs = _problem(rng, epilog, m=m, n=n, k=k, lead=lead, dtype=name)
    got, text = _run(epilog, a, b, c, inputs, precision=precision)
    _assert_kernel(text, f"{epilog.name} {dtype} {shape}")
    _assert_matches(epilog, got, a, b, c, inputs, ALPHA, BETA, tol=tol)


@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True],
                                                                           repeat=2)))
@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB, Epilog.DRELU_BGRAD,
                                    Epilog.GELU_AUX_BIAS], ids=lambda e: e.name)
def test_every_layout_runs_the_kernel(epilog, transpose_a, transpose_b):
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    rng = np.random.default_rng(int(epilog) + 2 * transpose_a + transpose_b)
    a, b, c, inputs = _problem(rng, epilog, m=129, n=127, k=1 + 128, dtype="bfloat16", **kw)
    got, text = _run(epilog, a, b, c, inputs, **kw)
    _assert_kernel(text, f"{epilog.name} {kw}")
    _assert_matches(epilog, got, a, b, c, inputs, ALPHA, BETA, tol=2e-2, **kw)


@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True],
                                                                           repeat=2)))
@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB], ids=lambda e: e.name)
def test_bias_gradient_and_alpha(epilog, transpose_a, transpose_b, capsys):
    """cuBLASLt's header documents BGRADA/BGRADB as "bias gradient based on the input matrix
    A (B)", reduced over K, without alpha; the reference (`tests/support/numpy_reference.py`) returns
    the operand's sum unscaled. Prints the observed relation g = r · sum for alpha = 0.75 and
    asserts r = 1 (r = 0.75 would mean cuBLASLt scales it by alpha)."""
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    rng = np.random.default_rng(3)
    a, b, c, inputs = _problem(rng, epilog, m=127, n=129, k=300, dtype="float32", **kw)
    (y, grads), text = _run(epilog, a, b, c, inputs, precision="highest", **kw)
    _assert_kernel(text, f"{epilog.name} {kw}")
    name = epilog.reduction_output
    _, want = _model(epilog, a, b, c, inputs, ALPHA, BETA, **kw)
    got, unscaled = _f64(grads[name]), _f64(want[name])
    ratio = float(np.vdot(got, unscaled) / np.vdot(unscaled, unscaled))
    with capsys.disabled():
        print(f"\n{epilog.name} {kw} alpha={ALPHA}: bias gradient = {ratio:.6f} x the operand's "
              f"sum (max rel. error vs unscaled sum {_rel(got, unscaled):.2e})")
    assert abs(ratio - 1.0) < 1e-3, (
        f"cuBLASLt's {epilog.name} bias gradient is {ratio:.4f} x the operand's sum with "
        f"alpha={ALPHA}: the reference and numpy_reference must follow it")
    assert _rel(got, unscaled) <= 1e-4


def test_calls_without_c_still_run_the_kernel():
    rng = np.random.default_rng(1)
    a, b, _, inputs = _problem(rng, Epilog.RELU_BIAS, m=64, n=128, k=64, dtype="bfloat16")
    f = jax.jit(lambda a, b, bias: jax_epilog.matmul(a, b, epilog="relu_bias",
                                                     epilog_inputs={"bias": bias}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = f.lower(a, b, inputs["bias"]).compile().as_text()
    assert re.search(rf'custom_call_target="{targets.MATMUL.name}"', text), text


def test_the_custom_call_runs_with_c():
    rng = np.random.default_rng(2)
    a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=64, n=128, k=64, dtype="bfloat16")
    f = jax.jit(lambda a, b, c, bias, alpha, beta: jax_epilog.matmul(
        a, b, c, alpha=alpha, beta=beta, epilog="relu_bias", epilog_inputs={"bias": bias}))
    args = (a, b, c, inputs["bias"], jnp.float32(0.5), jnp.float32(2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        text = f.lower(*args).compile().as_text()
    assert f'custom_call_target="{targets.MATMUL_C.name}"' in text
    _assert_matches(Epilog.RELU_BIAS, f(*args), a, b, c, inputs, 0.5, 2.0, tol=2e-2)


def test_new_alpha_and_beta_values_need_no_new_trace_or_plan():
    """alpha and beta are device scalars the plan reads at run time."""
    rng = np.random.default_rng(4)
    a, b, c, inputs = _problem(rng, Epilog.GELU_BIAS, m=96, n=72, k=40, dtype="float16")
    traces = []

    def g(a, b, c, bias, alpha, beta):
        traces.append(1)
        return jax_epilog.matmul(a, b, c, alpha=alpha, beta=beta, epilog="gelu_bias",
                                 epilog_inputs={"bias": bias})

    f = jax.jit(g)
    a, b, c, bias = jax.device_put((a, b, c, inputs["bias"]), _gpu())
    jax.block_until_ready(f(a, b, c, bias, jnp.float32(1.0), jnp.float32(0.0)))
    plans = cuda_library.plan_cache_size()
    for alpha, beta in [(0.5, 2.0), (-1.0, 0.25), (0.0, 1.0), (3.0, 0.0)]:
        got = f(a, b, c, bias, jnp.float32(alpha), jnp.float32(beta))
        _assert_matches(Epilog.GELU_BIAS, got, a, b, c, inputs, alpha, beta, tol=4e-3)
    assert len(traces) == 1
    assert cuda_library.plan_cache_size() == plans


# FP8 operands on the H200 (cuBLASLt 13.1, measured by test_fp8_gpu): a 16-bit result runs
# every FP8 epilog; a float32 result runs no epilog with a bias (those take the reference).
FP8_WITH_C = [(e, r) for e in (Epilog.DEFAULT, Epilog.RELU_BIAS, Epilog.GELU_AUX_BIAS)
              for r in ("bfloat16", "float16")] + [(Epilog.DEFAULT, "float32")]


@pytest.mark.parametrize("epilog,result", FP8_WITH_C, ids=lambda x: getattr(x, "name", x))
def test_fp8_operands_with_c_run_the_kernel(epilog, result):
    """a (M, K), b (K, N) e4m3: re-laid out K-major in XLA, c (the result's dtype) as is."""
    rng = np.random.default_rng(5)
    m, n, k = 127, 160, 96
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.standard_normal((k, n)) / 4, jnp.float8_e4m3fn)
    c = jnp.asarray(rng.standard_normal((m, n)), result)
    inputs = {"bias": jnp.asarray(rng.standard_normal(n), result)} if epilog.has_bias else {}
    scales = {"a": 2.0, "b": 0.5}
    got, text = _run(epilog, a, b, c, inputs, quantization_scales=scales,
                     preferred_element_type=result)
    _assert_kernel(text, f"FP8 {epilog.name} -> {result}")
    y = got[0] if isinstance(got, tuple) else got
    assert y.dtype == jnp.dtype(result)
    # The model on the scaled operands: P = (sa a) @ (sb b), then alpha P + beta c.
    want_y, want_aux = _model(epilog, 2.0 * _f64(a), 0.5 * _f64(b), c, inputs, ALPHA, BETA)
    # float32: Hopper's FP8 accumulation (measured 2e-4 of the largest value here), not float32's
    tol = 1e-2 if result != "float32" else 1e-3
    assert _rel(y, want_y) <= tol, _rel(y, want_y)
    for name, w in want_aux.items():
        assert _rel(got[1][name][..., :n], w[..., :n]) <= 4 * tol, name


def test_autotuning_a_call_with_c(tmp_path, monkeypatch, capfd):
    """The candidates run on a scratch C with beta = 1 (so C's handling is checked), the result
    is right, and the tuned algorithm is stored under a key of its own ("c=1")."""
    if not cuda_library.available():
        pytest.skip(f"the CUDA library is not loaded: {cuda_library.unavailable_reason()}")
    store = tmp_path / "autotune.txt"
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE_CACHE", str(store))
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE_LOG", "1")
    before = config.autotune()
    config.set_autotune(True)
    cuda_library.clear_plan_cache()
    try:
        rng = np.random.default_rng(6)
        a, b, c, inputs = _problem(rng, Epilog.RELU_BIAS, m=1024, n=1024, k=1024,
                                   dtype="float16")
        got, text = _run(Epilog.RELU_BIAS, a, b, c, inputs)
        _assert_kernel(text, "RELU_BIAS float16 1024^3")
        _assert_matches(Epilog.RELU_BIAS, got, a, b, c, inputs, ALPHA, BETA, tol=4e-3)
        logged = [line for line in capfd.readouterr().err.splitlines()
                  if "jax_epilog autotune:" in line]
        print(*logged, sep="\n")
        assert len(logged) == 1 and "with C" in logged[0], logged
        times = re.search(r"\[([^\]]*)\]", logged[0]).group(1).split()
        assert len([t for t in times if t != "-"]) >= 2, logged[0]  # others passed the check
        if "candidate 0" not in logged[0]:  # a winner other than the heuristic's is stored
            assert " c=1 " in store.read_text(), store.read_text()
    finally:
        config.set_autotune(before)
        cuda_library.clear_plan_cache()
