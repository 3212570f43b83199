"""`python -m jax_epilog.tune` on the CPU: problem extraction by tracing (an `mlp` training step,
nested transforms, `--fn`), `--dry-run`, the no-GPU exit, and the whole tune flow with a faked
GPU (timing on the CPU backend, or an injected clock), including partial results."""

import inspect
import json
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_epilog
from jax_epilog.planning import context
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.layers import functional as layers
from jax_epilog.tools import tune
from jax_epilog.tools import command_line
from jax_epilog.tools import grid
from jax_epilog.tools import measurement
from jax_epilog.op.epilogs import Epilog

BF16 = jnp.bfloat16
MATMUL_HAS_BACKEND = "backend" in inspect.signature(jax_epilog.matmul).parameters


def stack_shapes(batch, widths, dtype=BF16):
    return grid.Workload("t", batch, tuple(widths), "relu", None, False).shapes(dtype)


def kinds(problems):
    return {(p.epilog, p.transpose_a, p.transpose_b, p.batch * p.m, p.n, p.k) for p in problems}


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """JAX's CPU backend posing as a GPU, the user table in tmp_path, and a `matmul` that
    accepts `backend=` (ignored on the CPU) where the core does not take it yet."""
    monkeypatch.setattr(decisions, "device_identity", lambda: ("Fake GPU", 1))
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "decisions.json"))
    if not MATMUL_HAS_BACKEND:
        monkeypatch.setattr(measurement, "matmul",
                            lambda *a, backend="auto", **kw: jax_epilog.matmul(*a, **kw))
    decisions.clear_cache()
    yield tmp_path / "decisions.json"
    decisions.clear_cache()


# --- problem extraction ----------------------------------------------------------------------

def test_arg_specs():
    assert command_line.parse_arg_spec("bf16[256,784]") == jax.ShapeDtypeStruct((256, 784), BF16)
    assert command_line.parse_arg_spec(" float32[ 3, 4 ] ") == jax.ShapeDtypeStruct((3, 4), jnp.float32)
    assert command_line.parse_arg_spec("f32[]").shape == ()
    for bad in ("bf16(3,4)", "bf16[3,x]", "nonsense[3]"):
        with pytest.raises(ValueError, match="--args"):
            command_line.parse_arg_spec(bad)


def test_training_step_of_an_mlp_is_traced_into_its_problems():
    params, x, target = stack_shapes(32, (16, 24, 8))
    step = grid.step_fn(grid.Workload("t", 32, (16, 24, 8), "relu", None, False),
                        grid.epilog_stack)
    found = kinds(measurement.problems_of(step, params, x, target))
    # forward, training form: the ReLU layer keeps its mask; the head has a bias only
    assert ("RELU_AUX_BIAS", False, False, 32, 24, 16) in found
    assert ("BIAS", False, False, 32, 8, 24) in found
    # backward: weight gradients read the layer inputs transposed (K = the batch) ...
    assert {(m, n, k) for e, ta, tb, m, n, k in found if ta} == {(24, 8, 32), (16, 24, 32)}
    # ... and the data gradient reads the head's kernel transposed
    assert any(tb and (m, n, k) == (32, 24, 8) for e, ta, tb, m, n, k in found)


def test_inference_forward_uses_the_epilogs_without_aux():
    params, x, target = stack_shapes(32, (16, 24, 8))
    w = grid.Workload("t", 32, (16, 24, 8), "relu", None, False)
    found = kinds(measurement.problems_of(grid.forward_fn(w, grid.epilog_stack), params, x, target))
    assert found == {("RELU_BIAS", False, False, 32, 24, 16), ("BIAS", False, False, 32, 8, 24)}


def test_nested_jit_scan_remat_and_cond_are_walked():
    w = jnp.zeros((24, 24), BF16)
    b = jnp.zeros((24,), BF16)

    @jax.jit
    def f(x):
        def body(h, _):
            h = jax.checkpoint(lambda h: jax_epilog.dense(h, w, b, activation="relu"))(h)
            return jax.lax.cond(h.sum() > 0, lambda h: h, lambda h: 2 * h, h), None
        return jnp.sum(jax.lax.scan(body, x, None, length=2)[0].astype(jnp.float32))

    found = measurement.problems_of(jax.grad(f), jnp.zeros((40, 24), BF16))
    assert ("RELU_AUX_BIAS", False, False, 40, 24, 24) in kinds(found)
    assert any(p.transpose_a for p in found)  # the weight gradient, inside the scan's backward


