"""`jax.grad` through `jax_epilog.matmul`: its backward runs in the operands' precision.

The float32 values are checked against the float64 model in test_matmul.py and
test_c_alpha_beta.py; here: 16-bit operands give 16-bit GEMMs (float32 accumulation inside the
GEMM, no float32 dot anywhere in the lowered gradient, on the CPU and in the CUDA export), the
16-bit gradients match the float32 ones within a 16-bit rounding at odd shapes, and `c`, `alpha`
and `beta` cost the backward nothing where nothing asks for them.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog
from jax_epilog.runtime import targets
from problems import make_problem

EPILOGS = [Epilog.DEFAULT, Epilog.BIAS, Epilog.RELU_BIAS, Epilog.GELU_BIAS, Epilog.RELU_AUX_BIAS]
LAYOUTS = {  # lead, b batched, bias batched, transpose_a, transpose_b
    "2d": ((), False, False, False, False),
    "transposed": ((), False, False, True, True),
    "lead_shared_b": ((2, 3), False, False, False, True),
    "lead_transposed_a": ((3,), False, False, True, False),
    "batched_b": ((3,), True, False, True, True),
    "batched_bias": ((2,), False, True, False, False),
}
DOT_OPERANDS = re.compile(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")


def _loss(fn, epilog, transpose_a, transpose_b, probe, **kw):
    def loss(a, b, inputs):
        out = fn(a, b, epilog=epilog, epilog_inputs=inputs or None, transpose_a=transpose_a,
                 transpose_b=transpose_b, **kw)
        y = out[0] if isinstance(out, tuple) else out
        return jnp.sum(y.astype(jnp.float32) * probe)
    return loss


def _problem(layout, epilog, dtype, m=6, n=9, k=5, seed=0):
    lead, b_batched, bias_batched, ta, tb = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, lead=lead, b_batched=b_batched,
                                bias_batched=bias_batched, transpose_a=ta, transpose_b=tb,
                                dtype=dtype)
    probe = jnp.asarray(rng.standard_normal((*lead, m, n)), jnp.float32)
    return a, b, inputs, probe, ta, tb


def dot_operand_types(text: str) -> list[tuple[str, str]]:
    pairs = DOT_OPERANDS.findall(text)
    assert text.count("stablehlo.dot_general") == len(pairs), "a dot_general was not parsed"
    return pairs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("epilog", EPILOGS, ids=lambda e: e.name)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_gradient_has_no_float32_dot(dtype, epilog, layout):
    a, b, inputs, probe, ta, tb = _problem(layout, epilog, dtype)
    loss = _loss(jax_epilog.matmul, epilog, ta, tb, probe)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(a, b, inputs).as_text()
    pairs = dot_operand_types(text)
    assert len(pairs) == 3, pairs  # the forward, the data gradient, the weight gradient
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    for pair in pairs:
        assert all(t.endswith(f"x{short}>") for t in pair), pair


@pytest.mark.parametrize("epilog", [Epilog.RELU_BIAS, Epilog.GELU_BIAS], ids=lambda e: e.name)
def test_cuda_export_of_the_gradient(epilog):
    """On CUDA the backward GEMMs are `matmul` calls too: the kernel (three custom calls) or,
    with `backend="xla"`, XLA's own GEMMs on bf16 operands (exported from a host without a GPU,
    where the custom VJP runs: the plain path needs the GPU's tables, see below)."""
    a, b, inputs, probe, ta, tb = _problem("2d", epilog, "bfloat16", m=64, n=48, k=32)
    for backend, custom_calls in (("cublaslt", 3), ("xla", 0)):
        loss = _loss(jax_epilog.matmul, epilog, ta, tb, probe, backend=backend)
        exported = jax.export.export(
            jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), platforms=("cuda",),
            disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(a, b, inputs)
        text = exported.mlir_module()
        calls = re.findall(r"stablehlo\.custom_call @(\w+)", text)
        assert calls.count(targets.MATMUL.name) == custom_calls, calls
        for pair in dot_operand_types(text):
            assert all(t.endswith("xbf16>") for t in pair), (backend, pair)
        if backend == "xla":
            assert len(dot_operand_types(text)) == 3


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.GELU_BIAS],
                         ids=lambda e: e.name)
