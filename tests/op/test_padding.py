"""Zero padding of unaligned K and N (the CUDA lowering's `padding.py`).

The padded call is run here on the CPU through the reference lowering, so it must give the
unpadded call's results for every epilog, dtype and transpose; and exporting for CUDA must
emit the custom call on aligned shapes.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from jax_epilog.op import padding
from jax_epilog.op.call import Params, epilog_matmul_p
from numpy_reference import unpack_bits
from problems import make_problem


def _normalised(a, b, inputs, epilog):
    """The primitive's rank-3 operands for a 2-D problem (batch 1, shared b and bias)."""
    bias = [jnp.asarray(inputs["bias"])[None]] if epilog.has_bias else []
    aux = [jnp.asarray(inputs[epilog.aux_input])[None]] if epilog.aux_input else []
    return [jnp.asarray(a)[None], jnp.asarray(b)[None], *bias, *aux]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("epilog", list(Epilog), ids=lambda e: e.name)
def test_padded_call_gives_the_unpadded_results(epilog, transpose_a, transpose_b, dtype):
    m, k, n = 7, 13, 10  # K and N unaligned for both dtypes
    rng = np.random.default_rng(hash((epilog, transpose_a, transpose_b, dtype)) % 2**32)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, transpose_a=transpose_a,
                                transpose_b=transpose_b, dtype=dtype)
    args = _normalised(a, b, inputs, epilog)
    params = Params(int(epilog), transpose_a, transpose_b, allow_tf32=False)
    bind = functools.partial(epilog_matmul_p.bind, **params._asdict())
    sizes = padding.padded_sizes(args[:2], params)
    assert sizes == (padding.aligned(k, dtype), padding.aligned(n, dtype))
    want = jax.jit(bind)(*args)
    got = jax.jit(padding.padded(bind, params, sizes))(*args)
    assert [g.shape for g in got] == [w.shape for w in want]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
    names = ("y", *epilog.output_names)
    for name, g, w in zip(names, got, want):
        if name == "relu_aux":  # bits past N are unspecified
            np.testing.assert_array_equal(unpack_bits(np.asarray(g), n), unpack_bits(np.asarray(w), n))
        elif name == "gelu_aux":  # columns past N are unspecified
            np.testing.assert_allclose(np.asarray(g[..., :n], np.float32),
                                       np.asarray(w[..., :n], np.float32), **tol)
        else:
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       err_msg=name, **tol)


@pytest.mark.parametrize("dtype,k,n,expected", [
    ("bfloat16", 13, 10, (16, 16)), ("float16", 64, 100, (64, 104)),
    ("float32", 13, 10, (16, 12)), ("float32", 8, 4, (8, 4))])
def test_aligned_sizes(dtype, k, n, expected):
    assert (padding.aligned(k, dtype), padding.aligned(n, dtype)) == expected


def test_export_for_cuda_pads_unaligned_shapes():
    rng = np.random.default_rng(3)
    a, b, inputs = make_problem(rng, Epilog.RELU_AUX_BIAS, m=12, n=10, k=13, dtype="bfloat16")
    f = lambda a, b, bias: jax_epilog.matmul(a, b, epilog="relu_aux_bias",
                                             epilog_inputs={"bias": bias})
    exported = jax.export.export(jax.jit(f), platforms=("cuda",),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        a, b, inputs["bias"])
    text = exported.mlir_module()
    call = next(line for line in text.splitlines() if "jax_epilog_matmul" in line)
    assert "1x12x16xbf16" in call and "1x16x16xbf16" in call, call  # a, b padded to K = N = 16
    assert exported.out_avals[0].shape == (12, 10)


def test_padding_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_PAD_UNALIGNED", "0")
    a = jax.ShapeDtypeStruct((1, 4, 13), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1, 13, 10), jnp.bfloat16)
    assert padding.padded_sizes([a, b], Params(int(Epilog.DEFAULT), False, False, False)) is None