def test_leading_dims_and_batched_operands():
    x = jax.ShapeDtypeStruct((3, 5, 16), BF16)
    shared = measurement.problems_of(lambda a, b: jax_epilog.matmul(a, b),
                              x, jax.ShapeDtypeStruct((16, 8), BF16))
    assert [(p.batch, p.m, p.n, p.k, p.b_batch) for p in shared] == [(1, 15, 8, 16, 1)]
    batched = measurement.problems_of(lambda a, b: jax_epilog.matmul(a, b),
                               x, jax.ShapeDtypeStruct((3, 16, 8), BF16))
    assert [(p.batch, p.m, p.n, p.k, p.b_batch) for p in batched] == [(3, 5, 8, 16, 3)]
    assert batched[0].table_key[4] == 15  # the table is keyed by batch * M


@pytest.mark.skipif(not MATMUL_HAS_BACKEND, reason="matmul has no backend= yet")
def test_calls_with_a_forced_backend_are_not_tuned():
    a, b = jnp.zeros((8, 16), BF16), jnp.zeros((16, 8), BF16)
    assert measurement.problems_of(lambda a, b: jax_epilog.matmul(a, b, backend="xla"), a, b) == []
    assert len(measurement.problems_of(lambda a, b: jax_epilog.matmul(a, b, backend="auto"), a, b)) == 1


def test_distinct_keeps_one_problem_per_table_key_largest_first():
    small = measurement.Problem("RELU_BIAS", "bfloat16", False, False, 1, 8, 8, 8)
    big = measurement.Problem("RELU_BIAS", "bfloat16", False, False, 1, 64, 64, 64)
    folded = small._replace(batch=2, m=4)  # 2 x 4 rows: the same table key as `small`
    assert measurement.distinct([small, big, folded, small]) == [big, small]


def network(x, params):
    """A user's function: a dense layer, then an mlp, on 3-D inputs (leading dims 4 x 8)."""
    (w0, b0), *rest = params
    h = jax_epilog.dense(x, w0, b0, activation="gelu")
    return jax_epilog.mlp(h, rest, activation="relu")


def network_args():
    widths = (16, 24, 32, 8)
    params = tuple((jax.ShapeDtypeStruct((k, n), BF16), jax.ShapeDtypeStruct((n,), BF16))
                   for k, n in zip(widths, widths[1:]))
    return jax.ShapeDtypeStruct((4, 8, 16), BF16), params


def network_step(x, params):
    return jax.grad(lambda p: network(x, p).astype(jnp.float32).sum())(params)


DENSE_KEY = table_format.make_stack_key("bfloat16", 32, (16, 24), ("gelu",), (True,), "step")
MLP_KEY = table_format.make_stack_key("bfloat16", 32, (24, 32, 8), ("relu", None), (True, True),
                                  "step")


def test_stacks_of_a_traced_function_with_a_dense_and_an_mlp():
    x, params = network_args()
    assert measurement.stacks_of(network_step, x, params) == [DENSE_KEY, MLP_KEY]  # rows = 4 x 8
    assert measurement.stacks_of(network, x, params) == [DENSE_KEY._replace(mode="forward"),
                                                  MLP_KEY._replace(mode="forward")]
    assert measurement.stacks_of(network_step, x, params) == [DENSE_KEY, MLP_KEY]  # traced again
    jitted = jax.jit(network_step)
    jax.make_jaxpr(jitted)(x, params)  # a trace cached by jit would skip the layers' Python
    assert measurement.stacks_of(jitted, x, params) == [DENSE_KEY, MLP_KEY]
    # jitted, then differentiated (jax versions differ on whether the primal is traced too)
    found = set(measurement.stacks_of(jax.grad(lambda p: jax.jit(network)(x, p).sum().astype(
        jnp.float32)), params))
    assert {DENSE_KEY, MLP_KEY} <= found