def test_16_bit_gradient_matches_float32_within_a_rounding(epilog, layout):
    m, n, k = (129, 127, 1) if layout == "2d" else (1, 129, 127)
    a, b, inputs, probe, ta, tb = _problem(layout, epilog, "bfloat16", m=m, n=n, k=k, seed=3)
    got = jax.grad(_loss(jax_epilog.matmul, epilog, ta, tb, probe), argnums=(0, 1, 2))(
        a, b, inputs)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    want = jax.grad(_loss(jax_epilog.reference_matmul, epilog, ta, tb, probe,
                          precision="highest"), argnums=(0, 1, 2))(*f32((a, b, inputs)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == jnp.bfloat16 and g.shape == w.shape
        scale = float(jnp.max(jnp.abs(w)))
        # The forward output and dZ are rounded to bf16 once each (as XLA's plain expression
        # does): a few bf16 ulps of the gradient's magnitude.
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=0.03 * scale, rtol=0.03)


def _c_problem(dtype="bfloat16", seed=5):
    rng = np.random.default_rng(seed)
    a, b, inputs = make_problem(rng, Epilog.BIAS, m=33, n=17, k=9, dtype=dtype)
    c = jnp.asarray(rng.standard_normal((33, 17)), dtype)
    probe = jnp.asarray(rng.standard_normal((33, 17)), dtype)
    return a, b, c, inputs["bias"], probe


def test_residual_through_c_passes_the_cotangent_unchanged():
    """beta=1.0 (a Python number) with no activation: dc is the cotangent itself, bit for bit."""
    a, b, c, bias, probe = _c_problem()

    def f(c):
        return jax_epilog.matmul(a, b, c, beta=1.0, epilog="bias", epilog_inputs={"bias": bias})

    _, pullback = jax.vjp(f, c)
    (dc,) = pullback(probe)
    assert dc.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dc, np.float32), np.asarray(probe, np.float32))


def _reductions(jaxpr) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "reduce_sum"
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                count += _reductions(inner)
    return count


def test_python_alpha_beta_cost_no_reduction_and_traced_ones_one_each():
    a, b, c, bias, probe = _c_problem()

    def loss(a, b, c, alpha, beta):
        y = jax_epilog.matmul(a, b, c, alpha=alpha, beta=beta, epilog="bias",
                              epilog_inputs={"bias": bias})
        return jnp.sum(y.astype(jnp.float32) * probe.astype(jnp.float32))

    # Python numbers are closed over (make_jaxpr would trace positional ones).
    python = jax.make_jaxpr(jax.grad(lambda a, b, c: loss(a, b, c, 2.0, 1.0),
                                     argnums=(0, 1, 2)))(a, b, c).jaxpr
    traced = jax.make_jaxpr(jax.grad(loss, argnums=range(5)))(
        a, b, c, jnp.float32(2.0), jnp.float32(1.0)).jaxpr
    # The loss's own sum; the bias gradient comes from the weight-gradient GEMM (BGRADB).
    assert _reductions(python) == 1
    assert _reductions(traced) == 3  # d alpha and d beta: one reduction each


def test_traced_alpha_beta_gradients_in_bf16_match_float32():
    a, b, c, bias, probe = _c_problem(seed=6)

    def loss(a, b, c, alpha, beta, fn=jax_epilog.matmul, **kw):
        y = fn(a, b, c, alpha=alpha, beta=beta, epilog="relu_bias",
               epilog_inputs={"bias": bias.astype(a.dtype)}, **kw)
        return jnp.sum(y.astype(jnp.float32) * probe.astype(jnp.float32))

    args = (a, b, c, jnp.float32(0.75), jnp.float32(-1.25))
    got = jax.grad(loss, argnums=range(5))(*args)
    f32 = [x.astype(jnp.float32) for x in args]
    want = jax.grad(lambda *x: loss(*x, fn=jax_epilog.reference_matmul, precision="highest"),
                    argnums=range(5))(*f32)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == args[i].dtype, i
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=0.03 * scale, rtol=0.03,
                                   err_msg=f"argument {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cublaslt", "xla"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.GELU_BIAS],
                         ids=lambda e: e.name)
