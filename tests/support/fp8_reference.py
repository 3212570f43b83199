"""A float64 NumPy model of SPEC §5 (FP8 operands), written independently of `jax_epilog`.

P = (sa·A) @ (sb·B) in float64, the epilog of §1 on P (the float64 model of
`numpy_reference.matmul`) gives R; a 16/32-bit y is R rounded once to that type, an FP8 y is
sd·R saturated to the format's largest finite value and rounded once (NaN stays NaN);
`result_amax` is max |R|. Floating aux outputs are returned in float64 (their dtype is checked
separately: the result's for 16/32-bit results, bfloat16 for FP8 ones). The scaled operand sums
of BGRADA/BGRADB are sa·(a summed over K) and sb·(b summed over K).

It speaks the public API's shapes and takes host (NumPy / ml_dtypes) arrays. Below the model:
the FP8 problems the CPU and GPU tests draw, and how they judge a result against the model.
`make` draws operands already representable in the FP8 formats, scales that are powers of two
and aux inputs in the call's aux dtype. With `integers=True` every product, sum, bias addition
and scale multiplication is exact in float32, so y, the aux outputs and the amax must equal the
model's bit for bit wherever the epilog has no transcendental function (GELU's tanh).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import numpy_reference
from jax_epilog import Epilog, gelu_aux_columns, relu_mask_bytes

FP8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}  # the formats' largest finite values


def to_float64(x):
    return np.asarray(x).astype(np.float32).astype(np.float64)


def store(r, dtype_name: str, scale_d: float = 1.0):
    """R (float64) stored as `dtype_name`: rounded once; FP8 scaled by sd and saturated."""
    r = np.asarray(r, np.float64)
    if dtype_name in FP8:
        largest = LARGEST[dtype_name]
        x = r * scale_d
        x = np.where(np.isnan(x), x, np.clip(x, -largest, largest))
        return x.astype(FP8[dtype_name])
    target = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    return r.astype(target[dtype_name])


def matmul(a, b, *, scale_a, scale_b, scale_d=1.0, result_dtype="bfloat16", epilog="DEFAULT",
           bias=None, relu_aux=None, gelu_aux=None, transpose_a=False, transpose_b=False):
    """Returns (R float64, y stored as `result_dtype`, aux dict (float64 / uint8 masks),
    amax float64)."""
    sa, sb = float(scale_a), float(scale_b)
    kw = {}
    if bias is not None:
        kw["bias"] = to_float64(bias)
    if relu_aux is not None:
        kw["relu_aux"] = np.asarray(relu_aux)
    if gelu_aux is not None:
        kw["gelu_aux"] = to_float64(gelu_aux)
    r, aux = numpy_reference.matmul(to_float64(a) * sa, to_float64(b) * sb, epilog=epilog,
                                    transpose_a=transpose_a, transpose_b=transpose_b, **kw)
    amax = float(np.max(np.abs(r))) if r.size else 0.0
    return r, store(r, result_dtype, scale_d), aux, amax


def fp8_quantum(x, dtype_name: str):
    """Half the spacing of the FP8 format at |x| (the most one correct rounding may move x),
    at least half its smallest subnormal."""
    mantissa_bits, smallest = {"float8_e4m3fn": (3, 2.0**-9), "float8_e5m2": (2, 2.0**-16)}[
        dtype_name]
    x = np.abs(np.asarray(x, np.float64))
    exponent = np.floor(np.log2(np.maximum(x, smallest)))
    return np.maximum(2.0 ** (exponent - mantissa_bits - 1), smallest / 2)


# --- problems and judging (shared by tests/float8/test_fp8.py and tests/float8/test_fp8_gpu.py) --------

PAIRS = [("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn"),
         ("float8_e4m3fn", "float8_e5m2")]
RESULTS = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"]
MANTISSA = {"bfloat16": 7, "float16": 10, "float32": 23, "float8_e4m3fn": 3, "float8_e5m2": 2}


def aux_dtype(result_dtype: str) -> str:
    return "bfloat16" if result_dtype.startswith("float8") else result_dtype


def make(rng, epilog: Epilog, *, m, n, k, a_dtype="float8_e4m3fn", b_dtype="float8_e4m3fn",
         result_dtype="bfloat16", lead=(), b_batched=False, bias_batched=False,
         transpose_a=False, transpose_b=False, integers=False, scales=(0.5, 2.0, 0.25)):
    """(a, b, epilog_inputs, quantization_scales) for `matmul`, as JAX arrays."""
    a_shape = (*lead, k, m) if transpose_a else (*lead, m, k)
    b_lead = lead if b_batched else ()
    b_shape = (*b_lead, n, k) if transpose_b else (*b_lead, k, n)
    if integers:
        a = rng.integers(-4, 5, a_shape).astype(np.float32)
        b = rng.integers(-4, 5, b_shape).astype(np.float32)
    else:
        a = rng.standard_normal(a_shape).astype(np.float32) * 2
        b = rng.standard_normal(b_shape).astype(np.float32) / np.sqrt(max(k, 1))
    aux = aux_dtype(result_dtype)
    inputs = {}
    if epilog.has_bias:
        shape = (*lead, n) if bias_batched else (n,)
        bias = (rng.integers(-8, 9, shape) / 2 if integers else rng.standard_normal(shape))
        inputs["bias"] = jnp.asarray(bias.astype(np.float32), aux)
    if epilog.aux_input == "relu_aux":
        inputs["relu_aux"] = jnp.asarray(
            rng.integers(0, 256, (*lead, m, relu_mask_bytes(n)), dtype=np.uint8))
    if epilog.aux_input == "gelu_aux":
        inputs["gelu_aux"] = jnp.asarray(
            rng.standard_normal((*lead, m, gelu_aux_columns(n))).astype(np.float32), aux)
    sa, sb, sd = scales
    qs = {"a": np.float32(sa), "b": np.float32(sb)}
    if result_dtype.startswith("float8"):
        qs["d"] = np.float32(sd)
    return (jnp.asarray(a, a_dtype), jnp.asarray(b, b_dtype), inputs,
            {key: jnp.asarray(v) for key, v in qs.items()})


def model(epilog: Epilog, a, b, inputs, qs, *, result_dtype, transpose_a=False,
          transpose_b=False):
    host = {name: np.asarray(x) for name, x in inputs.items()}
    return matmul(
        np.asarray(a), np.asarray(b), scale_a=float(qs["a"]), scale_b=float(qs["b"]),
        scale_d=float(qs.get("d", 1.0)), result_dtype=result_dtype, epilog=epilog.name,
        transpose_a=transpose_a, transpose_b=transpose_b, **host)


def half_ulp(x, dtype_name: str):
    """The most one correct rounding to `dtype_name` moves a value near |x|."""
    if dtype_name.startswith("float8"):
        return fp8_quantum(x, dtype_name)
    x = np.abs(np.asarray(x, np.float64))
    tiny = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype_name == "bfloat16"
                                 else np.dtype(dtype_name)).tiny)
    return np.maximum(x, tiny) * 2.0 ** -(MANTISSA[dtype_name] + 1)


def mismatches(epilog: Epilog, got, a, b, inputs, qs, *, result_dtype, n, exact, rtol=0.0,
               transpose_a=False, transpose_b=False, result_amax=False,
               sum_rtol=None) -> list[str]:
    """How `matmul`'s `got` differs from the model: [] if it does not.

    exact: y, floating aux outputs and amax bit for bit. Otherwise each stored value within a
    rounding of its type of the model's unrounded value, plus `rtol` of the model's largest
    (the float32 arithmetic of the kernel and of the reference), mask bits equal where |z| is
    clear of 0. The bias gradients (sums over M) within `sum_rtol` of the largest (default
    8 · rtol): a kernel may sum the stored y or its own order of float32 partial sums.
    """
    r, want_y, want_aux, want_amax = model(epilog, a, b, inputs, qs, result_dtype=result_dtype,
                                           transpose_a=transpose_a, transpose_b=transpose_b)
    got_y, got_aux = got if isinstance(got, tuple) else (got, {})
    found = []
    expected_keys = set(want_aux) | ({"result_amax"} if result_amax else set())
    if set(got_aux) != expected_keys:
        return [f"aux keys {sorted(got_aux)}, expected {sorted(expected_keys)}"]
    got_y = np.asarray(got_y)
    if got_y.dtype != jnp.dtype(result_dtype) or got_y.shape != want_y.shape:
        return [f"y: {got_y.dtype}{got_y.shape}, expected {result_dtype}{want_y.shape}"]
    sd = float(qs.get("d", 1.0)) if result_dtype.startswith("float8") else 1.0
    scale = max(1.0, float(np.nanmax(np.abs(r), initial=0)))
    found += _compare("y", got_y, want_y, r * sd, result_dtype, exact, rtol * scale * sd)
    aux = aux_dtype(result_dtype)
    for name, want in want_aux.items():
        g = np.asarray(got_aux[name])
        if name == "relu_aux":
            z, _ = numpy_reference.matmul(
                to_float64(a) * float(qs["a"]),
                to_float64(b) * float(qs["b"]),
                epilog="BIAS" if epilog.has_bias else "DEFAULT",
                bias=None if not epilog.has_bias else to_float64(inputs["bias"]),
                transpose_a=transpose_a, transpose_b=transpose_b)
            decided = np.ones(z.shape, bool) if exact else np.abs(z) > 1e-2 * scale
            wrong = np.count_nonzero((numpy_reference.unpack_bits(g, n)
                                      != numpy_reference.unpack_bits(want, n)) & decided)
            if g.dtype != np.uint8 or wrong:
                found.append(f"relu_aux: dtype {g.dtype}, {wrong} bits differ")
            continue
        if g.dtype != jnp.dtype(aux):
            found.append(f"{name}: dtype {g.dtype}, expected {aux}")
            continue
        if name == "gelu_aux":
            g, want = g[..., :n], want[..., :n]
        if want.shape != g.shape:
            found.append(f"{name}: shape {g.shape}, expected {want.shape}")
            continue
        # The bias gradients are float32 sums of many rows: more rounding than one value.
        limit = rtol if name == "gelu_aux" else (8 * rtol if sum_rtol is None else sum_rtol)
        slack = limit * max(1.0, float(np.max(np.abs(want), initial=0)))
        found += _compare(name, g, store(want, aux), want, aux, exact, slack)
    if result_amax:
        g = np.asarray(got_aux["result_amax"])
        if g.dtype != np.float32 or g.shape != ():
            found.append(f"result_amax: {g.dtype}{g.shape}, expected float32 ()")
        elif exact and not float(g) == np.float32(want_amax):
            found.append(f"result_amax: {float(g)!r}, expected {want_amax!r}")
        elif not abs(float(g) - want_amax) <= rtol * scale + 1e-6 * want_amax:
            found.append(f"result_amax: {float(g)!r}, expected {want_amax!r}")
    return found


def _compare(name, got, want_stored, want_exact, dtype_name, exact, slack) -> list[str]:
    got64 = to_float64(got)
    if exact:
        same = (got64 == to_float64(want_stored)) | (
            np.isnan(got64) & np.isnan(to_float64(want_stored)))
        bad = np.count_nonzero(~same)
        return [f"{name}: {bad} of {same.size} values differ from the model's"] if bad else []
    target = np.asarray(want_exact, np.float64)
    if dtype_name in LARGEST:
        largest = LARGEST[dtype_name]
        target = np.where(np.isnan(target), target, np.clip(target, -largest, largest))
    err = np.abs(got64 - target)
    limit = half_ulp(target, dtype_name) * 1.01 + slack
    bad = ~(err <= limit) & ~(np.isnan(got64) & np.isnan(target))
    if np.any(bad):
        i = np.argmax(bad)
        return [f"{name}: {np.count_nonzero(bad)} values beyond a rounding of the model's (e.g. "
                f"{got64.flat[i]!r} vs {target.flat[i]!r})"]
    return []
