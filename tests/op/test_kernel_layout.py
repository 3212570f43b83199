"""The CUDA lowering's re-layout (`call_plan.kernel_layout`): where cuBLASLt has no kernel for a
call's operand layout but has one for another, the operand(s) are transposed in XLA and the
custom call runs in that layout, instead of the reference.

Lowered for CUDA from this host with a stand-in for cuBLASLt's answer (`query_support`) that
has the H200's gaps (cuBLASLt 13.1: BGRADA only with a stored (K, M), BGRADB only with b stored
(K, N)); on the GPU, `tests/op/test_matmul_gpu.py` checks the real answer and the values.
"""

import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from jax_epilog.op import lowering
from jax_epilog.planning import context
from jax_epilog.op.call import Params, kernel_p
from problems import make_problem

LAYOUTS = list(itertools.product([False, True], repeat=2))


def _h200_gaps(epilog, dtype, transpose_a, transpose_b, *args, **kw):
    """Like cuBLASLt 13.1 on the H200 for the bias-gradient epilogs; everything else runs."""
    if epilog == Epilog.BGRADA and not transpose_a:
        return False, "CUBLAS_STATUS_NOT_SUPPORTED (test)"
    if epilog == Epilog.BGRADB and transpose_b:
        return False, "CUBLAS_STATUS_NOT_SUPPORTED (test)"
    return True, ""


def _on_cuda(monkeypatch, query=_h200_gaps):
    """Lowering for CUDA as on a GPU machine whose cuBLASLt answers `query`."""
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    monkeypatch.setattr(lowering.cuda_library, "available", lambda: True)
    monkeypatch.setattr(lowering.cuda_library, "query_support", query)
    monkeypatch.setattr(context, "has_cuda_devices", lambda: False)


def _export(f, *args) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        return jax.export.export(jax.jit(f), platforms=("cuda",),
                                 disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(
            *args).mlir_module()


def _custom_calls(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if "stablehlo.custom_call @jax_epilog_matmul" in line]


@pytest.mark.parametrize("has_c", [False, True], ids=["", "with_c"])
@pytest.mark.parametrize("own,target", [(o, t) for o in LAYOUTS for t in LAYOUTS if o != t],
                         ids=lambda t: "%d%d" % t)
@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB, Epilog.DRELU_BGRAD,
                                    Epilog.GELU_AUX_BIAS], ids=lambda e: e.name)
