"""The fused FP8 passes' CUDA kernels (ffi/fused_kernels.cu) against their plain-JAX references
compiled by XLA on the same GPU, on random data (never zeros) at odd shapes: 1, 127, 129, sizes
that are not multiples of 8 nor of the 128-wide tile (the kernels' scalar and vector paths).

- cast-transpose: bit for bit (y, yᵀ and the amax), bfloat16 and float16 inputs, e4m3 and e5m2.
- SwiGLU: g8, u8 and the amaxes of g and u bit for bit; h and `[dg du]` go through silu, whose
  exp the kernel and XLA may round differently in the last bit, so their FP8 codes may differ
  by one step on a few elements (bounded here), and their amaxes by an ulp.
- The layers with JAX_EPILOG_FUSED_PASSES=cuda: the FP8 stack's results are the same bits as
  with XLA's fusions; the SwiGLU block's are close.

Every test is marked `gpu` and skipped without a CUDA device; where the library lacks the
kernels (built without nvcc) they fail, saying why.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog.float8 import fused
from jax_epilog.float8.scaling import multiplier
from jax_epilog.layers import fused_swiglu
from command_buffers import run_with_command_buffers

pytestmark = pytest.mark.gpu

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
DTYPES = [jnp.bfloat16, jnp.float16]
FORMATS = [E4M3, E5M2]
# (rows, columns): one element; one row; odd both ways; a multiple of 8 but not of the tile;
# thin ones; several tiles with a partial last one.
SHAPES = [(1, 1), (1, 129), (127, 129), (129, 127), (8, 1000), (1000, 8), (264, 136), (300, 257)]
# At most this fraction of h's or [dg du]'s FP8 codes may differ by one step (the last bit of
# silu's exp); none by more.
CODE_FLIPS = 1e-3


@pytest.fixture(autouse=True)
def cuda_engine(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "cuda")
    reason = fused.unavailable_reason()
    if reason is not None:
        pytest.fail(f"the fused kernels cannot run here: {reason}")


def _random(shape, dtype, seed, scale=1.0):
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale
    return jnp.where(x == 0, 0.5, x).astype(dtype)  # never a zero


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _kernel(fn, target, *args):
    """fn(*args) jitted, after checking that its compiled module calls `target`."""
    compiled = jax.jit(fn).lower(*args).compile()
    assert f'custom_call_target="{target}"' in compiled.as_text(), f"{target} did not run"
    return compiled(*args)


def _one_step_apart(got, want, fmt):
    """At most CODE_FLIPS of the codes differ, each by one FP8 step."""
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    differ = _bits(got) != _bits(want)
    step = 2.0 ** (-3 if fmt == E4M3 else -2)
    tiny = float(jnp.finfo(fmt).smallest_subnormal)
    assert np.all(np.abs(a - b) <= np.maximum(np.abs(a), np.abs(b)) * step + tiny), \
        "codes more than one step apart"
    assert differ.mean() <= CODE_FLIPS, f"{differ.sum()} of {differ.size} codes differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_transpose_is_bit_exact(shape, dtype, fmt):
    x = _random(shape, dtype, seed=sum(shape), scale=20.0)
    # a multiplier that saturates the largest values (twice the amax's)
    q = 2 * multiplier(jnp.max(jnp.abs(x)).astype(jnp.float32), fmt, 0)
    y, yt, x_amax = _kernel(lambda x, q: fused.cast_transpose(x, q, fmt),
                            "jax_epilog_cast_transpose", x, q)
    want_y, want_yt, want_amax = jax.jit(
        lambda x, q: fused.cast_transpose_reference(x, q, fmt))(x, q)
    np.testing.assert_array_equal(_bits(y), _bits(want_y))
    np.testing.assert_array_equal(_bits(yt), _bits(want_yt))
    assert float(x_amax) == float(want_amax)
    assert np.any(np.abs(np.asarray(y, np.float32)) == float(jnp.finfo(fmt).max))


def test_cast_transpose_of_infinities():
    x = _random((67, 45), jnp.bfloat16, seed=3).at[5, 7].set(jnp.inf).at[60, 44].set(-jnp.inf)
    q = jnp.float32(16.0)
    y, yt, x_amax = _kernel(lambda x, q: fused.cast_transpose(x, q, E4M3),
                            "jax_epilog_cast_transpose", x, q)
    want = jax.jit(lambda x, q: fused.cast_transpose_reference(x, q, E4M3))(x, q)
    np.testing.assert_array_equal(_bits(y), _bits(want[0]))
    np.testing.assert_array_equal(_bits(yt), _bits(want[1]))
    assert float(x_amax) == float(want[2]) == np.inf


@pytest.mark.parametrize("rows,hidden", [(1, 1), (127, 129), (129, 64), (300, 136)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_forward(rows, hidden, dtype):
    gu = _random((rows, 2 * hidden), dtype, seed=rows + hidden, scale=3.0)
    amaxes = _kernel(fused_swiglu.swiglu_amaxes, "jax_epilog_swiglu_amaxes", gu)
    want_amaxes = jax.jit(fused_swiglu.swiglu_amaxes_reference)(gu)
    np.testing.assert_array_equal(np.asarray(amaxes[1:]), np.asarray(want_amaxes[1:]))
    np.testing.assert_allclose(float(amaxes[0]), float(want_amaxes[0]), rtol=2.0 ** -21)
    q = jnp.stack([multiplier(a, E4M3, 0) for a in want_amaxes])
    for keep in (True, False):
        got = _kernel(lambda gu, q: fused_swiglu.swiglu_quantize(gu, q, E4M3, keep),
                      "jax_epilog_swiglu_quantize", gu, q)
        want = jax.jit(lambda gu, q: fused_swiglu.swiglu_quantize_reference(gu, q, E4M3, keep))(
            gu, q)
        assert len(got) == (3 if keep else 1)
        _one_step_apart(got[0], want[0], E4M3)
        for a, b in zip(got[1:], want[1:]):
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("rows,hidden", [(1, 1), (127, 129), (129, 64), (264, 136)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_backward(rows, hidden, dtype, fmt):
    dh = _random((rows, hidden), dtype, seed=rows, scale=2.0)
    g8 = _random((rows, hidden), jnp.float32, seed=rows + 1, scale=60.0).astype(E4M3)
    u8 = _random((rows, hidden), jnp.float32, seed=rows + 2, scale=60.0).astype(E4M3)
    g_scale, u_scale = jnp.float32(0.04), jnp.float32(0.03)
    args = (dh, g8, u8, g_scale, u_scale)
    got_amax = _kernel(fused_swiglu.swiglu_grad_amax, "jax_epilog_swiglu_grad_amax", *args)
    scales = jnp.stack([g_scale, u_scale, jnp.float32(0)])
    want_amax = jax.jit(fused_swiglu.swiglu_grad_amax_reference)(dh, g8, u8, scales)
    # dg and du are rounded to dh's dtype: an ulp of float32 apart before, one of it after
    np.testing.assert_allclose(float(got_amax), float(want_amax), rtol=2.0 ** -7)
    q = multiplier(want_amax, fmt, 0)
    dgu8, dgu8t = _kernel(lambda *a: fused_swiglu.swiglu_grad_quantize(*a, fmt),
                          "jax_epilog_swiglu_grad_quantize", *args, q)
    want8, _ = jax.jit(lambda *a: fused_swiglu.swiglu_grad_quantize_reference(*a, fmt))(
        dh, g8, u8, scales.at[2].set(q))
    assert dgu8.shape == (rows, 2 * hidden) and dgu8t.shape == (2 * hidden, rows)
    np.testing.assert_array_equal(_bits(dgu8t), _bits(dgu8).T)
    _one_step_apart(dgu8, want8, fmt)


def _step(loss):
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def test_the_fp8_stack_is_the_same_with_the_kernels(monkeypatch):
    k = jax.random.split(jax.random.key(8), 3)
    x = jax.random.normal(k[0], (264, 256), jnp.bfloat16)
    w0 = jax.random.normal(k[1], (256, 384), jnp.bfloat16) * 0.05
    w1 = jax.random.normal(k[2], (384, 128), jnp.bfloat16) * 0.05
    b0 = jnp.full((384,), 0.01, jnp.bfloat16)
    fp8 = jax_epilog.Fp8(layers="all")

    def loss(x, w0, w1):
        y = jax_epilog.mlp(x, [(w0, b0), (w1, None)], fp8=fp8)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    got = _step(loss)(x, w0, w1)
    assert "jax_epilog_cast_transpose" in _step(loss).lower(x, w0, w1).compile().as_text()
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "xla")
    want = _step(loss)(x, w0, w1)
    assert float(got[0]) == float(want[0])
    for g, w in zip(got[1], want[1]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_fp8_swiglu_block_with_the_kernels(monkeypatch):
    k = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(k[0], (264, 256), jnp.bfloat16)
    gate_up = jax.random.normal(k[1], (256, 2 * 384), jnp.bfloat16) * 0.05
    down = jax.random.normal(k[2], (384, 256), jnp.bfloat16) * 0.05
    fp8 = jax_epilog.Fp8(layers="all")

    def loss(x, gate_up, down):
        return jnp.sum(jax_epilog.swiglu(x, gate_up, down, fp8=fp8).astype(jnp.float32) ** 2)

    hlo = _step(loss).lower(x, gate_up, down).compile().as_text()
    for target in ("cast_transpose", "swiglu_amaxes", "swiglu_quantize", "swiglu_grad_amax",
                   "swiglu_grad_quantize"):
        assert f'custom_call_target="jax_epilog_{target}"' in hlo, target
    got = _step(loss)(x, gate_up, down)
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "xla")
    want = _step(loss)(x, gate_up, down)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-3)
    for g, w in zip(got[1], want[1]):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) <= 0.05 * np.max(np.abs(w))


def test_auto_takes_the_kernels_on_one_gpu(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_FUSED_PASSES", "auto")
    assert fused.uses_cuda() == (jax.device_count() == 1)


def test_the_handler_checks_its_buffers():
    """A call whose buffers do not match fails with the handler's message (naming the buffer),
    not with a kernel reading out of bounds."""
    results = (jax.ShapeDtypeStruct((4, 8), E4M3), jax.ShapeDtypeStruct((4, 8), E4M3),
               jax.ShapeDtypeStruct((), jnp.float32))
    call = jax.jit(lambda x, q: jax.ffi.ffi_call("jax_epilog_cast_transpose", results)(x, q))
    with pytest.raises(Exception, match=r"jax_epilog_cast_transpose: yt must be 2-D "
                                        r"float8_e4m3fn or float8_e5m2 of shape \(8, 4\)"):
        jax.block_until_ready(call(jnp.ones((4, 8), jnp.bfloat16), jnp.float32(1)))


COMMAND_BUFFER_SCRIPT = """
import os
import jax, jax.numpy as jnp, numpy as np
from jax_epilog.float8 import fused
from jax_epilog.layers import fused_swiglu

