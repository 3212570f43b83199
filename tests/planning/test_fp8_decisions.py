"""Measured FP8 decisions per stack: a training-step entry's "fp8" time (tune --fp8) decides
`Fp8(layers="auto")` for the whole stack, the rule `fp8_pays` where no entry has one;
`layers="all"` is never overridden; tables with FP8 times round-trip; tune times the FP8
candidate on the CPU (the reference path), on a warm state under delayed scaling. CPU only: the
GPU is faked."""

import json
import time

import jax
import jax.numpy as jnp
import pytest

import jax_epilog
from jax_epilog import Fp8
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.tools import explain as explanation
from jax_epilog.planning import context, stack_plan
from jax_epilog.tools import tune
from jax_epilog.tools import measurement
from test_decisions import H200, VERSION, tables  # noqa: F401 (tables: a fixture)

S = jax.ShapeDtypeStruct
# M1's step: 4 ReLU layers 4096 wide; the rule makes every layer FP8 (2.2e12 FLOPs a GEMM)
M1 = ((4096,) * 5, ("relu",) * 3 + (None,), (True,) * 4)
# a small step the rule keeps bf16 (2·127·48·64 FLOPs), widths multiples of 16
SMALL = ((48, 64, 32), ("gelu", None), (True, False))


@pytest.fixture
def h200(tables):
    """test_decisions's `tables`: shipped tables in tmp_path/tables, the user table beside them,
    this host an H200."""
    return tables
    decisions.clear_cache()


def shipped(tmp_path):
    return tmp_path / "tables" / "nvidia-h200.json"


def key(rows, shape, mode="step"):
    return table_format.make_stack_key("bfloat16", rows, *shape, mode)


def entry(rows, shape, fp8, fused=1.0, plain=1.1, mode="step"):
    times = {"fused": fused, "plain": plain, table_format.FP8: fp8, table_format.FP8_SCALING: "current"}
    return table_format.make_stack_entry(key(rows, shape, mode), times)


def write(path, stacks):
    decisions.merge_into(path, H200, VERSION, [], stacks)


def planned(rows, shape, config=Fp8(), on_gpu=True):
    widths, activations, biases = shape
    stack = stack_plan.Stack(tuple(stack_plan.Layer(a, b) for a, b in zip(activations, biases)), None,
                       "auto", "auto")
    ctx = context.default_context()._replace(tables_decide=lambda: on_gpu)
    return stack_plan.plan_stack(ctx, stack, rows, widths, "bfloat16", config)


# --- the decision from the times ----------------------------------------------------------

@pytest.mark.parametrize("seconds, expected", [
    ({"fused": 1.0, "plain": 1.2, "fp8": 0.97}, "fp8"),  # beats the faster by > 2%
    ({"fused": 1.2, "plain": 1.0, "fp8": 0.99}, "bf16"),  # within the margin of plain
    ({"fused": 1.0, "plain": None, "fp8": 0.5}, "fp8"),  # plain failed: fused is the bf16 time
    ({"fused": 1.0, "plain": 1.0, "fp8": None}, "bf16"),  # FP8 failed
    ({"fused": 1.0, "plain": 1.0}, None),  # not measured in FP8
    ({"fp8": 0.5}, None),  # no bf16 time to beat
    ({"fused": None, "plain": None, "fp8": 0.5}, None),
])
def test_fp8_must_beat_the_faster_bf16_step_by_the_margin(seconds, expected):
    assert table_format.decide_fp8_from_times(seconds) == expected


# --- plan: the entry decides every layer, the rule without one -----------------------------

def test_a_winning_entry_makes_every_layer_fp8_and_says_which_entry(h200):
    assert planned(127, SMALL).quantized == (False, False)  # the rule: too small
    write(shipped(h200), [entry(128, SMALL, fp8=0.5)])
    sp = planned(127, SMALL)
    assert sp.quantized == (True, True) and sp.step.choice == "fp8"
    assert sp.inference.choice == "fp8"  # inference follows the step's entry
    assert {g.operand_dtype for g in sp.forward_gemms} == {"float8_e4m3fn"}
    why = sp.layers[0].why
    assert "won" in why and "stack entry (the table shipped for this GPU" in why
    assert "stack step bfloat16 M×K 128×48" in why and "fp8 500000.0 us" in why