def test_the_relaid_out_call_gives_the_call_s_results(epilog, own, target, has_c):
    """The re-laid-out inner call (run here by the reference, in the new layout) against the
    call itself: the transposes are right and no output depends on the operands' layout."""
    m, n, k = (127, 129, 1) if own[0] else (1, 127, 129)
    rng = np.random.default_rng(hash((epilog, own, target, has_c)) % 2**32)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, transpose_a=own[0],
                                transpose_b=own[1], dtype="float32")
    args = [a[None], b[None], *(jnp.asarray(inputs[name])[None] for name in epilog.input_names)]
    if has_c:
        args += [jnp.asarray(rng.standard_normal((1, m, n)), jnp.float32), jnp.float32(0.75),
                 jnp.float32(-1.5)]
    params = Params(int(epilog), *own, allow_tf32=False, has_c=has_c)
    want = jax.jit(lambda *args: kernel_p.bind(*args, **params._asdict()))(*args)
    inner = params._replace(transpose_a=target[0], transpose_b=target[1])
    kernel = lambda *args: kernel_p.bind(*args, **inner._asdict())  # the reference, here
    got = jax.jit(lowering.around_kernel(kernel, params, target, None))(*args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose_a,transpose_b", LAYOUTS)
@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB], ids=lambda e: e.name)
@pytest.mark.parametrize("m,n,k", [(16, 32, 24), (7, 130, 13)])  # aligned; padded K and N
def test_bias_gradients_run_the_kernel_in_every_layout(epilog, transpose_a, transpose_b, m, n, k,
                                                       monkeypatch):
    _on_cuda(monkeypatch)
    rng = np.random.default_rng(0)
    a, b, _ = make_problem(rng, epilog, m=m, n=n, k=k, transpose_a=transpose_a,
                           transpose_b=transpose_b, dtype="float32")
    text = _export(lambda a, b: jax_epilog.matmul(a, b, epilog=epilog, transpose_a=transpose_a,
                                                  transpose_b=transpose_b), a, b)
    calls = _custom_calls(text)
    assert len(calls) == 1, text
    # The summed operand is stored K by rows: a (K, M) for BGRADA, b (K, N) for BGRADB; the
    # other operand keeps the caller's layout.
    want_a, want_b = (True, transpose_b) if epilog == Epilog.BGRADA else (transpose_a, False)
    assert f"transpose_a = {str(want_a).lower()}" in calls[0], calls[0]
    assert f"transpose_b = {str(want_b).lower()}" in calls[0], calls[0]
    relaid = (want_a, want_b) != (transpose_a, transpose_b)
    assert text.count("stablehlo.transpose") == int(relaid), text
    kp, np_ = -(-k // 4) * 4, -(-n // 4) * 4  # float32 pads K and N to 4 elements
    a_shape = f"1x{kp}x{m}" if want_a else f"1x{m}x{kp}"
    b_shape = f"1x{kp}x{np_}" if not want_b else f"1x{np_}x{kp}"
    assert f"(tensor<{a_shape}xf32>, tensor<{b_shape}xf32>)" in calls[0], calls[0]


def test_the_smaller_operand_is_transposed_when_either_would_do(monkeypatch):
    def only_default_layout(epilog, dtype, transpose_a, transpose_b, *args, **kw):
        return (transpose_a, transpose_b) != (True, True), ""

    _on_cuda(monkeypatch, only_default_layout)
    a = jnp.ones((64, 16), jnp.float32)   # (K, M): 4 KiB
    b = jnp.ones((256, 64), jnp.float32)  # (N, K): 64 KiB
    text = _export(lambda a, b: jax_epilog.matmul(a, b, transpose_a=True, transpose_b=True), a, b)
    call = _custom_calls(text)[0]
    assert "transpose_a = false" in call and "transpose_b = true" in call, call
    assert "(tensor<1x16x64xf32>, tensor<1x256x64xf32>" in call, call


def test_no_layout_with_a_kernel_runs_the_reference(monkeypatch):
    _on_cuda(monkeypatch, lambda *args, **kw: (False, "CUBLAS_STATUS_NOT_SUPPORTED (test)"))
    a, b = jnp.ones((16, 24), jnp.float32), jnp.ones((24, 32), jnp.float32)
    text = _export(lambda a, b: jax_epilog.matmul(a, b, epilog="bgrada"), a, b)
    assert not _custom_calls(text) and "stablehlo.dot_general" in text


def test_a_supported_layout_is_not_transposed(monkeypatch):
    asked = []

    def everything(epilog, dtype, transpose_a, transpose_b, *args, **kw):
        asked.append((transpose_a, transpose_b))
        return True, ""

    _on_cuda(monkeypatch, everything)
    a, b = jnp.ones((16, 24), jnp.float32), jnp.ones((32, 24), jnp.float32)
    text = _export(lambda a, b: jax_epilog.matmul(a, b, epilog="bgradb", transpose_b=True), a, b)
    assert "stablehlo.transpose" not in text and len(_custom_calls(text)) == 1
    assert asked == [(False, True)]  # only the call's own layout was asked about


@pytest.mark.parametrize("epilog", [Epilog.BGRADA, Epilog.BGRADB], ids=lambda e: e.name)
def test_with_c_the_c_matrix_passes_through_unchanged(epilog, monkeypatch):
    """c has y's shape whatever the operands' layout: only a or b is transposed."""
    _on_cuda(monkeypatch)
    m, n, k = 16, 32, 24
    rng = np.random.default_rng(1)
    a, b, _ = make_problem(rng, epilog, m=m, n=n, k=k, transpose_b=True, dtype="float32")
    c = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    text = _export(lambda a, b, c, beta: jax_epilog.matmul(a, b, c, beta=beta, epilog=epilog,
                                                           transpose_b=True),
                   a, b, c, jnp.float32(0.5))
    calls = [line for line in text.splitlines() if "custom_call @jax_epilog_matmul_c(" in line]
    assert len(calls) == 1, text
    signature = calls[0].rsplit(" : ", 1)[1]
    a_shape = f"1x{k}x{m}" if epilog == Epilog.BGRADA else f"1x{m}x{k}"
    b_shape = f"1x{n}x{k}" if epilog == Epilog.BGRADA else f"1x{k}x{n}"
    assert re.search(rf"\(tensor<{a_shape}xf32>, tensor<{b_shape}xf32>, "
                     rf"tensor<1x{m}x{n}xf32>, tensor<f32>, tensor<f32>\)", signature), signature
    assert text.count("stablehlo.transpose") == 1, text
