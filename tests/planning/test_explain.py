"""`jax_epilog.explain` and the plan it prints: the plan's list of a stack's GEMMs is what the
layers issue (epilog, dtypes, sizes, layout, requested backend), and every choice is printed
with the rule or table entry that made it. CPU: the explanation is planned as on the H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog, Fp8
from jax_epilog.planning import call_plan, context, stack_plan
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.tools import explain as explanation
from jax_epilog.float8 import scaling as fp8
from jax_epilog.planning import call_plan, context
S = jax.ShapeDtypeStruct


@pytest.fixture(autouse=True)
def no_user_settings(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", "")
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    decisions.clear_cache()
    yield
    decisions.clear_cache()


@pytest.fixture
def matmul_keeps_its_vjp(monkeypatch):
    """`matmul` runs a differentiable call whose whole step runs XLA's way as the plain
    expression (`call_plan.plan_matmul_step`), which leaves no `epilog_matmul` in the trace; here
    every GEMM the layers ask for stays one, so the list can be compared with the trace."""
    monkeypatch.setattr(call_plan, "plan_matmul_step",
                        lambda *args: context.Choice("fused", "not under test"))


def stack_args(rows, widths, biases=None, dtype=jnp.bfloat16):
    biases = biases or (True,) * (len(widths) - 1)
    params = tuple((S((k, n), dtype), S((n,), dtype) if bias else None)
                   for k, n, bias in zip(widths, widths[1:], biases))
    return S((rows, widths[0]), dtype), params


def step_of(layer):
    """The training step of `layer(x, params)`: gradients w.r.t. x and the parameters."""
    return jax.grad(lambda x, p: layer(x, p).astype(jnp.float32).sum(), argnums=(0, 1))


def traced_calls(e):
    """(epilog, a's dtype, (batch, M, N, K), transposes, backend) of each call, as traced."""
    return planned([c.gemm for c in e.calls])


def planned(gemms):
    return [(g.epilog, g.operand_dtype, (g.batch, g.m, g.n, g.k), g.transpose_a,
             g.transpose_b, g.requested) for g in gemms]


LAYERS = {
    "fused relu": dict(activation="relu", forward="fused", backward="fused"),
    "fused gelu, final relu": dict(activation="gelu", final_activation="relu",
                                   forward="fused", backward="fused"),
    "fused forward, xla backward": dict(activation="relu", forward="fused", backward="xla"),
    "fp8 relu": dict(activation="relu", fp8=Fp8(layers="all")),
    "fp8 gelu": dict(activation="gelu", fp8=Fp8(layers="all")),
    "fp8 relu fused backward": dict(activation="relu", fp8=Fp8(layers="all"), backward="fused"),
}


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("biases", [(True, True, True), (False, True, False)])
def test_the_planned_gemms_are_the_ones_the_layers_issue(name, biases, matmul_keeps_its_vjp):
    kwargs = LAYERS[name]
    fp8 = "fp8" in kwargs
    widths = (64, 128, 96, 32) if fp8 else (127, 65, 33, 17)  # FP8: multiples of 16
    x, params = stack_args(129, widths, biases)
    layer = functools.partial(jax_epilog.mlp, **kwargs)
    step = explanation.explanation(step_of(layer), (x, params))
    (sp,) = step.stacks
    assert sp.step.choice == ("fp8" if fp8 else "fused") and sp.quantized == (fp8,) * 3
    assert len(sp.gemms) == 9 and planned(sp.gemms) == traced_calls(step)
    forward = explanation.explanation(layer, (x, params))
    assert planned(forward.stacks[0].forward_gemms) == traced_calls(forward)
    assert len(forward.calls) == 3


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_delayed_scaling_gemms_write_fp8_where_the_plan_says(activation, matmul_keeps_its_vjp):
    config = Fp8(layers="all", scaling="delayed")
    x, params = stack_args(256, (64, 128, 96, 32))
    state = jax.tree.map(lambda a: S(a.shape, a.dtype), config.init_state(3))

    def step(x, params, state):
        return jax.grad(lambda x, p, s: jax_epilog.mlp(
            x, p, activation=activation, fp8=config, fp8_state=s).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(x, params, state)

    with fp8.uncalibrated():
        e = explanation.explanation(step, (x, params, state))
    (sp,) = e.stacks
    assert planned(sp.gemms) == traced_calls(e)
    relu = activation == "relu"
    assert [lp.writes_fp8_result for lp in sp.layers] == [True, True, False]
    assert [lp.writes_fp8_gradient for lp in sp.layers] == [relu, relu, False]
    fp8_results = [g.result_dtype for g in sp.gemms if g.result_dtype.startswith("float8")]
    assert len(fp8_results) == 2 + 2 * relu
    # Self-calibrating, the step runs the same GEMMs (a cold history changes scales only)
    e = explanation.explanation(step, (x, params, state))
    (sp,) = e.stacks
    assert planned(sp.gemms) == traced_calls(e)
    assert "while a tensor's amax history is cold" in str(e)


def test_a_mixed_fp8_stack_says_why_each_layer_is_what_it_is(monkeypatch, matmul_keeps_its_vjp):
    monkeypatch.setattr(stack_plan, "FP8_MIN_FLOPS", 2 * 64 * 64 * 128)
    x, params = stack_args(64, (64, 128, 129, 16))
    e = explanation.explanation(step_of(functools.partial(jax_epilog.mlp, fp8=True)), (x, params))
    (sp,) = e.stacks
    assert sp.quantized == (True, False, False)
    assert "FP8_MIN_FLOPS" in sp.layers[0].why and ">=" in sp.layers[0].why
    assert "not a multiple of 16" in sp.layers[1].why
    assert "not a multiple of 16" in sp.layers[2].why
    assert planned(sp.gemms) == traced_calls(e)
    text = str(e)
    assert "layer 0: FP8: 2·rows·K·N" in text and "layer 1: bfloat16: K=128 or N=129" in text


def test_small_layers_stay_bf16_below_the_threshold():
    x, params = stack_args(8, (16, 32, 16))
    e = explanation.explanation(step_of(functools.partial(jax_epilog.mlp, fp8=True)), (x, params))
    (sp,) = e.stacks
    assert sp.quantized == (False, False) and sp.step.choice != "fp8"
    assert all("FP8_MIN_FLOPS" in lp.why and "<" in lp.why for lp in sp.layers)


def test_each_gemm_names_the_table_entry_that_chose_it(tmp_path, monkeypatch):
    """A user table entry for the forward GEMM decides it ("your table", with its times); the
    override decides every GEMM left to auto."""
    if context.on_cuda_gpu():
        device, version = decisions.device_identity()
    else:
        device, version = table_format.REFERENCE_DEVICE, None
    table = tmp_path / "decisions.json"
    decisions.merge_into(table, device, version, [table_format.make_entry(
        Epilog.RELU_AUX_BIAS, "bfloat16", False, False, 4099, 520, 1030,
        {"cublaslt": 1.0e-3, "xla": 2.0e-3})])
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(table))
    decisions.clear_cache()
    x, params = stack_args(4099, (1030, 520))
    e = explanation.explanation(step_of(functools.partial(jax_epilog.mlp, activation="relu",
                                                      final_activation="relu")), (x, params))
    (sp,) = e.stacks
    forward = sp.gemm(0, "forward")
    assert forward.backend == "cublaslt" and "your table" in forward.why
    assert "1000.0 us" in forward.why and "2000.0 us" in forward.why
    assert sp.step.choice == "fused" and "a GEMM runs cuBLASLt" in sp.step.why
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "xla")
    e = explanation.explanation(step_of(functools.partial(jax_epilog.mlp, activation="relu",
                                                      final_activation="relu")), (x, params))
    (sp,) = e.stacks
    assert {g.backend for g in sp.gemms} == {"xla"}
    assert {g.why for g in sp.gemms} == {"JAX_EPILOG_BACKEND"}
    assert sp.step.choice == "plain" and e.calls == ()


