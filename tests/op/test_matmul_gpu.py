"""`jax_epilog.matmul` on a CUDA device: the cuBLASLt custom call against the float64 model.

Every test here is marked `gpu` and skipped where JAX sees no CUDA device.
"""

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import command_buffers
import jax_epilog
import numpy_reference
from jax_epilog import Epilog
from jax_epilog.runtime import library as cuda_library
from problems import TOLERANCE, assert_matches_model, make_problem, pre_activation

pytestmark = pytest.mark.gpu

DTYPES = {  # name -> (dtype, precision, tolerance key)
    "float16": ("float16", None, "float16"),
    "bfloat16": ("bfloat16", None, "bfloat16"),
    "float32_tf32": ("float32", "default", "float32_tf32"),
    "float32": ("float32", "highest", "float32_gpu"),
}
SHAPES = [  # m, n, k, lead, b batched, bias batched
    (127, 129, 300, (), False, False),
    (1, 7, 128, (), False, False),
    (300, 1, 129, (), False, False),
    (33, 130, 64, (3,), True, True),
    (17, 256, 40, (2, 2), False, False),
]


def _gpu():
    return jax.devices("cuda")[0]


def _run_on_gpu(epilog, a, b, inputs, **kw):
    f = jax.jit(lambda a, b, inputs: jax_epilog.matmul(a, b, epilog=epilog,
                                                       epilog_inputs=inputs or None, **kw))
    args = jax.device_put((a, b, inputs), _gpu())
    hlo = f.lower(*args).as_text()
    return f(*args), "jax_epilog_matmul" in hlo


# Every epilog x dtype x transpose pair on the first shape; the other shapes with one
# transpose pair each (so every shape meets every transpose flag once).
TRANSPOSES = list(itertools.product([False, True], repeat=2))
CASES = [(e, d, ta, tb, SHAPES[0]) for e in Epilog for d in DTYPES for ta, tb in TRANSPOSES] + [
    (e, d, *TRANSPOSES[i % 4], shape) for e in Epilog for d in DTYPES
    for i, shape in enumerate(SHAPES[1:], start=1)]


@pytest.mark.parametrize("epilog,dtype_name,transpose_a,transpose_b,shape", CASES,
                         ids=lambda x: getattr(x, "name", str(x)))
def test_kernel_matches_float64_model(epilog, dtype_name, transpose_a, transpose_b, shape):
    m, n, k, lead, b_batched, bias_batched = shape
    dtype, precision, tol_key = DTYPES[dtype_name]
    rng = np.random.default_rng(hash((epilog, dtype_name, transpose_a, transpose_b, m)) % 2**32)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, lead=lead, b_batched=b_batched,
                                bias_batched=bias_batched and epilog.has_bias,
                                transpose_a=transpose_a, transpose_b=transpose_b, dtype=dtype)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    got, used_kernel = _run_on_gpu(epilog, a, b, inputs, precision=precision, **kw)
    if not used_kernel:  # correct either way (checked below); listed in pytest's warnings
        warnings.warn(f"cuBLASLt has no kernel for {epilog.name} {dtype_name} "
                      f"transpose_a={transpose_a} transpose_b={transpose_b} {shape[:3]}: "
                      "the reference ran", RuntimeWarning)
    assert_matches_model(epilog, jax.device_get(got), a, b, inputs, tol=TOLERANCE[tol_key], n=n,
                         **kw)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=lambda s: "x".join(map(str, s[:3])))
@pytest.mark.parametrize("transpose_a,transpose_b", TRANSPOSES)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB], ids=lambda e: e.name)
def test_bias_gradients_run_the_kernel_in_every_layout(epilog, dtype_name, transpose_a,
                                                       transpose_b, shape):
    """cuBLASLt 13.1 on the H200 has BGRADA only with a stored (K, M) and BGRADB only with b
    stored (K, N); the lowering transposes the summed operand in XLA (`call_plan.kernel_layout`)
    rather than running the reference."""
    m, n, k, lead, b_batched, _ = shape
    dtype, precision, tol_key = DTYPES[dtype_name]
    rng = np.random.default_rng(hash((epilog, dtype_name, transpose_a, transpose_b)) % 2**32)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, lead=lead, b_batched=b_batched,
                                dtype=dtype, **kw)
    got, used_kernel = _run_on_gpu(epilog, a, b, inputs, precision=precision, **kw)
    assert used_kernel, f"cuBLASLt has no kernel for {epilog.name} {dtype_name} {kw} in any layout"
    assert_matches_model(epilog, jax.device_get(got), a, b, inputs, tol=TOLERANCE[tol_key], n=n,
                         **kw)