def test_a_losing_entry_keeps_every_layer_bf16_where_the_rule_says_fp8(h200):
    assert planned(65536, M1).quantized == (True,) * 4  # the rule: large enough
    write(shipped(h200), [entry(65536, M1, fp8=1.0, fused=1.0, plain=1.2)])
    sp = planned(65536, M1)
    assert sp.quantized == (False,) * 4 and sp.step.choice != "fp8"
    assert all("did not win" in lp.why and "stack entry" in lp.why for lp in sp.layers)


def test_without_an_fp8_time_nearby_the_rule_decides(h200):
    write(shipped(h200), [
        entry(65536, M1, fp8=1.0),  # 4x the rows below: not nearby
        table_format.make_stack_entry(key(16384, M1), {"fused": 1.0, "plain": 1.1}),  # no FP8
        entry(16384, M1, fp8=1.0, mode="forward"),  # not a step
        entry(16384, (M1[0], ("gelu",) * 3 + (None,), M1[2]), fp8=1.0)])  # another stack
    sp = planned(16384, M1)
    assert sp.quantized == (True,) * 4
    assert all("FP8_MIN_FLOPS" in lp.why for lp in sp.layers)


def test_layers_all_is_never_overridden_and_off_the_gpu_the_rule_decides(h200):
    write(shipped(h200), [entry(65536, M1, fp8=2.0), entry(128, SMALL, fp8=0.5)])
    sp = planned(65536, M1, Fp8(layers="all"))
    assert sp.quantized == (True,) * 4 and sp.layers[0].why == 'Fp8(layers="all")'
    assert planned(65536, M1, on_gpu=False).quantized == (True,) * 4
    assert planned(128, SMALL, on_gpu=False).quantized == (False, False)
    assert planned(128, SMALL, config=None).quantized == (False, False)


def test_the_users_entry_decides_before_the_shipped_one(h200):
    write(shipped(h200), [entry(65536, M1, fp8=0.5)])
    assert planned(65536, M1).quantized == (True,) * 4
    write(h200 / "user.json", [entry(50000, M1, fp8=2.0)])  # nearby, in the user's table
    assert planned(65536, M1).quantized == (False,) * 4


def test_explain_prints_the_entry_that_chose_fp8(h200):
    write(shipped(h200), [entry(128, SMALL, fp8=0.5)])
    params = ((S((48, 64), jnp.bfloat16), S((64,), jnp.bfloat16)),
              (S((64, 32), jnp.bfloat16), None))

    def step(x, params):
        return jax.grad(lambda x, p: jax_epilog.mlp(x, p, activation="gelu", fp8=True)
                        .astype(jnp.float32).sum(), argnums=(0, 1))(x, params)
    e = explanation.explanation(step, (S((128, 48), jnp.bfloat16), params))
    (sp,) = e.stacks
    assert sp.quantized == (True, True)
    text = str(e)
    assert "layer 0: FP8: FP8 in every layer (current scaling) won against the faster bf16 " \
        "step by 2%: stack entry (the table shipped for this GPU" in text
    assert "fp8 500000.0 us" in text


# --- the table file -------------------------------------------------------------------------

def test_fp8_times_round_trip_and_old_tables_load_unchanged(h200):
    path = h200 / "table.json"
    stacks = [entry(128, SMALL, fp8=0.5), entry(65536, M1, fp8=None)]
    write(path, stacks)
    data = json.loads(path.read_text())
    assert data["format"] == table_format.FORMAT
    (table,) = table_format.read_tables(path)
    assert sorted(table.stacks, key=lambda e: e.key.order) == \
        sorted(stacks, key=lambda e: e.key.order)
    # a table written before FP8 times existed: the same entries, no FP8 decision
    old = {"format": "jax_epilog.decisions/2", "tables": [{
        "device": H200, "cublaslt_version": VERSION, "entries": [], "stacks": [
            {**key(128, SMALL)._asdict(), "seconds": {"fused": 0.5, "plain": 1.0},
             "choice": "fused"}]}]}
    shipped(h200).write_text(json.dumps(old))
    decisions.clear_cache()
    assert decisions.stack_decision(key(128, SMALL)).choice == "fused"
    assert decisions.fp8_stack_decision(key(128, SMALL)) is None
    assert planned(128, SMALL).quantized == (False, False)


