"""FP8 training in `dense` / `mlp` and the Flax modules (`fp8=`, SPEC §5), on the CPU.

On a CPU an FP8 `matmul` runs the exact reference, so an FP8 layer computes exactly the
quantized math. `model_stack` below is an independent NumPy model of it (per-tensor current
scaling, a saturating cast, float64 products of the FP8 values): forward values and every
gradient must match it to float32 rounding, and must differ from the unquantized layer by FP8
rounding only (more than float32 rounding, so the comparison with the model can fail).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jaxprs import traced_equations
import numpy_reference
from jax_epilog import Fp8
from jax_epilog.float8 import recipe
from jax_epilog.layers import fp8_step
from jax_epilog.op.amaxes import amaxes
from jax_epilog.planning import stack_plan
from test_layers import make_stack, saved_residuals

ALL = Fp8(layers="all")
FORMATS = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


# --- the independent model ----------------------------------------------------------------

def quantize(x, amax, fmt: str, margin: int = 0):
    """(x in FP8, float32 dequantization scale): q = largest / 2**margin / amax in float32."""
    largest = float(ml_dtypes.finfo(FORMATS[fmt]).max)
    amax = np.float32(amax)
    with np.errstate(divide="ignore", over="ignore"):
        q = np.float32(largest / 2.0**margin) / amax
    if not (amax > 0 and np.isfinite(amax) and np.isfinite(q)):
        q = np.float32(1.0)
    x8 = np.clip(np.asarray(x, np.float32) * q, -largest, largest).astype(FORMATS[fmt])
    return x8, np.float32(1.0) / q


def gemm(a8, sa, b8, sb):
    """(sa·a8) @ (sb·b8): exact FP8 values, a float64 product, cuBLASLt's sa·sb scale."""
    return (a8.astype(np.float64) @ b8.astype(np.float64)) * np.float64(np.float32(sa * sb))


def derivative(activation, z):
    if activation == "relu":
        return (~(z < 0)).astype(np.float64)
    return numpy_reference.gelu_grad(z)


def model_stack(x, params, activations, dy, quantized, config=ALL, dtype=np.float32,
                histories=None):
    """(y, dx, [(dkernel, dbias)]) of the FP8 stack in float64, each result rounded to the
    compute `dtype` (float32 or bfloat16) and returned as float32.

    `quantized[i]` says which layers run FP8; the others are the plain layer. Under current
    scaling (`histories` None) every amax is that of the tensor as stored (rounded to
    `dtype`): the layers take it with an XLA reduction, never from a GEMM's epilog.

    With `histories` (each layer's (input, gradient) amax history) the result gains the next
    histories, this step's amaxes first. Under delayed scaling (`config.scaling` "delayed",
    or "auto" with histories) each layer input's scale comes from its history's largest
    value, and so does the gradient scale of a ReLU layer followed by an FP8 layer, whose dZ8
    the data-gradient GEMM writes (the mask h8 > 0 applied to the FP8 values, the amax before
    it, the bias gradient their sum); the other gradients are scaled by their current amax.
    A cold history (largest value 0 or not finite) gives, for a tensor quantized on its own,
    its current amax, and for one a GEMM writes, the power of two at or above the bound
    amax(A)·max column sum |B| (+ max |bias|) on that GEMM's result. With bfloat16 compute, a layer with a bias or an activation followed
    by an FP8 layer writes that layer's FP8 input itself: `q·R` of its float32 result R, the
    amax R's (not rounded to bfloat16 first).
    """
    rnd = lambda v: np.asarray(np.asarray(v, np.float32).astype(dtype), np.float32)
    delayed = config.resolved(histories is not None).scaling == "delayed"
    written_below = [q and i + 1 < len(params) and quantized[i + 1] and act == "relu"
                     for i, (q, act) in enumerate(zip(quantized, activations))]
    # Self-calibration: a cold history's tensor takes `cold` (its current amax, or a bound)
    warm = lambda h: np.isfinite(np.max(h)) and np.max(h) > 0
    scale_amax = lambda history, cold: np.max(history) if warm(history) else cold
    above = lambda bound: np.float32(2.0 ** np.ceil(np.log2(np.float32(bound))))
    column_sums = lambda b, axis: np.max(np.sum(np.abs(np.asarray(b, np.float32)), axis=axis))
    h, saved, input_amaxes, direct, direct_bound = rnd(x), [], [], None, None
    for i, ((kernel, bias), act, q) in enumerate(zip(params, activations, quantized)):
        kernel = rnd(kernel)
        if q:
            source = h if direct is None else direct
            input_amaxes.append(np.max(np.abs(source)))
            cold = input_amaxes[-1] if direct is None else above(direct_bound)
            h8, sh = quantize(source, scale_amax(histories[i][0], cold) if delayed
                              else input_amaxes[-1], config.forward, config.margin)
            w8, sw = quantize(kernel, np.max(np.abs(kernel)), config.forward, config.margin)
            z = gemm(h8, sh, w8, sw)
            saved.append((h8, sh, w8, sw))
        else:
            input_amaxes.append(None)
            z = h.astype(np.float64) @ kernel
            saved.append((h, None, kernel, None))
        z = z if bias is None else z + rnd(bias)
        r = z if act is None else np.maximum(z, 0) if act == "relu" else numpy_reference.gelu(z)
        saved[-1] += (z,)
        h = rnd(r)
        writes_fp8 = delayed and dtype == ml_dtypes.bfloat16 and q and i + 1 < len(params) \
            and quantized[i + 1] and (bias is not None or act is not None)
        direct = np.asarray(r, np.float32) if writes_fp8 else None
        if writes_fp8:  # |h W + b| <= amax(h)·max column sum |W| + max |b|, in float32
            direct_bound = np.float32(input_amaxes[-1]) * column_sums(kernel, 0) + \
                (np.float32(0) if bias is None else np.max(np.abs(rnd(bias))))
    y = h
    dz = rnd(dy) if activations[-1] is None else rnd(rnd(dy) * derivative(activations[-1],
                                                                          saved[-1][4]))
    grads, gradient_amaxes, written = [], {}, None
    for i in reversed(range(len(params))):
        h_in, sh, kernel, sw, _ = saved[i]
        if quantized[i]:
            if written is None:
                gradient_amaxes[i] = np.max(np.abs(dz))
                dz8, sg = quantize(dz, gradient_amaxes[i], config.gradient, config.margin)
                dbias = None if params[i][1] is None else rnd(dz.astype(np.float64).sum(0))
            else:
                dz8, sg = written
                dbias = None if params[i][1] is None else \
                    rnd(dz8.astype(np.float64).sum(0) * np.float64(sg))
            dkernel = gemm(h_in.T, sh, dz8, sg)
            dprev = gemm(dz8, sg, kernel.T, sw)
        else:
            dkernel = h_in.astype(np.float64).T @ dz
            dprev = dz.astype(np.float64) @ kernel.T
            dbias = None if params[i][1] is None else rnd(dz.astype(np.float64).sum(0))
        grads.append((rnd(dkernel), dbias))
        written = None
        if delayed and i and written_below[i - 1]:
            # the data-gradient GEMM writes dZ8 of layer i - 1 at its delayed scale, its amax
            # before the mask; ReLU's derivative is h8 > 0 of layer i's input
            r = np.asarray(dprev, np.float32)
            gradient_amaxes[i - 1] = np.max(np.abs(r))
            bound = np.float32(gradient_amaxes[i]) * column_sums(kernel, 1) * np.float32(sw)
            p8, sp = quantize(r, scale_amax(histories[i - 1][1], above(bound)),
                              config.gradient, config.margin)
            mask = h_in.astype(np.float32) > 0
            written = (np.where(mask, p8, np.zeros((), p8.dtype)), sp)
            continue
        if i and activations[i - 1] is not None:
            dprev = dprev * derivative(activations[i - 1], saved[i - 1][4])
        dz = rnd(dprev)
    if histories is None:
        return y, dz, grads[::-1]
    push = lambda history, value: np.concatenate([[np.float32(value)], history[:-1]])
    next_histories = [(push(hi, input_amaxes[i]), push(hg, gradient_amaxes[i]))
                      if quantized[i] else (hi, hg) for i, (hi, hg) in enumerate(histories)]
    return y, dz, grads[::-1], next_histories