@pytest.mark.parametrize("epilog,kw", [
    (Epilog.RELU_AUX_BIAS, {}),
    (Epilog.RELU_BIAS, {}),
    (Epilog.GELU_AUX_BIAS, {}),
    (Epilog.BIAS, {}),
    (Epilog.DRELU_BGRAD, {"transpose_b": True}),
    (Epilog.DGELU_BGRAD, {"transpose_b": True}),
    (Epilog.BGRADB, {"transpose_a": True}),
], ids=lambda x: getattr(x, "name", str(x)))
def test_training_paths_use_the_kernel(epilog, kw):
    rng = np.random.default_rng(0)
    a, b, inputs = make_problem(rng, epilog, m=256, n=512, k=128, dtype="bfloat16", **kw)
    _, used_kernel = _run_on_gpu(epilog, a, b, inputs, **kw)
    assert used_kernel, f"{epilog.name} {kw} fell back to the reference"
    assert cuda_library.available(), cuda_library.unavailable_reason()


def test_plan_cache_loop_of_1000_calls_with_changing_shapes():
    rng = np.random.default_rng(1)
    shapes = [(m, n, k) for m, n, k in itertools.product((1, 64, 129), (7, 128, 300), (8, 129))]
    problems = []
    for m, n, k in shapes:
        a, b, inputs = make_problem(rng, Epilog.RELU_AUX_BIAS, m=m, n=n, k=k, dtype="bfloat16")
        problems.append(jax.device_put((a, b, inputs), _gpu()))
    f = jax.jit(lambda a, b, inputs: jax_epilog.matmul(a, b, epilog="relu_aux_bias",
                                                       epilog_inputs=inputs))
    first = [f(*p) for p in problems]
    for i in range(1000):
        out = f(*problems[i % len(problems)])
    jax.block_until_ready(out)
    again = [f(*p) for p in problems]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(np.asarray(x[0], np.float32), np.asarray(y[0], np.float32))
        n = x[0].shape[-1]  # bits past N are unspecified (cuBLASLt leaves them as they were)
        np.testing.assert_array_equal(numpy_reference.unpack_bits(np.asarray(x[1]["relu_aux"]), n),
                                      numpy_reference.unpack_bits(np.asarray(y[1]["relu_aux"]), n))


def test_runs_inside_xla_command_buffers():
    command_buffers.check_kernel_runs_inside_command_buffers()


def _nvmath():
    try:
        import cupy  # noqa: F401
        import nvmath  # noqa: F401
    except Exception as e:  # noqa: BLE001  (any import failure means: not available here)
        pytest.skip(f"nvmath-python not importable: {e}")
    import cupy
    from nvmath.linalg.advanced import MatmulEpilog, matmul
    return cupy, MatmulEpilog, matmul


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("m,n,k", [(127, 129, 300), (256, 512, 64)])
def test_relu_aux_bias_matches_nvmath(dtype, m, n, k):
    cupy, MatmulEpilog, nv_matmul = _nvmath()
    if dtype == "bfloat16":
        pytest.skip("CuPy has no bfloat16 arrays")
    rng = np.random.default_rng(2)
    a, b, inputs = make_problem(rng, Epilog.RELU_AUX_BIAS, m=m, n=n, k=k, dtype=dtype)
    (y, aux), used_kernel = _run_on_gpu(Epilog.RELU_AUX_BIAS, a, b, inputs,
                                        precision="highest")
    assert used_kernel
    # nvmath's bias runs along the result's rows: ask it for yᵀ = bᵀ aᵀ (column-major views
    # of our row-major buffers), which is exactly the problem our kernel gives cuBLASLt.
    to_cupy = lambda x: cupy.asarray(np.asarray(jnp.asarray(x, jnp.float32))).astype(dtype)
    yt, nv_aux = nv_matmul(to_cupy(b).T, to_cupy(a).T, epilog=MatmulEpilog.RELU_AUX_BIAS,
                           epilog_inputs={"bias": to_cupy(inputs["bias"])})
    np.testing.assert_allclose(cupy.asnumpy(yt).T.astype(np.float32),
                               np.asarray(y, np.float32), rtol=1e-2, atol=1e-2)
    # nvmath's mask of yᵀ (n x m) has the logical shape (bytes per column, m): column j holds
    # row j of our y. cupy.asnumpy returns it C-ordered, so go by its shape, not its strides.
    nb = jax_epilog.relu_mask_bytes(n)
    nv_mask = cupy.asnumpy(nv_aux["relu_aux"])
    assert nv_mask.shape == (nb, m), nv_mask.shape
    ours = np.asarray(aux["relu_aux"])
    assert ours.shape == (m, nb), ours.shape
    z = pre_activation(Epilog.RELU_AUX_BIAS, a, b, inputs, transpose_a=False, transpose_b=False)
    decided = np.abs(z) > 1e-2
    theirs_bits = numpy_reference.unpack_bits(np.ascontiguousarray(nv_mask.T), n)
    ours_bits = numpy_reference.unpack_bits(ours, n)
    assert np.count_nonzero((ours_bits != (z >= 0)) & decided) == 0
    assert np.count_nonzero((theirs_bits != ours_bits) & decided) == 0
