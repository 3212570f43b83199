"""benchmarks/fp8_bench.py runs end to end on tiny shapes and writes a complete report.

Timings are never asserted (benchmarks/README.md): what is checked is that every variant ran, computed
the same step as XLA's bf16 one (to FP8 rounding), and was reported, and that the user's FP8
step written in the script is a correct FP8 step.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest


import fp8_bench  # noqa: E402


@pytest.mark.slow
def test_fp8_smoke_report(tmp_path):
    fp8_bench.main(["--smoke", "--rows", "S2", "--sweep", "--budget-s", "1",
                    "--out", str(tmp_path)])
    report = json.loads((tmp_path / "fp8.json").read_text())
    assert report["metadata"]["jax"] and not report["errors"]
    variants = report["rows"]["S2"]["variants"]
    assert set(variants) == set(fp8_bench.VARIANTS)
    for name, v in variants.items():
        assert v["fallbacks"] == [] and set(v["gemms"]) == {"ours_fp8", "ours_other",
                                                             "xla_fp8", "xla_other"}
        for harness in fp8_bench.HARNESSES:
            assert v[harness]["seconds"] > 0 and v[harness]["ratio_vs_xla_bf16"] > 0
        # FP8 steps differ from bf16 by FP8 rounding (e5m2 gradients: up to ~1/8), not more
        assert v["relative_diff_vs_xla_bf16"] < (0.3 if "fp8" in name else 0.05), name
    assert variants["xla_bf16"]["relative_diff_vs_xla_bf16"] == 0
    assert [(s["rows"], s["n"], s["layers"]) for s in report["sweep"]] == fp8_bench.SMOKE_SWEEP
    assert all(set(s["fp8_vs_best_bf16"]) == set(fp8_bench.SWEEP_FP8)
               and min(s["fp8_vs_best_bf16"].values()) > 0 for s in report["sweep"])
    table = (tmp_path / "fp8.md").read_text()
    assert "| S2 | ours_fp8_all |" in table and "## Sweep" in table
    assert "FALLBACK" not in table.split("| row |")[1] and report["skipped"] == []


def test_max_s_skips_what_would_end_too_late(tmp_path, capsys):
    report = fp8_bench.main(["--smoke", "--rows", "S2", "--sweep", "--max-s", "0",
                             "--out", str(tmp_path)])
    assert report["rows"] == {} and report["sweep"] == []
    assert report["skipped"] == ["S2"] + [f"sweep {fp8_bench.sweep_name(*s)}"
                                            for s in fp8_bench.SMOKE_SWEEP]
    assert "skipped (--max-s 0): S2" in capsys.readouterr().out
    assert "Skipped (the run's --max-s): S2" in (tmp_path / "fp8.md").read_text()


def test_reference_fallbacks_are_caught_and_void_targets():
    import warnings

    def fn(x):
        warnings.warn("cuBLASLt runs no FP8 kernel for epilog BIAS with ...", RuntimeWarning)
        warnings.warn("something else", RuntimeWarning)
        return x + 1

    compiled, fallbacks = fp8_bench.compile_without_fallbacks(fn, (jnp.ones(3),))
    assert fallbacks == ["cuBLASLt runs no FP8 kernel for epilog BIAS with ..."]
    np.testing.assert_array_equal(compiled(jnp.ones(3)), 2 * np.ones(3))
    _, none = fp8_bench.compile_without_fallbacks(lambda x: x * 2, (jnp.ones(3),))
    assert none == []
    variant = lambda ratio, fallbacks: {"careful": {"ratio_vs_xla_bf16": ratio},
                                        "fallbacks": fallbacks}
    rows = {"G1": {"variants": {"ours_fp8": variant(2.0, ["no kernel"]),
                                "xla_bf16": variant(1.0, [])}},
            "M2": {"variants": {"ours_fp8": variant(2.0, []), "xla_bf16": variant(1.0, [])}}}
    found = {t["target"].split()[0]: t for t in fp8_bench.targets(rows)}
    assert not found["G1"]["met"] and found["G1"]["note"] == "reference fallback"
    assert found["M2"]["met"] and "note" not in found["M2"]
    # a speed target is met only when the user harness reaches it too
    rows["M2"]["variants"]["ours_fp8"]["user"] = {"ratio_vs_xla_bf16": 0.9}
    found = {t["target"].split()[0]: t for t in fp8_bench.targets(rows)}
    assert not found["M2"]["met"] and found["M2"]["user"] == 0.9


def test_gemm_counts_tells_where_each_gemm_ran():
    target = fp8_bench.MATMUL.name
    hlo = "\n".join([
        f'%a = (bf16[8,8]) custom-call(f8e4m3fn[8,16] %x, f8e4m3fn[8,16] %w), '
        f'custom_call_target="{target}"',
        f'%b = (bf16[8,8]) custom-call(bf16[8,16] %x, bf16[8,16] %w), '
        f'custom_call_target="{target}"',
        '%c = (bf16[8,8]) custom-call(f8e5m2[8,16] %g, f8e4m3fn[16,8] %w), '
        'custom_call_target="__cublas$lt$matmul$f8"',
        '%d = (bf16[8,8]) custom-call(bf16[8,16] %g, bf16[16,8] %w), '
        'custom_call_target="__cublas$gemm"'])
    assert fp8_bench.gemm_counts(hlo) == {"ours_fp8": 1, "ours_other": 1, "xla_fp8": 1,
                                          "xla_other": 1}


def test_crossover_is_where_fp8_wins_from_then_on():
    sweep = [{"gemm_flops": f, "fp8_vs_best_bf16": {"ours_fp8_all": r, "ours_fp8_delayed_all": d}}
             for f, r, d in [(1e9, 0.5, 0.6), (1e10, 1.1, 1.2), (1e11, 0.9, 1.1), (1e12, 1.2, 1.3),
                             (1e13, 1.4, 1.5)]]
    assert fp8_bench.crossover(sweep) == 1e12
    assert fp8_bench.crossover(sweep, "ours_fp8_delayed_all") == 1e10
    assert fp8_bench.crossover(sweep[:3]) is None


@pytest.mark.parametrize("backward_precision", [None, jax.lax.Precision.HIGHEST])
def test_user_fp8_dot_is_a_scaled_fp8_product(backward_precision):
    """The script's XLA FP8 step (either precision of its backward): forward and both gradients
    equal the products of the quantized operands (e4m3 forward, e5m2 gradient), current
    scaling."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((17, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 9)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((17, 9)), jnp.float32)
    y, vjp = jax.vjp(fp8_bench.user_fp8_dot(backward_precision), x, w)
    dx, dw = vjp(dy)

    def dequantized(v, dtype):
        v8, scale = fp8_bench._user_quantize(v, dtype)
        return np.asarray(v8, np.float64) * float(scale)

    xq, wq = dequantized(x, jnp.float8_e4m3fn), dequantized(w, jnp.float8_e4m3fn)
    gq = dequantized(dy, jnp.float8_e5m2)
    for got, want in ((y, xq @ wq), (dx, gq @ wq.T), (dw, xq.T @ gq)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    assert not np.allclose(y, np.asarray(x) @ np.asarray(w), rtol=1e-3)


@pytest.mark.slow
def test_stateful_variants_time_a_warm_state_without_a_conditional(monkeypatch):
    """The delayed variants take the state as an argument (so XLA cannot fold the calibration
    on it away), warm from an untimed first step; no variant has a conditional. (Every layer
    FP8 here: the smoke rows are too small for `layers="auto"` to choose it.)"""
    w = fp8_bench.SMOKE_ROWS["S1"]
    args = fp8_bench.never_slower.random_inputs(w, 0)
    conds = {}
    for name in ("ours_fp8_stateful", "ours_fp8_delayed", "ours_fp8_delayed_uncalibrated"):
        monkeypatch.setitem(fp8_bench.VARIANTS, name,
                            dataclasses.replace(fp8_bench.VARIANTS[name], layers="all"))
        step, (state,) = fp8_bench.variant_step(w, name, args)
        assert all(float(h.input[0]) > 0 and float(h.input[1]) == 0 for h in state)
        conds[name] = jax.jit(step).lower(*args, state).compile().as_text().count(
            " conditional(")
    # none: a conditional makes the GPU wait on the host (fp8.quantize_delayed)
    assert conds == {"ours_fp8_stateful": 0, "ours_fp8_delayed": 0,
                     "ours_fp8_delayed_uncalibrated": 0}


def test_ours_fp8_all_is_left_out_where_it_is_ours_fp8():
    assert "ours_fp8_all" not in fp8_bench.row_variants(fp8_bench.ROWS["M1"])
    assert "ours_fp8_all" in fp8_bench.row_variants(fp8_bench.ROWS["M2"])
    assert fp8_bench.row_variants(fp8_bench.SMOKE_ROWS["S2"]) == tuple(fp8_bench.VARIANTS)
    assert list(fp8_bench.ROWS)[-1] == "M1"  # the slowest row last: G1 and M2 are not skipped


def test_variants_option_keeps_the_base():
    """--variants measures those named and xla_bf16 (every ratio's base); unknown names fail."""
    w = fp8_bench.SMOKE_ROWS["S2"]
    assert fp8_bench.row_variants(w, ["xla_fp8"]) == ("xla_bf16", "xla_fp8")
    with pytest.raises(SystemExit):
        fp8_bench.main(["--smoke", "--variants", "nonsense", "--out", "/tmp/unused"])