def exact_stack(seed, widths, rows):
    """(x, params, dy) of a two-layer ReLU stack on which every quantization and every sum is
    exact, so any correct FP8 stack (any accumulation order, a GPU's too) computes exactly
    what `model_stack` does, and a wrong scale, transpose, mask or bias does not.

    Every tensor that is quantized (x, W1, h1, W2, dy, dZ1) has amax 7 (e4m3's 448 = 7·64,
    e5m2's 57344 = 7·2**13: the scales are powers of two, so the order in which a GEMM applies
    them does not matter) and integer values of at most 3 significant bits, which both formats
    hold exactly; every GEMM then sums small integers:

    - x: one ±1 per row, and x[1, 1] = 7; W1: ±1, and W1[0, 0] = 7 (row 1 does not pick it);
      b1 in {-2, 0}: z1 is odd (no ReLU ties, a mask that matters) and h1 in {0, 1, 5, 7};
    - W2: integers in [-7, 7], column 1 only ±1; dy: one ±1 per row, and dy[1, 1] = 7, so
      dZ1 = (dy W2ᵀ)·mask is integers in [-7, 7], 7 at [0, 0].
    """
    k0, k1, k2 = widths
    assert k0 >= 2 and k1 >= 2 and k2 >= 2 and rows >= 2
    rng = np.random.default_rng(seed)
    x = np.zeros((rows, k0), np.float32)
    x[np.arange(rows), rng.integers(0, k0, rows)] = rng.choice([-1.0, 1.0], rows)
    x[:2] = 0
    x[0, 0], x[1, 1] = 1, 7
    w1 = rng.choice([-1.0, 1.0], (k0, k1)).astype(np.float32)
    w1[0, 0] = 7
    b1 = rng.choice([-2.0, 0.0], k1).astype(np.float32)
    b1[0] = 0  # z1[0, 0] = h1[0, 0] = 7
    w2 = rng.integers(-7, 8, (k1, k2)).astype(np.float32)
    w2[:, 1] = rng.choice([-1.0, 1.0], k1)
    w2[0, 0] = 7
    b2 = rng.integers(-3, 4, k2).astype(np.float32)
    dy = np.zeros((rows, k2), np.float32)
    dy[np.arange(rows), rng.integers(0, k2, rows)] = rng.choice([-1.0, 1.0], rows)
    dy[:2] = 0
    dy[0, 0], dy[1, 1] = 1, 7
    return x, [(w1, b1), (w2, b2)], dy


def run_stack(x, params, activations, dy, fp8_config, dtype=None):
    """(y, dx, grads) of `jax_epilog.mlp` through `jax.vjp` with cotangent dy."""
    def fn(x, params):
        return jax_epilog.mlp(x, params, activation=activations[0],
                              final_activation=activations[-1], fp8=fp8_config, dtype=dtype)
    y, vjp = jax.vjp(fn, x, params)
    dx, grads = vjp(jnp.asarray(dy, y.dtype))
    return y, dx, grads