def test_explain_prints_stacks_gemms_and_calls(capsys, matmul_keeps_its_vjp):
    x, params = stack_args(129, (127, 65, 17))
    returned = jax_epilog.explain(step_of(functools.partial(
        jax_epilog.mlp, forward="fused", backward="xla")), x, params)
    text = capsys.readouterr().out
    assert text.strip() == str(returned)
    if not context.on_cuda_gpu():
        assert "this host runs the reference" in text and table_format.REFERENCE_DEVICE in text
    assert "stack 0: bfloat16 M×K 129×127 ->65+b relu ->17+b" in text
    assert "training step: fused" in text
    assert text.count("backend=cublaslt (") + text.count("backend=cublaslt ->") >= 2
    assert "layer 1 weight gradient" in text and "backend='xla' asked for" in text
    assert f"epilog_matmul calls in the traced program: {len(returned.calls)}" in text
    # Unaligned K (127 bf16 elements): the CUDA lowering pads the forward GEMM of layer 0.
    first = returned.calls[0]
    assert (first.gemm.k, first.lowering.way, first.lowering.padded) == (127, "kernel", (128, 72))


def test_a_matmul_outside_the_layers_is_explained_too():
    a, b = S((3, 64, 32), jnp.bfloat16), S((3, 32, 48), jnp.bfloat16)
    e = explanation.explanation(
        lambda a, b: jax_epilog.matmul(a, b, epilog="relu", backend="cublaslt"), (a, b))
    assert e.stacks == ()
    (call,) = e.calls
    g = call.gemm
    assert (g.epilog, g.batch, g.m, g.n, g.k) == (Epilog.RELU, 3, 64, 48, 32)
    assert g.requested == "cublaslt" and call.lowering.way == "kernel"


