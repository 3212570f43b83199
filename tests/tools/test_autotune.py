"""Autotuning of cuBLASLt algorithms: the Python switch (CPU) and tuned results on a GPU.

The CPU tests check `jax_epilog.config` with or without the CUDA library. The GPU tests (marked
`gpu`) tune real problems into a temporary autotune file and compare every result with the
float64 model: tuning may change the algorithm, never the numbers beyond rounding.
"""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Epilog, config
from jax_epilog.runtime import targets
from jax_epilog.runtime import library as cuda_library
from problems import TOLERANCE, assert_matches_model, make_problem
import command_buffers

import autotune_bench  # noqa: E402

ALGO_WORDS = 8  # cublasLtMatmulAlgo_t is 8 uint64 words, one hex field each in the file


@pytest.fixture
def restore_autotune(monkeypatch):
    """Leaves the switch (environment and library) and the plan cache as they were."""
    monkeypatch.setenv(config.AUTOTUNE_ENV, os.environ.get(config.AUTOTUNE_ENV, ""))
    before = config.autotune_enabled()
    yield
    cuda_library.set_autotune(before)
    cuda_library.clear_plan_cache()


# ---- CPU: the Python side of the switch ----------------------------------------------------

def test_set_autotune_switches_library_and_environment(restore_autotune):
    config.set_autotune(True)
    assert config.autotune_enabled() is True
    assert os.environ[config.AUTOTUNE_ENV] == "1"
    config.set_autotune(False)
    assert config.autotune_enabled() is False
    assert os.environ[config.AUTOTUNE_ENV] == "0"


@pytest.mark.parametrize("value", [1, "1", None, np.bool_(True)])
def test_set_autotune_rejects_non_bool(value, restore_autotune):
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        config.set_autotune(value)


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("0", False), ("", config.AUTOTUNE_DEFAULT), ("yes", config.AUTOTUNE_DEFAULT),
    (None, config.AUTOTUNE_DEFAULT)])