def close(got, want, rtol):
    """|got - want| within rtol of want's largest value; returns that largest error (relative)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want), initial=0)), 1e-30)
    error = float(np.max(np.abs(got - want), initial=0)) / scale
    assert error <= rtol, f"relative error {error:.3g} > {rtol:.3g}"
    return error


def leaves(y, dx, grads):
    return [y, dx] + [g for pair in grads for g in pair if g is not None]


def random_cotangent(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# --- values and gradients against the model -----------------------------------------------

# widths with odd sizes (1, 127, 129: not multiples of 8), leading dims, with and without bias
CASES = [((33, 129, 10), ("relu", None), True, (7,)),
         ((127, 1, 129), ("relu", "relu"), True, (2, 3)),
         ((16, 64, 48, 8), ("gelu", "gelu", None), True, (5,)),
         ((40, 129, 127), (None, "gelu"), False, (1,)),
         ((8, 24, 24, 3), ("relu", "relu", "relu"), (True, False, True), (9,))]


@pytest.mark.parametrize("widths, activations, bias, lead", CASES)
def test_fp8_stack_matches_the_model(widths, activations, bias, lead):
    x, params = make_stack(hash(widths) % 1000, widths, lead=lead, bias=bias)
    activations = (*[activations[0]] * (len(widths) - 2), activations[-1])
    dy = random_cotangent(1, (*lead, widths[-1]))
    got = run_stack(x, params, activations, dy, ALL)
    rows = np.asarray(x).reshape(-1, widths[0])
    want = model_stack(rows, params, activations, dy.reshape(-1, widths[-1]),
                       [True] * (len(widths) - 1))
    want = (want[0].reshape(*lead, -1), want[1].reshape(*lead, -1), want[2])
    plain = run_stack(x, params, activations, dy, None)
    for g, w in zip(leaves(*got), leaves(*want)):
        assert g.dtype == jnp.float32 and g.shape == w.shape
        close(g, w, 2e-5)
    # The unquantized layer is further from the model than float32 rounding: FP8 ran (in y,
    # dx and every kernel gradient; the last bias gradient is a sum of dy either way).
    quantized_leaves = lambda y, dx, grads: [y, dx] + [dk for dk, _ in grads]
    for p, w in zip(quantized_leaves(*plain), quantized_leaves(*want)):
        assert not np.allclose(p, w, rtol=1e-3, atol=1e-3 * np.max(np.abs(w)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_stack_is_exact(dtype):
    """On `exact_stack`'s data the FP8 step equals the model bit for bit, and equals the
    unquantized layer (every quantization is exact): what the GPU test asks of the kernels.
    The data is not degenerate: the ReLU mask and the biases change the result."""
    x, params, dy = exact_stack(0, (33, 129, 10), 127)
    cast = lambda t: jax.tree.map(lambda a: jnp.asarray(a, dtype), t)
    got = run_stack(cast(x), cast(params), ("relu", None), dy, ALL)
    want = model_stack(x, params, ("relu", None), dy, [True, True], dtype=dtype)
    plain = run_stack(cast(x), cast(params), ("relu", None), dy, None)
    for g, w, p in zip(leaves(*got), leaves(*want), leaves(*plain)):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), w)
        np.testing.assert_array_equal(np.asarray(p, np.float32), w)
    no_mask = model_stack(x, params, (None, None), dy, [True, True], dtype=dtype)
    assert not np.array_equal(no_mask[1], want[1])  # dx: the mask matters
    no_bias = model_stack(x, [(k, None) for k, _ in params], ("relu", None), dy, [True, True],
                          dtype=dtype)
    assert not np.array_equal(no_bias[0], want[0])


@pytest.mark.parametrize("widths, activations, bias, lead",
                         [c for c in CASES if c[1][0] == "relu"])
def test_relu_derivative_from_the_next_fp8_input_equals_the_mask(widths, activations, bias,
                                                                 lead):
    """backward="auto" takes ReLU's derivative from the next layer's h8 > 0 (no mask kept);
    "fused" from the mask (DRELU_BGRAD): the same values (float32 compute) where no z is 0."""
    x, params = make_stack(hash(widths) % 1000, widths, lead=lead, bias=bias)
    activations = (*[activations[0]] * (len(widths) - 2), activations[-1])
    dy = random_cotangent(2, (*lead, widths[-1]))
    run = lambda backward: jax.vjp(lambda x, p: jax_epilog.mlp(
        x, p, activation=activations[0], final_activation=activations[-1], fp8=ALL,
        backward=backward), x, params)
    (y_auto, vjp_auto), (y_fused, vjp_fused) = run("auto"), run("fused")
    got, want = (y_auto, *vjp_auto(dy)), (y_fused, *vjp_fused(dy))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6,
                                   atol=1e-6 * float(np.max(np.abs(w))))


def test_relu_derivative_at_zero_is_zero_without_the_mask():
    """The one difference (docs/fp8.md): z = 0 (here a zero row, no bias) gets derivative 0
    from h8 > 0, jax.nn.relu's convention; the mask (fused) passes the gradient there."""
    x, params = make_stack(3, (16, 32, 16), lead=(8,), bias=False)
    x = np.asarray(x).copy()
    x[0] = 0
    dy = random_cotangent(4, (8, 16))
    dx = {b: jax.vjp(lambda x: jax_epilog.mlp(x, params, fp8=ALL, backward=b), x)[1](dy)[0]
          for b in ("auto", "fused")}
    plain = jax.vjp(lambda x: jax.nn.relu(x @ params[0][0]) @ params[1][0], x)[1](dy)[0]
    assert np.all(np.asarray(dx["auto"][0]) == 0) and np.all(np.asarray(plain[0]) == 0)
    assert np.any(np.asarray(dx["fused"][0]) != 0)  # (other rows: dZ's amax differs too)


def gemm_calls(fn, *args):
    """(epilog, backend, result_amax, operand dtype, result dtype) of every `matmul` in fn's
    jaxpr."""
    return [(jax_epilog.Epilog(eqn.params["epilog"]), eqn.params["backend"],
             eqn.params["result_amax"], eqn.invars[0].aval.dtype.name,
             eqn.outvars[0].aval.dtype.name)
            for eqn in traced_equations(fn, *args)
            if "result_amax" in eqn.params and "backend" in eqn.params]