def test_stacks_with_a_forced_backend_are_not_collected():
    x, params = network_args()
    forced = measurement.stacks_of(lambda x, p: jax_epilog.mlp(x, p, forward="xla"), x, params)
    assert forced == []


def test_grid_stack_keys_normalise_like_the_layers():
    names = {name: (fn, args) for name, fn, args in grid.grid_functions(["M3"])}
    fn, args = names["M3 step"]
    assert measurement.stacks_of(fn, *args) == [table_format.make_stack_key(
        "bfloat16", 256, (784, 100, 100, 10), ("relu", "relu", None), (True,) * 3, "step")]


@pytest.mark.parametrize("mode", ["forward", "step"])
def test_stack_candidates_compute_the_same(mode):
    key = MLP_KEY._replace(mode=mode)
    operands = measurement.stack_operands(key)
    plain = measurement.stack_fn(key, "plain")(*operands)
    fused = measurement.stack_fn(key, "fused")(*operands)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(fused)):
        assert a.shape == b.shape
        assert jnp.allclose(a.astype(jnp.float32), b.astype(jnp.float32), atol=0.1, rtol=0.05)
    assert len(jax.tree.leaves(plain)) == (1 if mode == "forward" else 1 + 1 + 4)


def test_stack_step_is_the_value_and_grad_of_the_shared_loss():
    key = MLP_KEY._replace(mode="step")
    x, params, target = measurement.stack_operands(key)
    assert target.dtype == jnp.float32 and target.shape == (key.rows, key.widths[-1])
    stack = measurement.stack_of(key)
    loss, (dx, dparams) = measurement.stack_fn(key, "plain")(x, params, target)
    want_loss, (want_dx, want_dparams) = jax.value_and_grad(
        lambda x, p: grid.squared_error(layers.plain_expression(stack, x, p), target),
        argnums=(0, 1))(x, params)
    assert loss.shape == () and jnp.allclose(loss, want_loss)
    for a, b in zip(jax.tree.leaves((dx, dparams)), jax.tree.leaves((want_dx, want_dparams))):
        assert jnp.array_equal(a, b)
    # the grid's steps (and never_slower's) use the same loss
    w = grid.grid_workloads(["G7"])[0]
    step_source = inspect.getsource(grid.step_fn)
    assert "squared_error(" in step_source and w.grad_x


def test_fused_gemm_backends_follow_the_gemm_entries(fake_gpu):
    step = DENSE_KEY._replace(mode="step")
    assert measurement.fused_gemm_backends(step) == ["xla"] * 3  # no entries: XLA
    rows, (k, n) = step.rows, step.widths
    entry = table_format.make_entry("GELU_AUX_BIAS", step.dtype, False, False, rows, n, k,
                                {"cublaslt": 1e-5, "xla": 1e-3})
    with context.planning(context.measuring(table_format.Table("Fake GPU", 1, (entry,)))):
        assert measurement.fused_gemm_backends(step) == ["cublaslt", "xla", "xla"]
        assert measurement.fused_gemm_backends(step._replace(mode="forward")) == ["xla"]


def test_a_fused_stack_without_cublaslt_gemms_is_recorded_plain(fake_gpu, capsys):
    # every GEMM chose XLA: fused (custom VJP around XLA's GEMMs) measured faster, plain kept
    table = tune.tune([DENSE_KEY], measure=lambda *a, **k: 1e-5,
                      measure_stack=lambda key, c, **k: {"fused": 0.5, "plain": 1.0}[c],
                      progress=False)
    (entry,) = table.stacks
    assert entry.choice == "plain"
    assert entry.seconds == {"fused": 0.5, "plain": 1.0, table_format.FUSED_CUBLASLT_GEMMS: 0}
    assert "(fused runs no cuBLASLt GEMM)" in capsys.readouterr().out
    decisions.clear_cache()  # and so it reads back: the choice is re-derived from what is stored
    assert decisions.stack_decision(DENSE_KEY).choice == "plain"


