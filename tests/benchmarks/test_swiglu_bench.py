"""benchmarks/swiglu_bench.py runs end to end on tiny shapes and writes a complete report
(timings are never asserted, benchmarks/README.md)."""

import json

import pytest

pytest.importorskip("flax")

import swiglu_bench  # noqa: E402


@pytest.mark.slow
def test_smoke_report_has_every_variant_in_both_harnesses(tmp_path):
    report = swiglu_bench.main(["--smoke", "--rows", "T2", "--budget-s", "1",
                                "--out", str(tmp_path)])
    assert json.loads((tmp_path / "swiglu.json").read_text()) == report
    assert not report["errors"]
    row = report["rows"]["T2"]
    assert set(row["variants"]) == set(swiglu_bench.VARIANTS)
    for name, v in row["variants"].items():
        assert v["careful"]["seconds"] > 0 and v["user"]["seconds"] > 0, name
        assert v["first_step_seconds"] > 0 and v["compile_seconds"] > 0, name
        # every variant starts from flax_bf16's weights: its gradients are flax_bf16's within
        # FP8 rounding (at these sizes fp8=True keeps the compute dtype)
        assert v["grad_error_max"] < 0.25, name
    assert row["variants"]["flax_bf16"]["grad_error_max"] == 0
    assert "flax_fp8_direct: `3 × nn.Dense(use_bias=False, dot_general_cls=fp8_ops." \
        "Fp8DirectDotGeneralOp)`" in (tmp_path / "swiglu.md").read_text()
    assert {t["target"].split(":")[0] for t in report["targets"]} == {"T2"}