@pytest.mark.parametrize("dtype, backward", [(jnp.bfloat16, "fused"), (jnp.float32, "auto")])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_no_gemm_asks_for_an_amax_and_float32_avoids_missing_kernels(dtype, backward,
                                                                      activation, monkeypatch):
    """No FP8 GEMM of the step asks `result_amax` (cuBLASLt has none for a 16/32-bit result:
    the amaxes are XLA reductions). bf16 compute, fused backward: every GEMM on the kernel's
    backend. float32 compute: the GEMMs whose epilog has no FP8 float32 kernel run XLA's way
    (the forwards with a bias, GELU's BGRAD data gradients), the DEFAULT ones keep "auto"
    (under "auto" ReLU's data gradients are DEFAULT GEMMs: `stack_plan.relu_from_next_input`)."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    x, params = make_stack(13, (32, 48, 64, 16), lead=(8,))
    x, params = jax.tree.map(lambda a: a.astype(dtype), (x, params))
    loss = lambda x, p: jnp.sum(jax_epilog.mlp(x, p, activation=activation, fp8=ALL,
                                               backward=backward).astype(jnp.float32))
    calls = gemm_calls(jax.grad(loss, argnums=(0, 1)), x, params)
    fp8_calls = [c for c in calls if c[3].startswith("float8")]
    assert len(fp8_calls) == len(calls) == 9, calls
    assert not [c for c in calls if c[2]], calls
    moved = [(e, b) for e, b, *_ in calls if b == "xla"]
    if dtype == jnp.bfloat16:
        assert not moved, calls
    else:
        assert len(moved) == (3 if activation == "relu" else 5) and all(e not in stack_plan.FLOAT32_KERNEL_EPILOGS for e, _ in moved)
        assert all(b == "auto" for e, b, *_ in calls if e == jax_epilog.Epilog.DEFAULT)
    no_override = lambda: None
    assert stack_plan.fp8_gemm_backend("cublaslt", jax_epilog.Epilog.BIAS, jnp.float32,
                                 no_override).choice == "cublaslt"
    assert stack_plan.fp8_gemm_backend("auto", jax_epilog.Epilog.BIAS, jnp.bfloat16,
                                 no_override).choice == "auto"


def test_mixed_fp8_and_plain_layers_match_the_model(monkeypatch):
    """`Fp8()` (auto) with a low threshold: aligned layers FP8, unaligned ones not."""
    monkeypatch.setattr(stack_plan, "FP8_MIN_FLOPS", 1)
    widths = (32, 48, 64, 129, 16)
    x, params = make_stack(3, widths, lead=(11,))
    activations = ("gelu", "gelu", "gelu", None)
    quantized = stack_plan.fp8_layers(Fp8(), 11, widths)
    assert quantized == (True, True, False, False)
    dy = random_cotangent(2, (11, 16))
    got = run_stack(x, params, activations, dy, True)
    want = model_stack(np.asarray(x), params, activations, dy, quantized)
    for g, w in zip(leaves(*got), leaves(*want)):
        close(g, w, 2e-5)


def test_gradient_format_and_margin_are_used():
    x, params = make_stack(4, (32, 64, 16), lead=(13,))
    activations = ("relu", None)
    dy = random_cotangent(3, (13, 16))
    config = Fp8(gradient=jnp.float8_e4m3fn, margin=3, layers="all")
    got = run_stack(x, params, activations, dy, config)
    want = model_stack(np.asarray(x), params, activations, dy, [True, True], config)
    default = model_stack(np.asarray(x), params, activations, dy, [True, True])
    for g, w, d in zip(leaves(*got), leaves(*want), leaves(*default)):
        close(g, w, 2e-5)
    assert close(got[2][0][0], default[2][0][0], 1.0) > 1e-3  # e4m3 gradients differ


def check_dense_within_fp8_rounding(x, kernel, bias, accumulation=0.0):
    """One dense ReLU layer in float32, FP8 against unquantized: |y8 - y| <= (two e4m3
    roundings + `accumulation`) · (|x| @ |W|) + the subnormal floor; the weight gradient
    likewise with one e4m3 and one e5m2 rounding. `accumulation`: the relative error the
    device's FP8 accumulation may add (0 for the CPU's exact reference)."""
    fn = lambda fp8_config: lambda x, k, b: jax_epilog.dense(x, k, b, activation="relu",
                                                            fp8=fp8_config)
    y8, vjp8 = jax.vjp(fn(ALL), x, kernel, bias)
    x, kernel, bias = (np.asarray(v, np.float64) for v in (x, kernel, bias))
    y = np.maximum(x @ kernel + bias, 0)
    ax, ak = np.abs(x), np.abs(kernel)
    e4m3, e5m2 = 2.0**-4, 2.0**-3  # half an ulp, relative
    floor = lambda amax, fmt: amax / float(ml_dtypes.finfo(FORMATS[fmt]).max) * float(
        ml_dtypes.finfo(FORMATS[fmt]).smallest_subnormal)
    bound = (2 * e4m3 + e4m3**2 + accumulation) * (ax @ ak) + (
        floor(ax.max(), "float8_e4m3fn") * ak.sum(0) + ax.sum(1, keepdims=True) *
        floor(ak.max(), "float8_e4m3fn")) + 1e-6
    assert np.all(np.abs(np.asarray(y8, np.float64) - y) <= bound)
    dy = jnp.asarray(random_cotangent(6, y.shape))
    dk8 = np.asarray(vjp8(dy)[1], np.float64)
    # Against xᵀ dZ with the FP8 forward's own mask (a ReLU may flip where z is near 0).
    dz = np.asarray(dy, np.float64) * (np.asarray(y8) > 0)
    adz = np.abs(dz)
    bound_dk = (e4m3 + e5m2 + e4m3 * e5m2 + accumulation) * (ax.T @ adz) + (
        floor(ax.max(), "float8_e4m3fn") * adz.sum(0) + ax.sum(0)[:, None] *
        floor(adz.max(), "float8_e5m2")) + 1e-6
    assert np.all(np.abs(dk8 - x.T @ dz) <= bound_dk)
    # and FP8 ran: the result is further from the unquantized one than float32 rounding
    assert not np.allclose(np.asarray(y8), y, rtol=1e-4, atol=1e-4 * y.max())


def test_fp8_against_bfloat16_layer_within_fp8_rounding():
    x, [(kernel, bias)] = make_stack(5, (129, 127), lead=(31,))
    check_dense_within_fp8_rounding(x, kernel, bias)


def test_bfloat16_compute_and_float32_params():
    """float32 parameters computed in bf16: FP8 results in bf16, gradients back in float32."""
    x, params = make_stack(6, (64, 32, 16), lead=(8,))
    fn = lambda x, p: jax_epilog.mlp(x, p, dtype=jnp.bfloat16, fp8=ALL)
    y, vjp = jax.vjp(fn, x, params)
    assert y.dtype == jnp.bfloat16
    dx, grads = vjp(jnp.ones_like(y))
    assert dx.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    ref = run_stack(x.astype(jnp.bfloat16), [(k.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
                                             for k, b in params], ("relu", None),
                    np.ones(y.shape, np.float32), ALL)
    for g, w in zip(leaves(y, dx, grads), leaves(*ref)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# --- what the backward keeps, transforms, choices --------------------------------------------

def test_residuals_are_fp8():
    x, params = make_stack(7, (33, 129, 10), lead=(5,), dtype=np.float32)
    residuals = saved_residuals(lambda x, p: jax_epilog.mlp(x, p, fp8=ALL), x, params)
    # the layer inputs (M, K), as the forward GEMM read them (h8ᵀ is made in the backward)
    assert ("f8_e4m3fn", (5, 33)) in residuals and ("f8_e4m3fn", (5, 129)) in residuals
    assert ("f8_e4m3fn", (33, 129)) in residuals and ("f8_e4m3fn", (129, 10)) in residuals
    # no ReLU mask: the next layer's h8 > 0 gives the derivative (`stack_plan.relu_from_next_input`)
    assert not [r for r in residuals if r[0] == "u8"], residuals
    wide = [r for r in residuals if not r[0].startswith(("f8", "u8")) and r[1] != ()]
    assert not wide, wide  # no 16/32-bit activations or kernels, only the float32 scales
    fused = saved_residuals(lambda x, p: jax_epilog.mlp(x, p, fp8=ALL, backward="fused"),
                            x, params)  # DRELU_BGRAD reads the packed mask
    assert sorted(fused) == sorted(residuals + [("u8", (5, jax_epilog.relu_mask_bytes(129)))])
    gelu = saved_residuals(lambda x, p: jax_epilog.mlp(x, p, activation="gelu", fp8=ALL),
                           x, params)
    assert ("f32", (5, jax_epilog.gelu_aux_columns(129))) in gelu


def test_backward_barriers_take_flat_arrays_on_one_device():
    """The backward's optimization barriers (`op.barrier.flat_barrier`, a primitive partitioned per
    shard) still see 1-D arrays on one device, the layout guard of docs/fp8.md ("Layouts"):
    odd shapes, the bias gradient (bf16) crossing with the FP8 gradient."""
    rng = np.random.default_rng(31)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    layers = [(normal(64, 136), normal(136)), (normal(136, 24), None)]
    config = Fp8(layers="all", scaling="current")
    loss = lambda layers, x: jnp.sum(jax_epilog.mlp(x, layers, fp8=config)
                                     .astype(jnp.float32))
    text = jax.jit(jax.grad(loss)).lower(layers, normal(129, 64)).as_text()
    barriers = [line.split(":", 2)[-1] for line in text.splitlines()
                if "stablehlo.optimization_barrier" in line]
    assert len(barriers) == 4, barriers  # two per FP8 layer
    for types in barriers:
        shapes = re.findall(r"tensor<([^>]*)>", types)
        assert shapes and all(s.count("x") == 1 for s in shapes), types  # rank 1 each


def test_amaxes_together_are_each_arrays_amax():
    """`op.amaxes` (the layers' amaxes taken together, one collective when sharded; the
    collective count: tests/support/sharding_checks.py): each array's max |x| in float32, eagerly,
    under jit, and under vmap (each example its own, an unmapped operand broadcast)."""
    rng = np.random.default_rng(32)
    arrays = [jnp.asarray(rng.normal(size=shape) * scale, dtype) for shape, scale, dtype in
              [((1,), 3.0, jnp.float32), ((127, 3), 0.5, jnp.bfloat16), ((5, 129), 7.0,
                                                                            jnp.float16)]]
    want = np.array([np.max(np.abs(np.asarray(a, np.float32))) for a in arrays], np.float32)
    for f in (amaxes, jax.jit(amaxes)):
        got = f(*arrays)
        assert got.dtype == jnp.float32 and got.shape == (3,)
        np.testing.assert_array_equal(got, want)
    batch = jnp.asarray(rng.normal(size=(4, 9, 129)), jnp.float32)
    got = jax.vmap(amaxes, in_axes=(1, None))(batch, arrays[2])
    np.testing.assert_array_equal(got[:, 0], np.max(np.abs(np.asarray(batch)), axis=(0, 2)))
    np.testing.assert_array_equal(got[:, 1], np.full(9, want[2]))


def test_amaxes_in_one_pass_are_the_same_amaxes_from_one_reduction():
    """`one_pass=True` (SwiGLU's h, g and u): the same values as separate reductions, the
    arrays of one shape reduced by ONE variadic reduce, an array of another shape apart."""
    rng = np.random.default_rng(33)
    same = [jnp.asarray(rng.normal(size=(127, 129)) * scale, dtype) for scale, dtype in
            [(3.0, jnp.float32), (0.5, jnp.bfloat16), (7.0, jnp.bfloat16)]]
    other = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
    arrays = [same[0], other, *same[1:]]
    want = np.array([np.max(np.abs(np.asarray(a, np.float32))) for a in arrays], np.float32)
    one_pass = lambda *a: amaxes(*a, one_pass=True)
    for f in (one_pass, jax.jit(one_pass)):
        np.testing.assert_array_equal(f(*arrays), want)
    text = jax.jit(one_pass).lower(*arrays).as_text()
    reduces = [line for line in text.splitlines() if "stablehlo.reduce(" in line]
    assert len(reduces) == 2 and sum("129" in line for line in reduces) == 1, reduces
    assert sum(line.count("tensor<127x129x") for line in reduces) == 3, reduces
    np.testing.assert_array_equal(jax.vmap(one_pass)(*(a[None] for a in arrays))[0], want)


@pytest.mark.slow
def test_jit_vmap_and_checkpoint():
    x, params = make_stack(8, (24, 48, 10), lead=(4, 6))
    loss = lambda x, p: jnp.sum(jax_epilog.mlp(x, p, fp8=ALL) ** 2)
    eager = jax.grad(loss, argnums=(0, 1))(x, params)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, params)
    remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1))(x, params)
    for a, b, c in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), jax.tree.leaves(remat)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    # vmap: each example is quantized on its own scales, exactly as the unbatched call
    per_example = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(x, params)
    for i in range(x.shape[0]):
        one = jax.grad(loss, argnums=(0, 1))(x[i], params)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(per_example)):
            np.testing.assert_allclose(a, b[i], rtol=1e-5, atol=1e-6)
    # and over kernels: each set of weights on its own scales
    kernels = jax.tree.map(lambda a: jnp.stack([a, -2 * a]), params)
    per_kernel = jax.vmap(jax.grad(loss, argnums=1), in_axes=(None, 0))(x, kernels)
    for i in range(2):
        one = jax.grad(loss, argnums=1)(x, jax.tree.map(lambda a: a[i], kernels))
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(per_kernel)):
            np.testing.assert_allclose(a, b[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backward, activation, custom_calls",
                         [("fused", "relu", 9), ("auto", "relu", 9), ("auto", "gelu", 7)])
def test_exported_for_cuda_the_gemms_are_fp8(backward, activation, custom_calls, monkeypatch):
    """The step as the CUDA lowering builds it (exported from this CPU host). Fused: per layer
    one forward, one weight-gradient and one data-gradient custom call, all on FP8 operands.
    auto: ReLU's data gradients are plain FP8 kernels (the derivative from h8 > 0, XLA's
    fusion); GELU's two data-gradient GEMMs that apply its derivative are XLA's FP8 dots."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    x, params = make_stack(12, (64, 128, 96, 32), lead=(256,))
    x, params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, params))

    def step(x, params, dy):
        y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p, activation=activation, fp8=ALL,
                                                     backward=backward), x, params)
        return (y, *vjp(dy))

    exported = jax.export.export(jax.jit(step), platforms=["cuda"],
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        x, params, jnp.ones((256, 32), jnp.bfloat16))
    text = exported.mlir_module().splitlines()
    operand_types = lambda lines: [line.split(" : (", 1)[1].split(")", 1)[0] for line in lines]
    calls = [line for line in text if "@jax_epilog_matmul(" in line]
    assert len(calls) == custom_calls
    assert all(t.count("xf8E") == 2 for t in operand_types(calls)), operand_types(calls)
    dots = [line for line in text if "stablehlo.dot_general" in line]
    assert len(dots) == 9 - custom_calls
    assert all(t.count("xf8E") == 2 for t in operand_types(dots)), operand_types(dots)


