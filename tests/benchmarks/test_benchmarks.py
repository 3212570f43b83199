"""The benchmark scripts run end to end on tiny shapes and write complete reports.

Timings are never asserted (benchmarks/README.md); what is checked is that every variant ran, computed
the layer (jax_epilog's y equals XLA's) and was reported.
"""

import json

import pytest


import forward_bench  # noqa: E402
import overhead_bench  # noqa: E402
import timing  # noqa: E402


def test_input_copies_fill_twice_the_l2():
    assert timing.input_copies(10 * timing.L2_BYTES) == 1
    assert timing.input_copies(timing.L2_BYTES // 4) == 8
    assert timing.input_copies(1) == timing.MAX_INPUT_COPIES
    with pytest.raises(ValueError, match="bytes_per_call"):
        timing.input_copies(0)


def test_time_calls_counts_every_call():
    calls = []
    t = timing.time_calls(lambda i: calls.append(i), [(0,), (1,), (2,)], sync=lambda _: None,
                          rounds=5, round_seconds=0.0)
    assert len(t.rounds) == 5 and t.seconds > 0 and t.calls_per_round >= 3
    assert set(calls) == {0, 1, 2}


@pytest.mark.slow
def test_forward_smoke_report(tmp_path):
    forward_bench.main(["--smoke", "--rows", "S2", "--dtypes", "bf16",
                        "--epilogs", "relu_bias,gelu_aux_bias", "--budget", "0.5",
                        "--no-nvmath", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "forward.json").read_text())
    assert report["metadata"]["jax"] and "cublaslt_version" in report["metadata"]
    assert [r["epilog"] for r in report["records"]] == ["RELU_BIAS", "GELU_AUX_BIAS"]
    for record in report["records"]:
        assert record["shape"] == [129, 7, 127]
        ours = record["results"]["jax_epilog"]
        assert ours["seconds"] > 0 and ours["tflops"] > 0 and ours["speedup_vs_xla"] > 0
        assert ours["max_abs_diff_vs_xla"] < 0.05
        assert ours["lowering"] in ("custom call", "reference lowering")
    assert any("nvmath-python column omitted" in note for note in report["notes"])
    table = (tmp_path / "forward.md").read_text()
    assert "| S2 | bf16 | 129×7×127 | RELU_BIAS" in table
    assert (tmp_path / "forward.png").stat().st_size > 0


@pytest.mark.slow
def test_overhead_smoke_report(tmp_path):
    overhead_bench.main(["--smoke", "--rows", "S1", "--layers", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "overhead.json").read_text())
    assert len(report["records"]) == len(overhead_bench.UNROLLS)
    for record in report["records"]:
        assert set(record["results"]) == {"gemm", "xla", "jax_epilog", "dense"}
        assert all(r["us_per_layer"] > 0 for r in record["results"].values())
    assert (tmp_path / "overhead.png").stat().st_size > 0
    assert "XLA command buffers (CUDA graphs): " in (tmp_path / "overhead.md").read_text()


def test_overhead_reads_the_command_buffer_setting():
    assert overhead_bench.command_buffers("") == "XLA's default"
    assert overhead_bench.command_buffers("--xla_gpu_enable_command_buffer= --x=1") == "off"
    assert overhead_bench.command_buffers(
        "--xla_gpu_enable_command_buffer= --xla_gpu_enable_command_buffer=FUSION") == "FUSION"


def test_layer_loop_matches_unrolled_layers():
    import jax
    import numpy as np

    x, w, b = forward_bench.random_inputs((16, 24, 10), np.float32, copies=1)[0]
    layer = forward_bench.xla_layer(forward_bench.Epilog.RELU_BIAS)
    expected = x
    for _ in range(3):
        expected = expected.at[:, :10].set(layer(expected, w, b))
    received = jax.jit(overhead_bench.layer_loop(layer, 3, unroll=1))(x, w, b)
    np.testing.assert_allclose(received, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_never_slower_smoke_report(tmp_path):
    import never_slower

    never_slower.main(["--smoke", "--rows", "S1", "--budget-s", "0.5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "never_slower.json").read_text())
    assert report["metadata"]["jax"] and "cublaslt_version" in report["metadata"]
    names = [r["name"] for r in report["rows"]] + report["skipped"]
    assert names[:2] == ["S1 forward", "S1 step"] and not report["errors"]
    assert sorted(names) == ["S1 forward", "S1 gelu forward", "S1 gelu step", "S1 step"]
    for row in report["rows"]:
        assert row["careful"]["ratio"] > 0 and row["user"]["ratio"] > 0
        assert row["max_abs_diff"] < 0.1  # both sides computed the same layer
        low, high = row["careful"]["ratio_spread"]
        assert 0 < low <= high and row["rounds"] in (never_slower.ROUNDS, never_slower.SMALL_ROUNDS)
    assert set(report["summary"]) == {"careful", "user"}
    table = (tmp_path / "never_slower.md").read_text()
    assert "| S1 step | 64 × 48→40 |" in table and "| careful |" in table
    readme = never_slower.readme_table(report)
    assert "| S1 | " in readme and "careful: min" in readme and "user: min" in readme


def _module_text(fn, args) -> str:
    """The lowered StableHLO of `jax.jit(fn)`, without locations, names and result info."""
    import re

    import jax

    text = jax.jit(fn).lower(*args).as_text()
    for pattern, replacement in ((r"\s*loc\([^)]*\)", ""), (r"#loc\d*( = .*)?", ""),
                                 (r"@jit_\w+", "@jit_f"), (r'jax\.result_info = "[^"]*"', ""),
                                 (r"mhlo\.frontend_attributes = \{[^}]*\}", "")):
        text = re.sub(pattern, replacement, text)
    return text


@pytest.mark.parametrize("forward_choice", ["plain", "fused"])
def test_the_plain_path_is_the_users_program(monkeypatch, forward_choice):
    """Where the table chooses "plain" (G7 forward, M3 step, ...), jax_epilog's side of
    never_slower lowers to exactly the module of the user's plain expression (`xla_stack`):
    any ratio away from 1 on such a row is timing noise. With the inference entry on "fused"
    (M3), the step still is (the custom VJP that keeps the fused forward for inference leaves
    no trace in the differentiated module)."""
    import never_slower

    from jax_epilog.planning import context
    from jax_epilog.planning import decisions
    from jax_epilog.planning import table_format
    from jax_epilog.tools import grid
    choices = {"step": "plain", "forward": forward_choice}
    monkeypatch.setattr(context, "on_cuda_gpu", lambda: True)  # the CPU poses as a CUDA GPU
    monkeypatch.setattr(decisions, "stack_decision",
                        lambda key: table_format.Decision(choices[key.mode], "shipped"))
    modes = ("forward", "step") if forward_choice == "plain" else ("step",)
    for w in grid.grid_workloads(["G7", "G4", "M3"]):
        for mode in modes:
            make, args = never_slower.MODES[mode], w.shapes()
            assert _module_text(make(w, grid.epilog_stack), args) == \
                _module_text(make(w, never_slower.xla_stack), args), f"{w.name} {mode}"


def test_ratio_spread_pairs_rounds_by_index():
    a = timing.Timing(2.0, (2.0, 3.0, 1.0), 1)
    b = timing.Timing(1.0, (1.0, 2.0, 2.0), 1)
    assert timing.ratio_spread(a, b) == (0.5, 2.0)


@pytest.mark.slow
def test_serving_smoke_report(tmp_path):
    import serving_bench

    report = serving_bench.main(["--smoke", "--rounds", "2", "--parts", "gemm,block,swiglu",
                                 "--out", str(tmp_path)])
    assert [(r["shape"], r["M"]) for r in report["gemm"]] == [("K64xN96", 1), ("K64xN96", 17)]
    for row in report["gemm"]:
        for name in ("xla_bf16", "ours_bf16", "ours_fp8", "ours_fp8_gemm", "ours_fp8_static",
                     "ours_xla_fp8", "ours_weight_only", "xla_fp8"):
            assert row[name]["careful_ms"] > 0 and row[name]["user_ms"] > 0, name
        assert row["ours_bf16"]["error"] < 0.02
        for name in ("ours_fp8", "ours_fp8_gemm", "ours_xla_fp8", "ours_weight_only",
                     "ours_fp8_channel", "ours_fp8_channel_gemm"):
            assert 0 < row[name]["error"] < 0.1, (name, row[name]["error"])
    assert report["weight_bytes"]["gemm"]["fp8"] * 2 <= report["weight_bytes"]["gemm"]["bf16"] + 64
    assert [r["M"] for r in report["block"]] == [3]
    assert 0 < report["block"][0]["ours_fp8"]["error"] < 0.1
    assert 0 < report["block"][0]["ours_fp8_channel"]["error"] < 0.1
    assert [r["M"] for r in report["swiglu"]] == [3]
    assert 0 < report["swiglu"][0]["ours_fp8"]["error"] < 0.1
    text = (tmp_path / "serving.md").read_text()
    assert "## Targets" in text and "## SwiGLU block" in text


@pytest.mark.slow
def test_few_rows_tuning_smoke_report(tmp_path):
    """benchmarks/few_rows_tuning.py end to end on a tiny shape (the Pallas interpreter off a
    GPU): every variant timed, the kernels' outputs within an FP8 input's error."""
    import few_rows_tuning

    report = few_rows_tuning.main(["--smoke", "--rounds", "2", "--out", str(tmp_path)])
    first, second = report["rows"]
    assert (first["M"], second["M"]) == (16, 3)
    kernels = [n for n in first["variants"] if n.startswith("fp8k")]
    assert len(kernels) == 2 + len(few_rows_tuning.SMOKE["grid"])
    assert "fp8k_default" in kernels and "fp8k_default_xla_quantized" in kernels
    for row in report["rows"]:
        for name, v in row["variants"].items():
            assert v["careful_ms"] > 0 and v["user_ms"] > 0, name
            if name != "weight_only_xla":  # bf16 weights or an FP8 input
                assert 0 < v["error"] < 0.1, (name, v["error"])
    assert "## K64xN96, M 16" in (tmp_path / "few_rows_tuning.md").read_text()