def step_for_cli(x, w):
    return jax_epilog.dense(x, w, activation="relu", forward="fused")


def test_command_line(capsys):
    assert explanation.main(["--fn", "test_explain:step_for_cli", "--args", "bf16[40,32]",
                         "bf16[32,16]"]) == 0
    text = capsys.readouterr().out
    assert "stack 0: bfloat16 M×K 40×32 ->16 relu" in text
    with pytest.raises(SystemExit):
        explanation.main(["--fn", "test_explain:step_for_cli", "--args", "bf16(40)"])


def test_explaining_leaves_no_trace_behind():
    """The planning context is gone after the call: a later trace plans with this host's."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(16, 16)), jnp.bfloat16)
    explanation.explanation(lambda x: jax_epilog.dense(x, w, activation="relu"), (x,))
    assert context.current().observe is None
    expected = jax.nn.relu(x.astype(jnp.float32) @ w.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(jax_epilog.dense(x, w, activation="relu"),
                                          np.float32), expected, rtol=2e-2, atol=2e-2)


def test_a_plain_path_matmul_is_reported_with_why(capsys):
    """A differentiable call whose step runs XLA's way leaves no epilog_matmul in the program:
    explain still reports it, each GEMM's backend and the entry that chose it."""
    x = jnp.ones((256, 784), jnp.bfloat16)
    w = jnp.ones((784, 100), jnp.bfloat16)
    b = jnp.ones((100,), jnp.bfloat16)
    returned = jax_epilog.explain(lambda x, w, b: jax_epilog.matmul(
        x, w, epilog="relu_bias", epilog_inputs={"bias": b}), x, w, b)
    text = capsys.readouterr().out
    (m,) = returned.matmuls
    assert m.params.epilog == Epilog.RELU_BIAS and m.choice.choice in ("plain", "fused")
    assert "matmul RELU_BIAS bfloat16 NN M×K×N 256×784×100: " in text
    for role in ("forward", "data gradient", "weight gradient"):
        assert f"{role}: " in m.choice.why
    if m.choice.choice == "plain":
        assert not returned.calls and "none: the stacks and matmul calls above run the plain" in text


def test_a_program_without_our_calls_says_so(capsys):
    returned = jax_epilog.explain(lambda x: x * 2, jnp.ones((4,)))
    assert not (returned.calls or returned.stacks or returned.matmuls)
    assert ("none: the program calls no jax_epilog.matmul, dense, mlp or swiglu"
            in capsys.readouterr().out)


# --- blocks: SwiGLU, block-scaled stacks, stored FP8 weights ---------------------------------

def swiglu_step(fp8):
    def loss(x, gate, up, down):
        return jax_epilog.swiglu(x, (gate, up), down, fp8=fp8).astype(jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2, 3))


def swiglu_args(rows, d, f, d_out):
    b = jnp.bfloat16
    return S((rows, d), b), S((d, f), b), S((d, f), b), S((f, d_out), b)