def test_gradient_on_the_gpu_matches_float32_within_a_rounding(epilog, layout, backend):
    """The backward GEMMs on the GPU, cuBLASLt's kernels (BGRADB / BGRADA) or XLA's (traced
    alpha and beta keep the custom VJP), against the reference's float32 gradient; with a
    residual through c. Integer operands and a bias off the grid keep the pre-activation exact
    and never 0, so every path's ReLU mask agrees."""
    m, n, k = (129, 127, 72) if layout == "2d" else (33, 129, 127)
    a, b, inputs, probe, ta, tb = _problem(layout, epilog, "bfloat16", m=m, n=n, k=k, seed=4)
    exact = lambda x, scale, offset=0.0: (jnp.round(x.astype(jnp.float32) * scale)
                                          + offset).astype(jnp.bfloat16)
    a, b = exact(a, 2.0), exact(b, np.sqrt(k))
    inputs = {"bias": exact(inputs["bias"], 1.0, 0.125)}  # z = 0.75 P + 1.5 c + bias
    c = exact(jnp.asarray(np.random.default_rng(9).standard_normal(probe.shape)), 2.0)

    def loss(fn, a, b, inputs, c, alpha, beta, **kw):
        y = fn(a, b, c, alpha=alpha, beta=beta, epilog=epilog, epilog_inputs=inputs,
               transpose_a=ta, transpose_b=tb, **kw)
        return jnp.sum(y.astype(jnp.float32) * probe)

    args = (a, b, inputs, c, jnp.float32(0.75), jnp.float32(1.5))
    got = jax.jit(jax.grad(lambda *x: loss(jax_epilog.matmul, *x, backend=backend),
                           argnums=range(6)))(*args)
    f32 = jax.tree.map(lambda x: x.astype(jnp.float32), args)
    want = jax.grad(lambda *x: loss(jax_epilog.reference_matmul, *x, precision="highest"),
                    argnums=range(6))(*f32)
    y = loss(jax_epilog.reference_matmul, *f32, precision="highest")
    # d alpha and d beta are sums of m·n terms that cancel: their 16-bit rounding error grows
    # with the terms' root-sum-square, not with the (smaller) result.
    terms = float(jnp.linalg.norm(probe)) * max(float(jnp.max(jnp.abs(f32[3]))), 4.0)
    assert np.isfinite(float(y))
    names = ["a", "b", "bias", "c", "alpha", "beta"]
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = 0.01 * terms if w.shape == () else 0.03 * float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=scale,
                                   rtol=0.03, err_msg=f"gradient of {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("m,n,k", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_gradient_of_empty_problems(layout, m, n, k):
    a, b, inputs, probe, ta, tb = _problem(layout, Epilog.RELU_BIAS, "float32", m=m, n=n, k=k)
    loss = lambda fn: _loss(fn, Epilog.RELU_BIAS, ta, tb, probe, precision="highest")
    got = jax.grad(loss(jax_epilog.matmul), argnums=(0, 1, 2))(a, b, inputs)
    want = jax.grad(loss(jax_epilog.reference_matmul), argnums=(0, 1, 2))(a, b, inputs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _relu_at_zero_gradient(epilog):
    """da of sum(matmul(a, b)) for a pre-activation that is exactly 0 in its first column."""
    a = jnp.asarray([[1.0, -1.0], [2.0, 3.0]], jnp.float32)
    b = jnp.asarray([[1.0, 2.0], [1.0, 1.0]], jnp.float32)  # z[0] = (1 - 1, 2 - 1) = (0, 1)

    def loss(a):
        out = jax_epilog.matmul(a, b, epilog=epilog, precision="highest",
                                epilog_inputs={"bias": jnp.zeros((2,), jnp.float32)}
                                if jax_epilog.op.epilogs.as_epilog(epilog).has_bias else None)
        return jnp.sum(out[0] if isinstance(out, tuple) else out)
    return jax.grad(loss)(a)


def test_relu_derivative_at_zero_follows_the_output_or_the_mask():
    """RELU / RELU_BIAS read the derivative off the output (0 at 0, as `jax.nn.relu`); the
    epilogs that return the mask follow the mask (its bit is set where z >= 0)."""
    for epilog in ("relu", "relu_bias"):
        np.testing.assert_array_equal(_relu_at_zero_gradient(epilog)[0], [2.0, 1.0])
    for epilog in ("relu_aux", "relu_aux_bias"):
        np.testing.assert_array_equal(_relu_at_zero_gradient(epilog)[0], [3.0, 2.0])


@pytest.fixture
def gpu_tables_choose_xla():
    """Plans as on a CUDA GPU whose tables send every GEMM to XLA (the plain path's trigger)."""
    from jax_epilog.planning import table_format
    from jax_epilog.planning import context
    ctx = context.default_context()._replace(
        tables_decide=lambda: True, override=lambda: None,
        gemm_table=lambda *problem: table_format.Decision("xla", "test"))
    with context.planning(ctx):
        yield


def _epilog_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("epilog_matmul[")


@pytest.mark.parametrize("epilog", [Epilog.BIAS, Epilog.RELU_BIAS, Epilog.GELU_BIAS],
                         ids=lambda e: e.name)
def test_plain_path_where_every_gemm_runs_xla(gpu_tables_choose_xla, epilog):
    """No custom VJP and no kernel call left: JAX differentiates the plain expression, whose
    gradient matches the reference's; traced alpha/beta and aux outputs keep the custom VJP."""
    a, b, inputs, probe, ta, tb = _problem("lead_shared_b", epilog, "float32", seed=8)
    loss = _loss(jax_epilog.matmul, epilog, ta, tb, probe, precision="highest")
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _epilog_calls(grad, a, b, inputs) == 0
    want = jax.grad(_loss(jax_epilog.reference_matmul, epilog, ta, tb, probe,
                          precision="highest"), argnums=(0, 1, 2))(a, b, inputs)
    for g, w in zip(jax.tree.leaves(grad(a, b, inputs)), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    aux = Epilog.RELU_AUX_BIAS if epilog.activation == "relu" else epilog.with_aux
    if aux.aux_output:
        aux_loss = _loss(jax_epilog.matmul, aux, ta, tb, probe, precision="highest")
        assert _epilog_calls(jax.grad(aux_loss), a, b, inputs) > 0
    c = jnp.ones(probe.shape, jnp.float32)
    traced = lambda a, alpha: jnp.sum(jax_epilog.matmul(a, b, c, alpha=alpha, beta=1.0,
                                                        epilog=epilog, epilog_inputs=inputs or
                                                        None, transpose_a=ta, transpose_b=tb))
    assert _epilog_calls(jax.grad(traced), a, jnp.float32(2.0)) > 0


def _kernel_problems(jaxpr) -> list[tuple]:
    """(epilog, batch, M, N, K, transpose_a, transpose_b) of every epilog_matmul in a jaxpr."""
    from jax_epilog.op.call import problem_of
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "epilog_matmul":
            p = eqn.params
            a, b = (v.aval.shape for v in eqn.invars[:2])
            found.append((Epilog(p["epilog"]), *problem_of(a, b, p["transpose_a"],
                                                           p["transpose_b"]),
                          p["transpose_a"], p["transpose_b"]))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                found += _kernel_problems(inner)
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("epilog", [Epilog.DEFAULT, Epilog.RELU_BIAS, Epilog.GELU_BIAS],
                         ids=lambda e: e.name)
def test_the_plan_lists_the_gemms_the_backward_issues(epilog, layout):
    """`call_plan.matmul_step_gemms` (by which `matmul` chooses the plain path) names the GEMMs the
    custom VJP runs (a per-batch bias with a shared b sums in XLA instead of BGRADB)."""
    from jax_epilog.op import arguments
    from jax_epilog.op import matmul as matmul_module
    from jax_epilog.planning import call_plan
    a, b, inputs, probe, ta, tb = _problem(layout, epilog, "bfloat16", m=6, n=9, k=5)
    loss = _loss(jax_epilog.matmul, epilog, ta, tb, probe)
    traced = sorted(_kernel_problems(jax.make_jaxpr(jax.value_and_grad(
        loss, argnums=(0, 1, 2)))(a, b, inputs).jaxpr), key=str)
    call = arguments.prepare(a, b, epilog, inputs or None, ta, tb, None)
    planned = sorted(((g.epilog, g.batch, g.m, g.n, g.k, g.transpose_a, g.transpose_b)
                      for g in call_plan.matmul_step_gemms(
                          call.params, call.a.shape, call.b.shape, call.a.dtype,
                          matmul_module._forward_epilog(epilog))), key=str)
    if layout == "batched_bias":  # the bias gradient is a sum in XLA, the GEMM plain
        planned = sorted(((Epilog.DEFAULT if e == Epilog.BGRADB else e, *rest)
                          for e, *rest in planned), key=str)
    assert traced == planned


def test_a_bias_gradient_kernel_alone_keeps_the_plain_path():
    """A table entry that prefers BGRADB/BGRADA to XLA's GEMM plus its own bias sum does not
    take the step off the plain path: there XLA fuses the sum into dZ's pass (the H200's G6
    step ran slower through the custom VJP). A plain GEMM the table sends to cuBLASLt does."""
    from jax_epilog.planning import table_format
    from jax_epilog.planning import context

    def planned(kernel_epilogs):
        ctx = context.default_context()._replace(
            tables_decide=lambda: True, override=lambda: None,
            gemm_table=lambda epilog, *problem: table_format.Decision(
                "cublaslt" if epilog in kernel_epilogs else "xla", "test"))
        with context.planning(ctx):
            return _epilog_calls(jax.grad(loss, argnums=(0, 1, 2)), a, b, inputs)

    a, b, inputs, probe, ta, tb = _problem("lead_shared_b", Epilog.RELU_BIAS, "float32", seed=3)
    loss = _loss(jax_epilog.matmul, Epilog.RELU_BIAS, ta, tb, probe, precision="highest")
    assert planned({Epilog.BGRADB, Epilog.BGRADA}) == 0
    assert planned({Epilog.DEFAULT}) > 0


def _stablehlo(fn, *args) -> str:
    """fn's gradient as StableHLO, without locations, its module name or the dots'
    precision_config (DEFAULT spelled out or left out is the same to XLA)."""
    import re
    text = jax.jit(jax.grad(fn, argnums=tuple(range(len(args))))).lower(*args).as_text(
        debug_info=False)
    return re.sub(r"module @\S+", "module", re.sub(r"precision_config = \[[^\]]*\], ?", "", text))


@pytest.mark.parametrize("epilog, activation", [
    ("default", None), ("bias", None), ("relu_bias", jax.nn.relu),
    ("gelu_bias", lambda z: jax.nn.gelu(z, approximate=True))])
@pytest.mark.parametrize("lead, transpose_b", [((), False), ((3,), False), ((), True)])
def test_plain_path_is_the_users_own_program(gpu_tables_choose_xla, epilog, activation, lead,
                                             transpose_b):
    """On the plain path a call with a 2-D b and a (N,) bias lowers to exactly the StableHLO of
    the expression its user would write (`jax.nn.gelu(x @ W + b)`), gradient included: XLA
    then compiles the user's own program (the rank-3 form ran 2-7% behind with GELU)."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((*lead, 127, 48)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((40, 48) if transpose_b else (48, 40)), jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(40), jnp.bfloat16)
    has_bias = epilog != "default"

    def ours(x, w, *bias):
        y = jax_epilog.matmul(x, w, epilog=epilog, transpose_b=transpose_b,
                              epilog_inputs={"bias": bias[0]} if bias else None)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def users(x, w, *bias):
        z = x @ (w.T if transpose_b else w)
        z = z + bias[0] if bias else z
        return jnp.sum((activation(z) if activation else z).astype(jnp.float32) ** 2)

    args = (x, w, bias) if has_bias else (x, w)
    assert _stablehlo(ours, *args) == _stablehlo(users, *args)
