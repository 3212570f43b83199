"""Random problems for the matmul tests: operands for any epilog, and how to compare results.

Shared by the CPU tests (against the float64 NumPy model) and the GPU tests (against the CPU
reference), so both draw inputs and judge outputs the same way.
"""

from __future__ import annotations

import numpy as np

import jax.numpy as jnp

from jax_epilog import Epilog, gelu_aux_columns, relu_mask_bytes

import numpy_reference

# Relative error allowed against a float64 result, per operand dtype (max|diff| / max|ref|).
# On the GPU, full float32 also meets cuBLASLt's own tanh and exp in the GELU epilogs.
TOLERANCE = {"float32": 2e-5, "float32_gpu": 1e-4, "float32_tf32": 5e-3, "bfloat16": 2e-2,
             "float16": 5e-3}


def make_problem(rng, epilog: Epilog, *, m, n, k, lead=(), b_batched=False, bias_batched=False,
                 transpose_a=False, transpose_b=False, dtype="float32"):
    """Random operands (never zeros) for `matmul(a, b, epilog=..., **kwargs)`."""
    dtype = jnp.dtype(dtype)
    a_shape = (*lead, k, m) if transpose_a else (*lead, m, k)
    b_lead = lead if b_batched else ()
    b_shape = (*b_lead, n, k) if transpose_b else (*b_lead, k, n)
    scale = 1.0 / np.sqrt(max(k, 1))
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = (rng.standard_normal(b_shape) * scale).astype(np.float32)
    inputs = {}
    if epilog.has_bias:
        bias_shape = (*lead, n) if bias_batched else (n,)
        inputs["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
    if epilog.aux_input == "relu_aux":
        inputs["relu_aux"] = rng.integers(0, 256, (*lead, m, relu_mask_bytes(n)), dtype=np.uint8)
    if epilog.aux_input == "gelu_aux":
        inputs["gelu_aux"] = rng.standard_normal((*lead, m, gelu_aux_columns(n))).astype(np.float32)
    cast = {name: (x if x.dtype == np.uint8 else jnp.asarray(x, dtype)) for name, x in inputs.items()}
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype), cast


def numpy_expected(epilog: Epilog, a, b, inputs, *, transpose_a=False, transpose_b=False):
    """The float64 model's outputs for (possibly low-precision) operands."""
    as64 = {name: np.asarray(jnp.asarray(x, jnp.float32)) if x.dtype != np.uint8 else np.asarray(x)
            for name, x in inputs.items()}
    return numpy_reference.matmul(
        np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32)),
        epilog=epilog.name, transpose_a=transpose_a, transpose_b=transpose_b, **as64)


def relative_error(got, want) -> float:
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def pre_activation(epilog: Epilog, a, b, inputs, *, transpose_a=False, transpose_b=False):
    """Z in float64, to tell which mask bits are decided beyond rounding."""
    no_act = Epilog.BIAS if epilog.has_bias else Epilog.DEFAULT
    z, _ = numpy_expected(no_act, a, b, {k: v for k, v in inputs.items() if k == "bias"},
                          transpose_a=transpose_a, transpose_b=transpose_b)
    return z


def assert_outputs_match(epilog: Epilog, got, want, z, *, tol: float, n: int):
    """Compare `matmul`'s result (y or (y, aux)) with the float64 model's (y, aux)."""
    want_y, want_aux = want
    got_y, got_aux = (got if isinstance(got, tuple) else (got, {}))
    assert set(got_aux) == set(want_aux), (sorted(got_aux), sorted(want_aux))
    err = relative_error(got_y, want_y)
    assert err <= tol, f"y: relative error {err:.3g} > {tol}"
    for name, want_x in want_aux.items():
        got_x = np.asarray(got_aux[name])
        if name == "relu_aux":
            assert got_x.dtype == np.uint8 and got_x.shape == want_x.shape
            decided = np.abs(z) > 1e-2 * max(1.0, float(np.max(np.abs(z))) if z.size else 1.0)
            got_bits = numpy_reference.unpack_bits(got_x, n)
            want_bits = numpy_reference.unpack_bits(want_x, n)
            wrong = np.count_nonzero((got_bits != want_bits) & decided)
            assert wrong == 0, f"relu_aux: {wrong} mask bits differ"
        elif name == "gelu_aux":
            assert got_x.shape == want_x.shape
            err = relative_error(got_x[..., :n], want_x[..., :n])
            assert err <= tol, f"gelu_aux: relative error {err:.3g} > {tol}"
        else:
            err = relative_error(got_x, want_x)
            # Sums over up to M * batch rows: allow the rounding of that many terms.
            assert err <= tol * 4, f"{name}: relative error {err:.3g} > {tol * 4}"