PROBLEMS = [
    measurement.Problem("DEFAULT", "bfloat16", False, False, 1, 24, 16, 8),
    measurement.Problem("RELU_AUX_BIAS", "bfloat16", False, False, 1, 24, 130, 8),
    measurement.Problem("DRELU_BGRAD", "bfloat16", False, True, 1, 24, 130, 8),
    measurement.Problem("DGELU_BGRAD", "float16", False, True, 1, 24, 20, 8),
    measurement.Problem("BGRADB", "float32", True, False, 1, 12, 20, 40, allow_tf32=True),
    measurement.Problem("BIAS", "float32", False, False, 3, 5, 8, 16, 3, 3),
    measurement.Problem("GELU_BIAS", "bfloat16", True, False, 2, 6, 8, 16),
    # FP8 operands (SPEC §5): unit scales, the result type and amax carried through
    measurement.Problem("RELU_AUX_BIAS", "float8_e4m3fn", False, True, 1, 16, 32, 32,
                 result_dtype="bfloat16"),
    measurement.Problem("DRELU_BGRAD", "float8_e4m3fn", False, True, 1, 16, 32, 32,
                 b_dtype="float8_e5m2", result_dtype="bfloat16"),
    measurement.Problem("BIAS", "float8_e5m2", False, True, 1, 16, 32, 32, b_dtype="float8_e4m3fn",
                 result_dtype="float8_e4m3fn", result_amax=True),
]


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_timed_operands_make_exactly_the_traced_call(problem, fake_gpu):
    """`random_operands` + `call_fn` rebuild the normalised problem they were made from."""
    operands = measurement.random_operands(problem)
    assert measurement.problems_of(measurement.call_fn(problem, "auto"), *operands) == [problem]
    if problem.epilog == "DRELU_BGRAD":
        assert operands[2]["relu_aux"].dtype == jnp.uint8


def test_grid_covers_every_row_and_network():
    names = [name for name, _, _ in grid.grid_functions()]
    for row in [*grid.GRID, *grid.NETWORKS, "G4 gelu", "G5 gelu"]:
        assert f"{row} forward" in names and f"{row} step" in names
    with pytest.raises(ValueError, match="unknown ids"):
        grid.grid_functions(["G9"])


# --- the command line ----------------------------------------------------------------------

def test_dry_run_lists_the_grid_problems_and_stacks(capsys):
    assert tune.main(["--grid", "--rows", "G7,M3", "--dry-run"]) == 0
    header, *out = capsys.readouterr().out.splitlines()
    assert header == measurement.DRY_RUN_HEADER and "M×K×N" in header  # as the README's tables
    problems, stacks = (int(n) for n in re.fullmatch(r"(\d+) distinct problems, (\d+) stacks",
                                                     out[-1]).groups())
    assert problems + stacks == len(out) - 1 and stacks == 4
    assert "RELU_BIAS bfloat16 NN M×K×N 256×784×100" in out  # G7's inference forward (M×K×N)
    assert "RELU_AUX_BIAS bfloat16 NN M×K×N 256×784×100" in out  # its training forward
    assert out[problems:-1] == [  # largest first
        "stack step bfloat16 M×K 256×784 →100+b relu →100+b relu →10+b",
        "stack step bfloat16 M×K 256×784 →100+b relu",
        "stack forward bfloat16 M×K 256×784 →100+b relu →100+b relu →10+b",
        "stack forward bfloat16 M×K 256×784 →100+b relu"]


