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


def _host64(x):
    """x on the host in float64 (bfloat16 and float16 convert exactly)."""
    return np.asarray(x).astype(np.float64)


def numpy_expected(epilog: Epilog, a, b, inputs, *, transpose_a=False, transpose_b=False):
    """The float64 model's outputs for (possibly low-precision) operands, computed on the host
    (no JAX program per shape)."""
    as64 = {name: np.asarray(x) if name == "relu_aux" else _host64(x) for name, x in inputs.items()}
    return numpy_reference.matmul(_host64(a), _host64(b), epilog=epilog.name,
                                  transpose_a=transpose_a, transpose_b=transpose_b, **as64)


def relative_error(got, want) -> float:
    """max|got - want| / max(1, max|want|); NaN where either has one."""
    got, want = _host64(got), _host64(want)
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


def model_mismatches(epilog: Epilog, got, a, b, inputs, *, tol: float, n: int,
                     transpose_a=False, transpose_b=False, reduction_tol=None,
                     mask_margin=1e-2) -> list[str]:
    """How `matmul`'s result `got` (y or (y, aux)) differs from the float64 model: [] if not.

    Values within `tol` relative error (`reduction_tol` for the bias-gradient sums; columns of
    gelu_aux past N are unspecified). Mask bits, the N meaningful ones, equal wherever |z| is
    more than `mask_margin` of max|z| (closer to 0, rounding decides).
    """
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    want_y, want_aux = numpy_expected(epilog, a, b, inputs, **kw)
    got_y, got_aux = got if isinstance(got, tuple) else (got, {})
    if set(got_aux) != set(want_aux):
        return [f"aux keys {sorted(got_aux)}, expected {sorted(want_aux)}"]
    found = []
    for name, g, w in [("y", got_y, want_y), *((k, got_aux[k], want_aux[k]) for k in want_aux)]:
        g = np.asarray(g)
        if g.shape != w.shape:
            found.append(f"{name}: shape {g.shape}, expected {w.shape}")
        elif name == "relu_aux":
            z = pre_activation(epilog, a, b, inputs, **kw)
            decided = np.abs(z) > mask_margin * max(1.0, float(np.abs(z).max(initial=0)))
            wrong = np.count_nonzero((numpy_reference.unpack_bits(g, n)
                                      != numpy_reference.unpack_bits(w, n)) & decided)
            if g.dtype != np.uint8 or wrong:
                found.append(f"relu_aux: dtype {g.dtype}, {wrong} mask bits differ away from z = 0")
        else:
            if name == "gelu_aux":
                g, w = g[..., :n], w[..., :n]
            limit = tol if name in ("y", "gelu_aux") else (reduction_tol or tol)
            err = relative_error(g, w)
            if not err <= limit:  # `not <=`: NaN fails too
                found.append(f"{name}: relative error {err:.3g} > {limit:g}")
    return found


def assert_matches_model(epilog: Epilog, got, a, b, inputs, *, tol: float, n: int,
                         transpose_a=False, transpose_b=False):
    """`model_mismatches` as an assertion; the bias-gradient sums (over up to M * batch rows)
    may carry the rounding of that many terms: 4 * tol."""
    found = model_mismatches(epilog, got, a, b, inputs, tol=tol, n=n, transpose_a=transpose_a,
                             transpose_b=transpose_b, reduction_tol=4 * tol)
    assert not found, found