@pytest.mark.parametrize("fast, forward, data, weight", [
    (False, "false", "false", "false"), ("forward", "true", "false", "false"),
    (("forward", "data gradient"), "true", "true", "false"),
    (("weight gradient",), "false", "false", "true"), (True, "true", "true", "true")])
def test_fast_accumulation_reaches_the_gemms_it_names(fast, forward, data, weight):
    """`Fp8(fast_accumulation=...)` as the CUDA lowering builds the step: the forward GEMMs
    (bias epilogs), the data gradients ((256, K) results) and the weight gradients ((K, N)
    results) carry the attribute as the config names them; on the CPU the values are the
    float32 reference's."""
    x, params = make_stack(12, (64, 128, 32), lead=(256,))
    x, params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, params))
    dy = jnp.ones((256, 32), jnp.bfloat16)

    def step(config):
        def f(x, params, dy):
            y, vjp = jax.vjp(lambda x, p: jax_epilog.mlp(x, p, fp8=config), x, params)
            return (y, *vjp(dy))
        return f

    config = Fp8(layers="all", fast_accumulation=fast)
    text = jax.export.export(jax.jit(step(config)), platforms=["cuda"],
                             disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
        x, params, dy).mlir_module().splitlines()
    calls = [line for line in text if "@jax_epilog_matmul(" in line]
    attribute = lambda line: line.split("fast_accumulation = ", 1)[1].split(",", 1)[0]
    backward = [c for c in calls if "epilog = 1 :" in c]  # DEFAULT
    forward_ = [attribute(c) for c in calls if "epilog = 1 :" not in c]
    rows = lambda line: "x256x" in line.rsplit("->", 1)[1]  # a (1, 256, K) result
    data_ = [attribute(c) for c in backward if rows(c)]
    weight_ = [attribute(c) for c in backward if not rows(c)]
    assert len(forward_) == 2 and len(data_) == 2 and len(weight_) == 2, calls
    assert (set(forward_), set(data_), set(weight_)) == ({forward}, {data}, {weight})
    for gemm, expected in zip(recipe.FAST_ACCUMULATION_GEMMS, (forward, data, weight)):
        assert config.fast(gemm) is (expected == "true")
    for a, b in zip(jax.tree.leaves(jax.jit(step(config))(x, params, dy)),
                    jax.tree.leaves(jax.jit(step(ALL))(x, params, dy))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("given, stored", [
    (("data gradient", "forward"), ("forward", "data gradient")),
    (["forward"], "forward"), ("forward", "forward"), ((), False), (np.bool_(True), True),
    (("forward", "data gradient", "weight gradient"), True),
    ("weight gradient", ("weight gradient",))])
def test_fast_accumulation_has_one_spelling(given, stored):
    config = Fp8(fast_accumulation=given)
    assert config.fast_accumulation == stored and type(config.fast_accumulation) is type(stored)
    assert config == Fp8(fast_accumulation=stored) and hash(config) == hash(Fp8(
        fast_accumulation=stored))
    with pytest.raises(ValueError, match="gemm: expected one of"):
        config.fast("gradient")


def test_auto_chooses_by_size():
    assert stack_plan.fp8_pays(65536, 4096, 4096)  # M1's layers, measured to gain
    assert not stack_plan.fp8_pays(16384, 1024, 1024)  # M2's, measured to lose
    assert not stack_plan.fp8_pays(65536, 4096, 4100)  # N unaligned: padded, not worth it
    x, params = make_stack(9, (32, 64, 16), lead=(8,))
    for config in (True, Fp8()):  # small: every layer stays in the compute dtype
        np.testing.assert_array_equal(jax_epilog.mlp(x, params, fp8=config),
                                      jax_epilog.mlp(x, params))
    big = (jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16),
           [(jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16),
             jax.ShapeDtypeStruct((4096,), jnp.bfloat16))] * 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda x, p: jax_epilog.mlp(x, p, fp8=True).astype(jnp.float32).sum()))(*big))
    assert "f8_e4m3fn[65536,4096]" in jaxpr and "f8_e5m2[65536,4096]" in jaxpr