@pytest.mark.parametrize("fp8, rows, way, gemms, calls", [
    (None, 8192, "compute", ["bf16", "bf16"], 0),
    (Fp8(), 8192, "fp8", ["fp8", "fp8"], 6),
    (Fp8(scaling="block"), 8192, "fp8_block", ["fp8", "fp8"], 6),
    (Fp8(), 64, "compute", ["bf16", "bf16"], 0),  # too small for FP8 to pay
    (Fp8(), 4096, "compute", ["fp8", "bf16"], 0),  # FP8 only where both GEMMs would run it
])
def test_a_swiglu_block_is_explained_as_it_runs(fp8, rows, way, gemms, calls, capsys):
    e = jax_epilog.explain(swiglu_step(fp8), *swiglu_args(rows, 1024 if rows == 4096 else 2048,
                                                           4096 if rows == 4096 else 8192,
                                                           1024 if rows == 4096 else 2048))
    text = capsys.readouterr().out
    (block,) = e.blocks
    assert (block.kind, block.rows, block.way.choice) == ("swiglu", rows, way)
    assert [g.choice.choice for g in block.gemms] == gemms
    assert [g.name for g in block.gemms] == ["gate/up", "down"]
    assert len(e.calls) == calls  # the plan is what the block issued
    assert f"swiglu 0: bfloat16, {rows} rows" in text and block.way.why in text
    block_scaled = way == "fp8_block"
    assert all((c.block_scaling is not None) == block_scaled for c in e.calls)
    if block_scaled:
        assert "scales 1x128 × 128x128" in text and "scales 1x128 × 1x128" in text
    if not calls:
        assert "none: the blocks above run XLA's own GEMMs" in text


def test_a_block_scaled_stack_is_explained_layer_by_layer(capsys):
    """The 100-wide head is not a multiple of 128: that layer runs in the compute dtype, the
    first block-scaled (three GEMMs, each with its tiles)."""
    x, params = stack_args(8192, (2048, 8192, 100), biases=(True, False))
    e = jax_epilog.explain(step_of(functools.partial(
        jax_epilog.mlp, activation="relu", fp8=Fp8(scaling="block"))), x, params)
    text = capsys.readouterr().out
    (block,) = e.blocks
    assert block.kind == "block-scaled stack" and block.way.choice == "fp8_block"
    assert [(g.k, g.n, g.choice.choice) for g in block.gemms] == [(2048, 8192, "fp8"),
                                                                    (8192, 100, "bf16")]
    assert "not a multiple of 128" in block.gemms[1].choice.why
    scaled = [c for c in e.calls if c.block_scaling is not None]
    assert len(scaled) == 3 and "1 of 2 layers block-scaled" in text


@pytest.mark.parametrize("rows, way, calls", [(16, "weight_only", 0), (1024, "fp8", 3)])
def test_stored_fp8_weights_are_explained_with_their_way(rows, way, calls, capsys):
    rng = np.random.default_rng(0)
    kernels = {name: jnp.asarray(rng.standard_normal(shape) * 0.03, jnp.bfloat16)
               for name, shape in (("gate", (512, 1024)), ("up", (512, 1024)),
                                   ("down", (1024, 512)), ("head", (512, 256)))}
    stored = jax_epilog.quantize_params(kernels, include=lambda path, leaf: True)
    x = jnp.ones((rows, 512), jnp.bfloat16)
    e = jax_epilog.explain(lambda x, p: jax_epilog.swiglu(x, (p["gate"], p["up"]), p["down"]),
                           x, stored)
    (block,) = e.blocks
    assert (block.kind, block.way.choice, len(block.gemms)) == ("served swiglu", way, 3)
    assert all(g.choice == block.way for g in block.gemms) and len(e.calls) == calls
    assert "kernels stored in FP8, per tensor" in capsys.readouterr().out
    # a stack of one stored kernel and a 16-bit one: the 16-bit layer runs its own GEMM
    params = [(stored["down"], None), (kernels["head"], None)]
    e = jax_epilog.explain(lambda x, p: jax_epilog.mlp(x, p, activation="gelu"),
                           jnp.ones((rows, 1024), jnp.bfloat16), params)
    (block,) = e.blocks
    assert block.kind == "served stack"
    assert [g.choice.choice for g in block.gemms] == [way, "bf16"]
