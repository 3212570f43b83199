"""The served ways in the decision tables: serving entries (format, merge, the choice from
their times), `serving_plan.serving_way` following the nearest one on a GPU, and
`python -m jax_epilog.tune --serving` (an injected clock and the CPU posing as a GPU; for
real on a GPU)."""

import json

import jax
import jax.numpy as jnp
import pytest

import jax_epilog
from jax_epilog.planning import decisions, serving_plan, table_format
from jax_epilog.tools import serving_tune, tune

FAKE = ("Fake GPU", 1)


@pytest.fixture
def tables(monkeypatch, tmp_path):
    """Shipped tables in tmp_path/tables, the user's in tmp_path/user.json, the CPU posing as
    `FAKE`, no serving override."""
    shipped = tmp_path / "tables"
    shipped.mkdir()
    monkeypatch.setattr(decisions, "TABLES_DIR", shipped)
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.delenv("JAX_EPILOG_SERVING", raising=False)
    monkeypatch.setattr(decisions, "device_identity", lambda: FAKE)
    decisions.clear_cache()
    yield tmp_path
    decisions.clear_cache()


def entry(rows, **seconds):
    return table_format.make_serving_entry(rows, "bfloat16", [(64, 96)], seconds)


def write(path, *serving, device=FAKE[0], version=FAKE[1]):
    decisions.merge_into(path, device, version, (), (), serving)


@pytest.mark.parametrize("seconds,choice", [
    (dict(weight_only=2.0, xla_fp8=1.0, fp8=3.0), "xla_fp8"),
    (dict(weight_only=1.01, xla_fp8=1.0), "weight_only"),  # within MARGIN: the accurate way
    (dict(weight_only=None, xla_fp8=2.0, fp8=1.5), "fp8"),  # a failed way is never chosen
    (dict(fp8=2.0, fp8_pallas=1.0), "fp8_pallas"),
    (dict(weight_only=None, fp8=None), None),
])
def test_the_choice_is_the_fastest_way_but_weight_only_within_the_margin(seconds, choice):
    assert table_format.decide_serving_from_times(seconds) == choice
    assert entry(16, **seconds).choice == choice


def test_serving_entries_round_trip_and_merge_by_rows(tables):
    path = tables / "user.json"
    stack_key = table_format.make_stack_key("bfloat16", 64, (32, 16), ("relu",), (True,), "step")
    decisions.merge_into(path, *FAKE, (), (table_format.make_stack_entry(
        stack_key, {"fused": 1.0, "plain": 2.0}),))
    write(path, entry(1, weight_only=1.0, fp8=2.0), entry(64, weight_only=2.0, xla_fp8=1.0))
    write(path, entry(64, weight_only=1.0, xla_fp8=2.0))  # measured again: replaces rows 64
    (table,) = table_format.read_tables(path)
    assert sorted((e.rows, e.choice) for e in table.serving) == [(1, "weight_only"),
                                                                (64, "weight_only")]
    assert len(table.stacks) == 1  # the other kinds of entry are kept
    saved = json.loads(path.read_text())["tables"][0]["serving"]
    assert saved[0] == {"rows": 1, "dtype": "bfloat16", "shapes": [[64, 96]],
                        "seconds": {"weight_only": 1.0, "fp8": 2.0}, "choice": "weight_only"}


def test_a_table_without_serving_entries_still_reads():
    text = json.dumps({"format": "jax_epilog.decisions/2", "tables": [
        {"device": "X", "cublaslt_version": 1, "entries": [], "stacks": []}]})
    (table,) = table_format._parse(text, "t.json")
    assert table.serving == ()


def test_the_served_way_follows_the_nearest_entry_on_this_gpu(tables):
    write(tables / "user.json", entry(16, weight_only=1.0, fp8=0.5),
          entry(64, weight_only=2.0, xla_fp8=1.0))
    way = serving_plan.serving_way(48)
    assert way.choice == "xla_fp8" and "64 rows" in way.why and "user" in way.why
    assert serving_plan.serving_way(12).choice == "fp8"
    # beyond a factor of NEAREST_WITHIN from every entry: the constants
    assert serving_plan.serving_way(256).choice == "fp8"
    assert serving_plan.serving_way(129).why.startswith("rows 129 > WEIGHT_ONLY_MAX_ROWS")
    assert serving_plan.serving_way(4).choice == "weight_only"


def test_the_user_table_decides_before_the_shipped_one(tables):
    shipped = decisions.shipped_table_path(FAKE[0])
    write(shipped, entry(16, weight_only=1.0, xla_fp8=0.5))
    assert serving_plan.serving_way(16).choice == "xla_fp8"
    write(tables / "user.json", entry(16, weight_only=1.0, fp8_pallas=0.5))
    decisions.clear_cache()
    assert serving_plan.serving_way(16).choice == "fp8_pallas"


def test_the_override_and_a_missing_gpu_ignore_the_entries(tables, monkeypatch):
    write(tables / "user.json", entry(16, weight_only=1.0, xla_fp8=0.5))
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")
    assert serving_plan.serving_way(16).choice == "fp8"
    monkeypatch.delenv("JAX_EPILOG_SERVING")
    monkeypatch.setattr(decisions, "device_identity", lambda: (None, None))
    decisions.clear_cache()
    assert serving_plan.serving_way(16).choice == "weight_only"  # the CPU: the constants


def test_an_entry_of_another_gpu_does_not_decide(tables):
    write(tables / "user.json", entry(16, weight_only=1.0, xla_fp8=0.5), device="Other GPU")
    assert serving_plan.serving_way(16).choice == "weight_only"