def test_zero_and_nonfinite_amax():
    """An all-zero input quantizes with scale 1 (no 0/0); NaN propagates as in the bf16 layer."""
    x, params = make_stack(10, (16, 32, 8), lead=(3,))
    zeros = jnp.zeros_like(x)
    dy = np.zeros((3, 8), np.float32)
    got = run_stack(zeros, params, ("relu", None), dy, ALL)
    want = model_stack(np.asarray(zeros), params, ("relu", None), dy, [True, True])
    for g, w in zip(leaves(*got), leaves(*want)):
        assert np.all(np.isfinite(g))
        close(g, w, 2e-5)
    y_nan = jax_epilog.mlp(x.at[0, 0].set(jnp.nan), params, fp8=ALL)
    assert np.isnan(np.asarray(y_nan)).any()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(forward="float8_e5m2"), ValueError, "forward: .*e5m2 × e5m2"),
    (dict(forward=jnp.bfloat16), ValueError, "forward: expected an FP8 format"),
    (dict(gradient="e5m2"), ValueError, "gradient: expected an FP8 format"),
    (dict(margin=-1), ValueError, "margin: expected a non-negative int"),
    (dict(margin=1.5), ValueError, "margin"),
    (dict(layers="some"), ValueError, "layers: expected one of"),
    (dict(fast_accumulation="all"), ValueError, "fast_accumulation: expected False"),
    (dict(fast_accumulation=1), ValueError, "fast_accumulation"),
    (dict(fast_accumulation=("forward", "backward")), ValueError,
     "fast_accumulation: expected False, True, \"forward\" or a tuple"),
    (dict(amax_reduction_axes=()), ValueError, "amax_reduction_axes: expected None, a mesh "
                                               "axis name or a tuple of distinct names"),
    (dict(amax_reduction_axes=""), ValueError, "amax_reduction_axes"),
    (dict(amax_reduction_axes=("data", "data")), ValueError, "amax_reduction_axes"),
    (dict(amax_reduction_axes=("data", 1)), ValueError, "amax_reduction_axes"),
    (dict(amax_reduction_axes={"data"}), ValueError, "amax_reduction_axes"),
])
def test_bad_config_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        Fp8(**kwargs)