def step(x, gu, dh):
    x8, x8t, _, _ = fused.quantize_transpose(x, "float8_e5m2")
    h8, _, _, g8, gs, u8, us = fused_swiglu.swiglu_forward(gu, "float8_e4m3fn")
    dgu8, dgu8t, _, _ = fused_swiglu.swiglu_gradient(dh, g8, gs, u8, us, "float8_e5m2")
    return x8, x8t, g8, u8, dgu8, dgu8t

k = jax.random.split(jax.random.key(0), 3)
args = (jax.random.normal(k[0], (300, 264), jnp.bfloat16),
        jax.random.normal(k[1], (264, 272), jnp.bfloat16),
        jax.random.normal(k[2], (264, 136), jnp.bfloat16))
os.environ["JAX_EPILOG_FUSED_PASSES"] = "cuda"
kernels = jax.jit(step)
assert "jax_epilog_swiglu_grad_quantize" in kernels.lower(*args).compile().as_text()
got = [kernels(*args) for _ in range(3)][-1]
os.environ["JAX_EPILOG_FUSED_PASSES"] = "xla"
want = jax.jit(step)(*args)
bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))
for name, g, w in zip(("x8", "x8t", "g8", "u8"), got, want):
    np.testing.assert_array_equal(bits(g), bits(w), err_msg=name)
np.testing.assert_array_equal(bits(got[5]), bits(got[4]).T)
print("FUSED_IN_COMMAND_BUFFERS_OK")
"""


def test_the_kernels_inside_command_buffers():
    """The passes jitted with XLA's command buffers forced on for custom calls (CUDA graphs
    capture the kernels' launches and the amax memsets), in a child process: the same bytes as
    XLA's way where those are exact."""
    done = run_with_command_buffers(COMMAND_BUFFER_SCRIPT)
    assert "FUSED_IN_COMMAND_BUFFERS_OK" in done.stdout, done.stdout[-2000:]