def test_a_run_of_fp8_only_keeps_the_other_candidates_times(h200):
    path = h200 / "table.json"
    write(path, [table_format.make_stack_entry(key(128, SMALL), {"fused": 0.5, "plain": 1.0})])
    write(path, [table_format.make_stack_entry(key(128, SMALL), {"fp8": 0.25})])
    write(path, [table_format.make_stack_entry(key(256, SMALL), {"fp8": 0.25})])  # nothing earlier
    stacks = {e.key.rows: e for e in table_format.read_tables(path)[0].stacks}
    assert stacks[128].seconds == {"fused": 0.5, "plain": 1.0, "fp8": 0.25}
    assert stacks[128].choice == "fused"
    assert stacks[256].choice is None  # decides neither fused/plain ...
    assert table_format.decide_fp8_from_times(stacks[256].seconds) is None  # ... nor FP8


def test_an_fp8_only_entry_leaves_the_bf16_path_to_the_next_entry(h200):
    write(shipped(h200), [table_format.make_stack_entry(key(256, SMALL), {"fused": 0.5,
                                                                       "plain": 1.0})])
    write(h200 / "user.json", [table_format.make_stack_entry(key(128, SMALL), {"fp8": 0.25})])
    decision = decisions.stack_decision(key(128, SMALL))
    assert decision.source == "shipped" and decision.choice == "fused"


# --- tune times the FP8 candidate -----------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """JAX's CPU backend posing as a GPU, the user table in tmp_path."""
    monkeypatch.setattr(decisions, "device_identity", lambda: ("Fake GPU", 1))
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "decisions.json"))
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    decisions.clear_cache()
    yield tmp_path / "decisions.json"
    decisions.clear_cache()


TINY = key(40, SMALL)
UNALIGNED = key(40, ((48, 40), ("relu",), (True,)))  # N = 40


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_candidate_is_the_step_in_fp8(scaling, monkeypatch):
    monkeypatch.setattr(measurement, "FP8_CANDIDATE", Fp8(layers="all", scaling=scaling))
    x, params, target = measurement.stack_operands(TINY)
    state = (Fp8(scaling=scaling).init_state(2),) if scaling == "delayed" else ()
    loss, (dx, dparams, *next_state) = measurement.stack_fn(TINY, "fp8")(x, params, target, *state)
    assert len(next_state) == len(state)
    want, (want_dx, want_dparams) = measurement.stack_fn(TINY, "plain")(x, params, target)
    assert jnp.allclose(loss, want, rtol=0.1)
    assert jax.tree.structure(dparams) == jax.tree.structure(want_dparams)
    assert dx.shape == want_dx.shape and dx.dtype == want_dx.dtype
    with pytest.raises(ValueError, match="multiples of 16"):
        measurement.stack_fn(UNALIGNED, "fp8")
    with pytest.raises(ValueError, match="training steps"):
        measurement.stack_fn(TINY._replace(mode="forward"), "fp8")


def test_tune_times_fp8_on_the_cpu_and_records_it(fake_gpu, capsys):
    table = tune.tune([TINY, TINY._replace(mode="forward"), UNALIGNED], seconds=0.005,
                      progress=False, fp8=True)
    stacks = {e.key: e for e in table.stacks}
    timed = stacks[TINY].seconds
    assert timed["fp8"] > 0 and timed["fused"] > 0 and timed["plain"] > 0
    # Fp8()'s defaults: a config that keeps amax histories is delayed scaling on a warm state
    keeps_state = measurement.fp8_keeps_state(measurement.FP8_CANDIDATE)
    assert timed[table_format.FP8_SCALING] == ("delayed" if keeps_state else "current")
    assert "fp8" not in stacks[TINY._replace(mode="forward")].seconds
    assert "fp8" not in stacks[UNALIGNED].seconds
    out = capsys.readouterr().out
    assert "fp8 timed 1, won" in out
    stored = {e.key: e for e in table_format.load_tables(fake_gpu)[0].stacks}
    assert stored[TINY].seconds == timed