def test_config_is_frozen_hashable_and_normalised():
    config = Fp8(forward=jnp.float8_e4m3fn, gradient=jnp.dtype("float8_e5m2"))
    assert config == Fp8() and hash(config) == hash(Fp8())
    assert config.forward == "float8_e4m3fn" and config.gradient == "float8_e5m2"
    with pytest.raises(Exception):
        config.margin = 2
    assert Fp8(amax_reduction_axes="data").amax_reduction_axes == ("data",)
    assert Fp8(amax_reduction_axes=["data", "model"]) == Fp8(amax_reduction_axes=("data",
                                                                                 "model"))
    assert Fp8().amax_reduction_axes is None


@pytest.mark.parametrize("value", ["yes", 1, Fp8])
def test_bad_fp8_argument_names_itself(value):
    x, params = make_stack(11, (8, 4), lead=(2,))
    with pytest.raises(TypeError, match="fp8: expected None, a bool or jax_epilog.Fp8"):
        jax_epilog.mlp(x, params, fp8=value)
    with pytest.raises(TypeError, match="fp8:"):
        jax_epilog.dense(x, *params[0], fp8=value)



# --- amax_reduction_axes where no mesh axis is bound (in shard_map: tests/support/sharding_checks.py) --

def _step_with(config, x, params, state=None):
    """(y, dx, grads, next state) of a two-layer mlp."""
    def fn(x, params, state):
        return jax_epilog.mlp(x, params, fp8=config, fp8_state=state)
    y, vjp = jax.vjp(fn, x, params, state)
    return (y, *vjp(jnp.asarray(random_cotangent(0, y.shape), y.dtype)))