def test_the_served_layers_run_the_measured_way(tables):
    """A served dense traced with a table that picks XLA's FP8 dot at 16 rows rounds its input
    to FP8 (weight-only would not): the jaxpr holds an e4m3 cast of x."""
    write(tables / "user.json", entry(16, weight_only=1.0, xla_fp8=0.5))
    stored = jax_epilog.quantize_params({"kernel": jnp.ones((64, 96))},
                                        include=lambda path, leaf: True)["kernel"]
    x = jnp.ones((16, 64), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda x: jax_epilog.dense(x, stored))(x))
    assert "f8_e4m3fn" in text.split("dot_general")[0]
    decisions.clear_cache()
    write(tables / "user.json", entry(16, weight_only=0.5, xla_fp8=1.0))
    text = str(jax.make_jaxpr(lambda x: jax_epilog.dense(x, stored))(x))
    assert "f8_e4m3fn[16,64]" not in text


def test_tune_serving_with_an_injected_clock_writes_one_entry_per_row_count(tables, capsys):
    calls = []

    def measure(rows, k, n, *, seconds, failures):
        calls.append((rows, k, n))
        if rows == 64 and k == 32:
            failures.append("xla_fp8 failed")
        return {"weight_only": 1e-5 * rows, "xla_fp8": None if (rows, k) == (64, 32) else 2e-5,
                "fp8": 3e-5, "fp8_pallas": 4e-5}

    got = serving_tune.tune_serving([(32, 48), (48, 32)], [1, 64], seconds=0.01,
                                    measure=measure)
    assert calls == [(1, 32, 48), (1, 48, 32), (64, 32, 48), (64, 48, 32)]
    assert [(e.rows, e.choice) for e in got] == [(1, "weight_only"), (64, "fp8")]
    assert got[0].seconds["weight_only"] == pytest.approx(2e-5)  # summed over the shapes
    assert got[1].seconds["xla_fp8"] is None  # failed on one shape: failed
    (table,) = table_format.read_tables(tables / "user.json")
    assert table.device == FAKE[0] and sorted(e.rows for e in table.serving) == [1, 64]
    out = capsys.readouterr()
    assert "serving, 64 rows:" in out.out and "-> fp8" in out.out
    assert "failed: xla_fp8 failed" in out.err


def test_time_ways_runs_every_way_on_the_cpu():
    """The real measurement (the CPU's ways: our FP8 GEMM's reference, XLA's FP8 dot for the
    Pallas kernel) returns a time for each way."""
    failures = []
    times = serving_tune.time_ways(3, 64, 96, layers=2, seconds=0.01, failures=failures)
    assert failures == [] and set(times) == set(serving_plan.WAYS)
    assert all(t > 0 for t in times.values())


@pytest.mark.parametrize("argv,message", [
    (["--serving", "--serving-rows", "0"], "--serving-rows: expected"),
    (["--serving", "--serving-shapes", "12x"], "--serving-shapes: expected"),
    (["--grid", "--serving-rows", "16"], "go with --serving"),
    (["--serving", "--fp8"], "go with --grid or --fn"),
])
def test_bad_serving_command_lines(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_serving_dry_run_and_the_no_gpu_exit(capsys, monkeypatch):
    assert tune.main(["--serving", "--serving-rows", "1,16", "--dry-run"]) == 0
    assert "at rows 1, 16 on layers (K x N) 4096 x 14336, 14336 x 4096" in capsys.readouterr().out
    monkeypatch.setattr(decisions, "device_identity", lambda: (None, None))
    assert tune.main(["--serving"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        serving_tune.tune_serving()


@pytest.mark.gpu
def test_tune_serving_on_the_gpu(tmp_path, monkeypatch):
    """Every way compiles and runs on the GPU, and the entry decides this GPU's served way."""
    monkeypatch.delenv("JAX_EPILOG_SERVING", raising=False)
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    decisions.clear_cache()
    try:
        (got,) = serving_tune.tune_serving([(1024, 2048)], [16], seconds=0.05)
        assert all(t is not None and t > 0 for t in got.seconds.values()), got.seconds
        assert serving_plan.serving_way(16).choice == got.choice
    finally:
        decisions.clear_cache()


def test_forced_serving_way_sets_and_restores_the_variable(monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")
    with jax_epilog.config.forced_serving_way("xla_fp8"):
        assert serving_plan.serving_way(4096).choice == "xla_fp8"
    assert serving_plan.serving_way(4096).choice == "fp8"
    with pytest.raises(ValueError, match="^way: expected one of"):
        with jax_epilog.config.forced_serving_way("fastest"):
            pass


def test_explain_off_a_gpu_shows_the_reference_gpus_serving_entry(tables, monkeypatch):
    """On the CPU the layers take the constants, and `explain` (which shows what the reference
    GPU would run) takes that GPU's shipped serving entry."""
    monkeypatch.setattr(decisions, "device_identity", lambda: (None, None))
    write(decisions.shipped_table_path(table_format.REFERENCE_DEVICE),
          entry(16, weight_only=1.0, xla_fp8=0.5), device=table_format.REFERENCE_DEVICE,
          version=None)
    decisions.clear_cache()
    assert serving_plan.serving_way(16).choice == "weight_only"
    stored = jax_epilog.quantize_params({"kernel": jnp.ones((64, 96))},
                                        include=lambda path, leaf: True)["kernel"]
    report = str(jax_epilog.explain(lambda x: jax_epilog.dense(x, stored),
                                    jnp.ones((16, 64), jnp.bfloat16)))
    assert "xla_fp8: measured fastest at 16 rows" in report and "shipped" in report