def test_dry_run_of_a_function(capsys):
    assert tune.main(["--fn", "jax_epilog:dense", "--args", "bf16[64,32]",
                      "bf16[32,16]", "bf16[16]", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines() == [measurement.DRY_RUN_HEADER,
                                                    "BIAS bfloat16 NN M×K×N 64×32×16",
                                                    "stack forward bfloat16 M×K 64×32 →16+b",
                                                    "1 distinct problems, 1 stacks"]


def test_without_a_gpu_timing_exits_2_with_one_line(capsys, monkeypatch):
    monkeypatch.setattr(decisions, "device_identity", lambda: (None, None))
    assert tune.main(["--grid", "--rows", "G7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--fn", "nomodule"], "module:callable"),
    (["--fn", "jax_epilog:__version__"], "not callable"),
    (["--grid", "--args", "bf16[2]"], "--args goes with --fn"),
    (["--grid", "--rows", "G8"], "unknown ids"),
    ([], "required"),
])
def test_bad_command_lines(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# --- the whole flow with a faked GPU ------------------------------------------------------------

def two_layer_step():
    w = grid.Workload("t", 32, (16, 24, 8), "relu", None, False)
    return grid.step_fn(w, grid.epilog_stack), w.shapes()


@pytest.mark.slow
def test_tune_times_every_problem_on_the_cpu_and_writes_the_user_table(fake_gpu, capsys):
    fn, args = two_layer_step()
    table = tune.tune([(fn, args)], seconds=0.005, progress=False)
    expected = measurement.distinct(measurement.problems_of(fn, *args))
    assert len(table.entries) == len(expected) and table.device == "Fake GPU"
    for e in table.entries:
        assert e.seconds["cublaslt"] > 0 and e.seconds["xla"] > 0
    assert [e.key for e in table.stacks] == measurement.stacks_of(fn, *args)  # the one step stack
    out = capsys.readouterr().out
    total = len(expected) + 1
    assert f"[{total}/{total}] stack step" in out
    assert f"tuned {len(expected)} problems and 1 stacks" in out
    data = json.loads(fake_gpu.read_text())
    assert len(data["tables"][0]["entries"]) == len(expected)
    # `auto` reads what was written
    p = expected[0]
    assert decisions.choose(Epilog[p.epilog], p.dtype, p.batch, p.m, p.n, p.k, p.transpose_a,
                           p.transpose_b) == table.entries[0].choice


def test_tune_times_the_stacks_of_a_function_after_its_gemms(fake_gpu, capsys):
    x, params = network_args()
    seen = []

    def measure_stack(key, candidate, seconds):
        seen.append((key, candidate, context.current()))
        if key == MLP_KEY and candidate == "fused":
            raise RuntimeError("out of memory")
        return {"fused": 0.5, "plain": 1.0}[candidate]

    # cuBLASLt wins every GEMM, so the fused candidates run it (else "plain" is recorded)
    table = tune.tune([(network_step, (x, params))],
                      measure=lambda p, backend, **k: 1e-5 if backend == "cublaslt" else 1e-3,
                      measure_stack=measure_stack, progress=False)
    assert {(e.key, e.choice) for e in table.stacks} == {(DENSE_KEY, "fused"),
                                                        (MLP_KEY, "plain")}
    # timed while the GEMM entries of this run decide and no stack entry does
    def gemm_source(ctx, e):
        return ctx.gemm_table(Epilog[e.epilog], e.dtype, 1, e.m, e.n, e.k, e.transpose_a,
                              e.transpose_b).source

    assert all(ctx.stack_table(key) is None and gemm_source(ctx, e) == "measuring"
               for key, _, ctx in seen for e in table.entries)
    assert all(gemm_source(context.current(), e) != "measuring" for e in table.entries)
    assert "out of memory" in capsys.readouterr().err
    decisions.clear_cache()
    stored = table_format.load_tables(fake_gpu)[0]
    assert sorted(stored.stacks, key=lambda e: e.key.order) == sorted(
        table.stacks, key=lambda e: e.key.order)
    assert {e.key for e in stored.entries} == {e.key for e in table.entries}
    decision = decisions.stack_decision(DENSE_KEY)
    assert decision.choice == "fused" and decision.source == "user"


def test_stacks_are_timed_for_real_on_the_cpu(fake_gpu):
    table = tune.tune([DENSE_KEY, DENSE_KEY._replace(mode="forward")], seconds=0.005,
                      progress=False)
    assert len(table.stacks) == 2
    for e in table.stacks:
        assert e.seconds["fused"] > 0 and e.seconds["plain"] > 0


def test_injected_clock_decides_and_a_failure_costs_one_candidate(fake_gpu, tmp_path, capsys):
    problems = [measurement.Problem("RELU_BIAS", "bfloat16", False, False, 1, 64, 64, 64),
                measurement.Problem("DRELU_BGRAD", "bfloat16", False, True, 1, 64, 64, 64),
                measurement.Problem("BGRADB", "bfloat16", True, False, 1, 64, 64, 64)]

    def fake_timer(p, backend, seconds):
        if p.epilog == "BGRADB" and backend == "cublaslt":
            raise RuntimeError("no kernel")
        return {"RELU_BIAS": {"cublaslt": 1.0, "xla": 0.99},
                "DRELU_BGRAD": {"cublaslt": 0.5, "xla": 1.0},
                "BGRADB": {"xla": 1.0}}[p.epilog][backend]

    output = tmp_path / "out" / "table.json"
    table = tune.tune(problems, output=output, measure=fake_timer, progress=False)
    entries = {e.epilog: e for e in table.entries}
    assert {name: e.choice for name, e in entries.items()} == {
        "RELU_BIAS": "xla", "DRELU_BGRAD": "cublaslt", "BGRADB": "xla"}
    assert entries["BGRADB"].seconds == {"cublaslt": None, "xla": 1.0}
    assert "no kernel" in capsys.readouterr().err
    assert len(table_format.load_tables(output)[0].entries) == 3
    assert not fake_gpu.exists()  # --output, not the user table


def test_an_interrupted_run_keeps_what_it_measured(fake_gpu):
    problems = [measurement.Problem("DEFAULT", "bfloat16", False, False, 1, s, s, s)
                for s in (256, 128, 64)]

    def fake_timer(p, backend, seconds):
        if p.m == 64:
            raise KeyboardInterrupt
        return 1.0

    with pytest.raises(KeyboardInterrupt):
        tune.tune(problems, measure=fake_timer, progress=False)
    entries = table_format.load_tables(fake_gpu)[0].entries
    assert sorted(e.m for e in entries) == [128, 256]


def test_progress_without_tqdm_prints_lines(fake_gpu, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    p = measurement.Problem("DEFAULT", "bfloat16", False, False, 1, 8, 8, 8)
    tune.tune([p], measure=lambda *a, **k: 1e-5, progress=True)
    assert "[1/1] DEFAULT bfloat16 NN M×K×N 8×8×8: cublaslt 10.0 us, xla 10.0 us -> xla" in \
        capsys.readouterr().out


def test_tune_refuses_to_time_without_a_gpu(monkeypatch):
    monkeypatch.setattr(decisions, "device_identity", lambda: (None, None))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        tune.tune([], measure=lambda *a, **k: 1.0)


def test_bare_callables_are_refused(fake_gpu):
    with pytest.raises(TypeError, match=r"\(fn, args\)"):
        tune.tune([jax_epilog.dense], measure=lambda *a, **k: 1.0)


# --- on a GPU (the GPU suite) ------------------------------------------------------------------

GPU_PROBLEMS = [measurement.Problem("RELU_BIAS", "bfloat16", False, False, 1, 512, 256, 128),
                measurement.Problem("DRELU_BGRAD", "bfloat16", False, True, 1, 512, 128, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=str)
def test_each_candidate_runs_its_backend_on_the_gpu(problem):
    operands = measurement.random_operands(problem)
    for backend, kernel in (("cublaslt", True), ("xla", False)):
        text = jax.jit(measurement.call_fn(problem, backend)).lower(*operands).compile().as_text()
        assert ('custom_call_target="jax_epilog_matmul"' in text) == kernel, backend


@pytest.mark.gpu
def test_tune_times_both_backends_on_the_gpu(tmp_path):
    table = tune.tune(GPU_PROBLEMS, output=tmp_path / "table.json", seconds=0.02,
                      progress=False)
    assert table.device == jax.devices("cuda")[0].device_kind
    assert len(table.entries) == len(GPU_PROBLEMS)
    for e in table.entries:
        assert e.seconds["cublaslt"] > 0 and e.seconds["xla"] > 0


@pytest.mark.gpu
def test_stack_candidates_on_the_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    key = table_format.make_stack_key("bfloat16", 512, (256, 128), ("relu",), (True,), "step")
    device, version = decisions.device_identity()
    gemm = table_format.make_entry("RELU_AUX_BIAS", "bfloat16", False, False, 512, 128, 256,
                               {"cublaslt": 0.5, "xla": 1.0})
    operands = measurement.stack_operands(key)
    with context.planning(context.measuring(table_format.Table(device, version, (gemm,)))):
        for candidate, kernel in (("fused", True), ("plain", False)):
            text = jax.jit(measurement.stack_fn(key, candidate)).lower(*operands).compile().as_text()
            assert ('custom_call_target="jax_epilog_matmul"' in text) == kernel, candidate
            assert measurement.time_stack(key, candidate, seconds=0.02) > 0