def _under(mesh, fn, *args):
    with jax.set_mesh(mesh):
        return fn(*args)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_amax_reduction_axes_outside_shard_map_changes_nothing(scaling):
    """On one device, and under `jax.set_mesh` (whose axes `jit` partitions, so every amax is
    already over the whole array), an axis that is not bound is skipped: the step is the one
    without the option, bit for bit. A name the mesh in use does not have is an error."""
    x, params = make_stack(16, (24, 40, 8), lead=(9,), bias=True)
    config = Fp8(layers="all", scaling=scaling, amax_history_length=2)
    state = config.init_state(2) if scaling == "delayed" else None
    named = dataclasses.replace(config, amax_reduction_axes=("data", "model"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    for step in (_step_with, jax.jit(_step_with, static_argnums=0)):
        want = jax.tree.leaves(step(config, x, params, state))
        for got in (step(named, x, params, state), _under(mesh, step, named, x, params, state)):
            for g, w in zip(jax.tree.leaves(got), want):
                np.testing.assert_array_equal(g, w)
    typo = dataclasses.replace(config, amax_reduction_axes="dat")
    with jax.set_mesh(mesh), pytest.raises(
            ValueError, match=r"amax_reduction_axes: 'dat' is not an axis of the mesh in use, "
                              r"whose axes are \('data', 'model'\)"):
        _step_with(typo, x, params, state)


@pytest.mark.slow
def test_amax_reduction_over_a_vmapped_axis_is_the_whole_batch(cpu_device):
    """A bound axis of `vmap(axis_name=)` reduces like a mesh axis: vmapped over 3 blocks of
    rows, each block scaled with the amaxes of all three is the unmapped call on all rows
    (on the CPU, whose FP8 GEMMs are exact: equal amaxes, equal FP8 values)."""
    with jax.default_device(cpu_device):
        _vmapped_reduction()


def _vmapped_reduction():
    x, params = make_stack(17, (24, 40, 8), lead=(3, 7), bias=True)
    config = Fp8(layers="all", amax_reduction_axes="blocks")
    dy = jnp.asarray(random_cotangent(1, (3, 7, 8)))
    fn = lambda x, params: jax_epilog.mlp(x, params, fp8=config)
    y, vjp = jax.vjp(fn, x, params)
    dx, _ = vjp(dy)

    def per_block(x, dy):
        y, vjp = jax.vjp(lambda x: fn(x, params), x)
        return y, vjp(dy)[0]

    # The same FP8 values; the GEMMs of a vmap may sum in another order (jax 0.10): a few
    # float32 ulps of the largest value.
    got_y, got_dx = jax.vmap(per_block, axis_name="blocks")(x, dy)
    close(got_y, y, 2.0**-20)
    close(got_dx, dx, 2.0**-20)
    without = jax.vmap(per_block)(x, dy)  # each block its own amaxes: not the whole call
    assert close(without[0], y, 1.0) > 2.0**-10


# --- Flax ----------------------------------------------------------------------------------

def test_nnx_modules_with_fp8():
    nnx = pytest.importorskip("flax.nnx")
    from jax_epilog import nnx as fused_nnx

    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 24)), jnp.float32)
    plain = fused_nnx.MLP(24, [32, 16], rngs=nnx.Rngs(0))
    quant = fused_nnx.MLP(24, [32, 16], fp8=ALL, rngs=nnx.Rngs(0))
    a, b = nnx.state(plain, nnx.Param), nnx.state(quant, nnx.Param)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(p, q)  # same parameters, so checkpoints interchange
    params = [(layer.kernel[...], layer.bias[...]) for layer in quant.layers]
    np.testing.assert_array_equal(quant(x), jax_epilog.mlp(x, params, fp8=ALL))
    dense = fused_nnx.Dense(24, 16, activation="gelu", fp8=ALL, rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(
        dense(x), jax_epilog.dense(x, dense.kernel[...], dense.bias[...], activation="gelu",
                                   fp8=ALL))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(quant)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    with pytest.raises(TypeError, match="fp8:"):
        fused_nnx.Dense(4, 4, fp8="e4m3", rngs=nnx.Rngs(0))


def test_linen_modules_with_fp8():
    pytest.importorskip("flax.linen")
    from jax_epilog import linen as fused_linen

    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 24)), jnp.float32)
    plain, quant = fused_linen.MLP((32, 16)), fused_linen.MLP((32, 16), fp8=True)
    variables = plain.init(jax.random.key(0), x)
    with_histories = quant.init(jax.random.key(0), x)  # fp8=True keeps amax histories
    assert set(with_histories) == {"params", fused_linen.FP8_COLLECTION}
    assert jax.tree.structure(variables["params"]) == \
        jax.tree.structure(with_histories["params"])
    layers_ = variables["params"]
    params = [(layers_[f"layers_{i}"]["kernel"], layers_[f"layers_{i}"]["bias"])
              for i in range(2)]
    config = fused_linen.MLP((32, 16), fp8=ALL)
    # applied with the parameters only (no histories), "auto" scaling is current scaling;
    # with fresh histories it calibrates itself: the same values
    fresh = config.init(jax.random.key(0), x)[fused_linen.FP8_COLLECTION]
    for v in (variables, {**variables, fused_linen.FP8_COLLECTION: fresh}):
        np.testing.assert_array_equal(config.apply(v, x), jax_epilog.mlp(x, params, fp8=ALL))
    dense = fused_linen.Dense(16, activation="relu", fp8=ALL)
    v = dense.init(jax.random.key(1), x)
    np.testing.assert_array_equal(dense.apply(v, x), jax_epilog.dense(
        x, v["params"]["kernel"], v["params"]["bias"], activation="relu", fp8=ALL))
    with pytest.raises(TypeError, match="fp8:"):
        fused_linen.Dense(4, fp8="e4m3")


# --- convergence ---------------------------------------------------------------------------

def train_digits(fp8_config, epochs=30):
    """Test accuracy and per-epoch losses of the digits MLP (bf16 compute), seed 0."""
    nnx = pytest.importorskip("flax.nnx")
    pytest.importorskip("sklearn")
    from jax_epilog import nnx as fused_nnx
    from jax_epilog.tools.demo import accuracy, load_digits, train

    data = load_digits(seed=0)
    model = fused_nnx.MLP(64, [128, 128, 10], dtype=jnp.bfloat16, fp8=fp8_config,
                          rngs=nnx.Rngs(0))
    losses = train(model, data, epochs=epochs, progress=False)
    return accuracy(model, data.x_test, data.y_test), losses


@pytest.mark.parametrize("config", [ALL, Fp8(layers="all", scaling="delayed")],
                         ids=["current", "delayed"])
def test_fp8_training_converges_like_bfloat16(config):
    """Trained to convergence (30 epochs: training loss ~0.003 for both; after 20, mid-training,
    FP8 was 1.3 points behind on the 450 test digits). Delayed scaling starts from the fresh
    state (scale 1) and updates its amax histories in the demo's step."""
    bf16_accuracy, bf16_losses = train_digits(None)
    fp8_accuracy, fp8_losses = train_digits(config)
    assert fp8_losses != bf16_losses  # FP8 ran
    assert fp8_losses[-1] < fp8_losses[0] / 10
    assert bf16_accuracy >= 0.95
    assert fp8_accuracy >= bf16_accuracy - 0.01, (fp8_accuracy, bf16_accuracy)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_positive_is_greater_than_zero_for_every_bit_pattern(dtype):
    """`fp8_step.positive`, the integer form of the ReLU derivative's `h8 > 0`, agrees with the
    float compare on all 256 values of the format (zeros, subnormals, NaN, Inf)."""
    every = np.arange(256, dtype=np.uint8).view(np.dtype(dtype))
    np.testing.assert_array_equal(np.asarray(fp8_step.positive(jnp.asarray(every))),
                                  every.astype(np.float32) > 0)