def test_delayed_scaling_is_timed_on_a_warm_state(fake_gpu, monkeypatch):
    monkeypatch.setattr(measurement, "FP8_CANDIDATE", Fp8(layers="all", scaling="delayed"))
    step = jax.jit(measurement.stack_fn(TINY, "fp8"))
    x, params, target = measurement.stack_operands(TINY)
    cold = Fp8(scaling="delayed").init_state(2)
    _, (_, _, warm) = step(x, params, target, cold)
    assert all(float(h.input[0]) > 0 for h in warm)  # the untimed step recorded the amaxes
    timed_states = []
    time_calls = measurement.timing.time_calls

    def spy(fn, sets, **kwargs):
        timed_states.extend(s[-1] for s in sets)
        return time_calls(fn, sets, **kwargs)
    monkeypatch.setattr(measurement.timing, "time_calls", spy)
    table = tune.tune([TINY], seconds=0.005, progress=False, fp8="only")
    assert timed_states and all(jnp.array_equal(a, b) for state in timed_states
                                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(warm)))
    (e,) = table.stacks
    assert e.seconds[table_format.FP8] > 0 and e.seconds[table_format.FP8_SCALING] == "delayed"
    assert set(e.seconds) == {table_format.FP8, table_format.FP8_SCALING}


def test_fp8_only_merges_into_the_table_and_decides(fake_gpu):
    times = {"fused": 1.0, "plain": 1.2, "fp8": 0.5}
    tune.tune([TINY], measure_stack=lambda k, c, **kw: times[c], progress=False)
    assert decisions.fp8_stack_decision(TINY) is None
    table = tune.tune([TINY, UNALIGNED], measure_stack=lambda k, c, **kw: times[c],
                      progress=False, fp8="only")
    assert [e.key for e in table.stacks] == [TINY]  # only what FP8 can be timed for
    decisions.clear_cache()
    stored = {e.key: e for e in table_format.load_tables(fake_gpu)[0].stacks}
    assert {c: stored[TINY].seconds[c] for c in times} == times
    decision = decisions.fp8_stack_decision(TINY)
    assert decision.choice == "fp8" and decision.source == "user"


def test_max_seconds_stops_starting_stacks_and_writes_what_was_timed(fake_gpu, capsys):
    def slow(key, candidate, seconds):
        time.sleep(0.05)
        return 1.0
    table = tune.tune([TINY, key(80, SMALL)], measure_stack=slow, progress=False,
                      max_seconds=0.01)
    assert len(table.stacks) == 1
    assert len(table_format.load_tables(fake_gpu)[0].stacks) == 1
    assert "1 problems and stacks not timed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="max_seconds"):
        tune.tune([TINY], max_seconds=0)
    with pytest.raises(ValueError, match="fp8"):
        tune.tune([TINY], fp8="yes")


def test_each_stack_is_written_as_it_is_timed(fake_gpu):
    def measure_stack(key, candidate, seconds):
        if key.rows == 40:
            raise KeyboardInterrupt  # or a kill: the stack before it is on disk already
        return 1.0
    with pytest.raises(KeyboardInterrupt):
        tune.tune([key(80, SMALL), TINY], measure_stack=measure_stack, progress=False)
    assert [e.key.rows for e in table_format.load_tables(fake_gpu)[0].stacks] == [80]


# --- the command line ----------------------------------------------------------------------

def test_dry_run_with_fp8_lists_the_candidates(capsys):
    assert tune.main(["--grid", "--rows", "G7,T2", "--fp8", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "stack step bfloat16 M×K 16384×1024 →4096+b gelu →1024+b  (fused, plain, fp8)" in out
    assert "stack forward bfloat16 M×K 16384×1024 →4096+b gelu →1024+b  (fused, plain)" in out
    assert "stack step bfloat16 M×K 256×784 →100+b relu  (fused, plain)" in out  # N = 100
    assert tune.main(["--grid", "--rows", "G7,T2", "--fp8-only", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["stack step bfloat16 M×K 16384×1024 →4096+b gelu →1024+b  (fp8)",
                       "0 distinct problems, 1 stacks"]


@pytest.mark.parametrize("argv, message", [
    (["--grid", "--fp8", "--fp8-only"], "not allowed with"),
    (["--grid", "--max-seconds", "0"], "--max-seconds"),
    (["--grid", "--rows", "T3"], "T1, T2"),
])
def test_bad_fp8_command_lines(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tune.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