def test_environment_rule_without_library(value, expected, monkeypatch):
    """What the library would read from JAX_EPILOG_AUTOTUNE, answered without it."""
    monkeypatch.setattr(cuda_library, "autotune_enabled", lambda: None)
    if value is None:
        monkeypatch.delenv(config.AUTOTUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(config.AUTOTUNE_ENV, value)
    assert config.autotune_enabled() is expected


def test_autotune_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv(config.AUTOTUNE_CACHE_ENV, str(tmp_path / "tuned.txt"))
    assert config.autotune_cache_path() == tmp_path / "tuned.txt"
    monkeypatch.setenv(config.AUTOTUNE_CACHE_ENV, "")
    assert config.autotune_cache_path() is None
    monkeypatch.delenv(config.AUTOTUNE_CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert config.autotune_cache_path() == tmp_path / ".cache" / "jax_epilog" / "autotune.txt"
    monkeypatch.delenv("HOME")
    assert config.autotune_cache_path() is None


@pytest.mark.parametrize("count", [-1, 1.0, True, "2"])
def test_inject_failures_rejects_bad_counts(count):
    with pytest.raises(ValueError, match="count: expected a non-negative int"):
        cuda_library.inject_failures(count)


def test_controls_without_library(monkeypatch):
    """Without the library: the queries say None, inject_failures says why it cannot."""
    unavailable = types.SimpleNamespace(handle=None, error="not built here")
    monkeypatch.setattr(cuda_library, "library", lambda: unavailable)
    assert cuda_library.plan_cache_size() is None
    assert cuda_library.autotune_enabled() is None
    cuda_library.set_autotune(True)  # nothing to switch: no error
    cuda_library.clear_plan_cache()
    with pytest.raises(RuntimeError, match="unavailable \\(not built here\\)"):
        cuda_library.inject_failures(1)


@pytest.mark.slow
def test_autotune_bench_smoke_report(tmp_path):
    autotune_bench.main(["--smoke", "--rows", "S1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "autotune.json").read_text())
    keys = [("S1", name) for name in autotune_bench.PROBLEMS]
    for mode in autotune_bench.FIRST_CALL_MODES:
        records = report["first_call"][mode]
        assert [(r["row"], r["problem"]) for r in records] == keys
        assert all(r["compile_s"] > 0 and r["first_execution_s"] > 0 for r in records)
    assert [(r["row"], r["problem"]) for r in report["steady"]] == keys
    assert all(r["heuristic_us"] > 0 and r["tuned_us"] > 0 for r in report["steady"])
    table = (tmp_path / "autotune.md").read_text()
    assert "| S1 | backward DRELU_BGRAD |" in table and "cuBLASLt" in table


# ---- GPU: tuned plans, the autotune file ---------------------------------------------------

# epilog, dtype (tolerance key), precision, m, n, k, lead, transposes: odd sizes, every kind of
# epilog input and output, a batch with a shared b and a per-batch bias.
GPU_CASES = [
    (Epilog.RELU_AUX_BIAS, "bfloat16", None, 257, 300, 129, (), {}),
    (Epilog.DRELU_BGRAD, "bfloat16", None, 129, 255, 64, (), {"transpose_b": True}),
    (Epilog.GELU_AUX_BIAS, "float16", None, 127, 136, 200, (), {}),
    (Epilog.BIAS, "float32_tf32", "default", 33, 130, 64, (3,), {}),
    (Epilog.BGRADB, "float32", "highest", 200, 129, 160, (), {"transpose_a": True}),
]


def _gpu_problem(case, seed):
    epilog, tol_key, precision, m, n, k, lead, kw = case
    dtype = tol_key.split("_")[0]
    rng = np.random.default_rng(seed)
    a, b, inputs = make_problem(rng, epilog, m=m, n=n, k=k, lead=lead,
                                bias_batched=bool(lead) and epilog.has_bias, dtype=dtype, **kw)
    f = jax.jit(lambda a, b, inputs: jax_epilog.matmul(
        a, b, epilog=epilog, epilog_inputs=inputs or None, precision=precision, **kw))
    args = jax.device_put((a, b, inputs), jax.devices("cuda")[0])
    assert targets.MATMUL.name in f.lower(*args).as_text(), f"{epilog.name} fell back"

    def check(got):
        assert_matches_model(epilog, jax.device_get(got), a, b, inputs, tol=TOLERANCE[tol_key],
                             n=n, **kw)

    return f, args, check


def _stored_lines(path):
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def tuning_into(tmp_path, monkeypatch, restore_autotune):
    """Autotuning on, into a fresh file, every plan forgotten; yields the file's path."""
    path = tmp_path / "autotune.txt"
    monkeypatch.setenv(config.AUTOTUNE_CACHE_ENV, str(path))
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE_LOG", "1")
    config.set_autotune(True)
    cuda_library.clear_plan_cache()
    return path


@pytest.mark.gpu
def test_tuned_results_match_model_and_are_stored_once(tuning_into, capfd):
    problems = [_gpu_problem(case, seed) for seed, case in enumerate(GPU_CASES)]
    for f, args, check in problems:
        check(f(*args))
    log = [line for line in capfd.readouterr().err.splitlines() if "jax_epilog autotune:" in line]
    lines = _stored_lines(tuning_into)
    print(f"\n{len(log)} problems timed, {len(lines)} stored:", *log, sep="\n  ")
    # Each timed problem with a choice to make is stored once, as key + 8 hex words.
    assert len(lines) == sum("-> candidate -1" not in line for line in log) >= 1
    for line in lines:
        key, words = line.rsplit(" algo=", 1)
        assert key.startswith("v1 ") and " cublasLt=" in key, line
        assert len(words.split(",")) == ALGO_WORDS and all(
            len(w) == 16 and int(w, 16) >= 0 for w in words.split(",")), line

    # Forgetting every plan: the next calls take the stored algorithms, tune nothing again.
    cuda_library.clear_plan_cache()
    assert cuda_library.plan_cache_size() == 0
    for f, args, check in problems:
        check(f(*args))
    assert "jax_epilog autotune:" not in capfd.readouterr().err
    assert _stored_lines(tuning_into) == lines
    assert cuda_library.plan_cache_size() >= len(problems)


@pytest.mark.gpu
def test_corrupt_or_unwritable_autotune_file_is_ignored(tuning_into, monkeypatch, tmp_path):
    tuning_into.write_text("garbage\nv1 x algo=12,zz\n\x00\x01 algo=" + ",".join(["f" * 16] * 7)
                           + "\nv1 torn line without newline algo=00")
    f, args, check = _gpu_problem(GPU_CASES[0], seed=10)
    check(f(*args))
    lines = _stored_lines(tuning_into)
    assert lines[:4] == ["garbage", "v1 x algo=12,zz", "\x00\x01 algo=" + ",".join(["f" * 16] * 7),
                         "v1 torn line without newline algo=00"]

    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv(config.AUTOTUNE_CACHE_ENV, str(blocker / "autotune.txt"))
    cuda_library.clear_plan_cache()
    f, args, check = _gpu_problem(GPU_CASES[1], seed=11)
    check(f(*args))
    assert blocker.read_text() == ""


@pytest.mark.gpu
def test_autotune_off_stores_nothing(tuning_into):
    config.set_autotune(False)
    f, args, check = _gpu_problem(GPU_CASES[2], seed=12)
    check(f(*args))
    assert not tuning_into.exists()


@pytest.mark.gpu
def test_tuning_never_writes_over_a_donated_input(tuning_into):
    """y may be placed over a donated input that an earlier op still reads: tuning writes only
    to its own scratch memory, so the earlier op still sees the input."""
    rng = np.random.default_rng(13)
    n = 264
    x, w1, w2, bias = (jnp.asarray(rng.standard_normal(s) / np.sqrt(n), jnp.float32)
                       for s in ((200, n), (n, n), (n, n), (n,)))

    def layer(x, w1, w2, bias):
        h = jnp.dot(x, w1, precision="highest")
        return jax_epilog.matmul(h, w2, epilog="relu_bias", epilog_inputs={"bias": bias},
                                 precision="highest")

    want = np.maximum(np.asarray(x, np.float64) @ np.asarray(w1, np.float64)
                      @ np.asarray(w2, np.float64) + np.asarray(bias, np.float64), 0)
    f = jax.jit(layer, donate_argnums=0)
    x_gpu = jax.device_put(x, jax.devices("cuda")[0])
    got = f(x_gpu, w1, w2, bias)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_plan_cache_size_and_clear(tuning_into):
    config.set_autotune(False)
    problems = [_gpu_problem(case, seed) for seed, case in enumerate(GPU_CASES[:3])]
    for f, args, check in problems:
        check(f(*args))
    assert cuda_library.plan_cache_size() >= 3
    cuda_library.clear_plan_cache()
    assert cuda_library.plan_cache_size() == 0
    f, args, check = problems[0]
    check(f(*args))
    assert cuda_library.plan_cache_size() >= 1


@pytest.mark.gpu
def test_autotune_on_inside_xla_command_buffers(tmp_path, monkeypatch):
    """Command buffers capture the execute stage: results stay right with autotuning on."""
    monkeypatch.setenv(config.AUTOTUNE_ENV, "1")  # for the subprocess the test starts
    monkeypatch.setenv(config.AUTOTUNE_CACHE_ENV, str(tmp_path / "autotune.txt"))
    command_buffers.check_kernel_runs_inside_command_buffers()
