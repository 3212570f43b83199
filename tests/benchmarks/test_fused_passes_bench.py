"""benchmarks/fused_passes.py runs end to end on tiny shapes and writes its report (timings are
never asserted, benchmarks/README.md); on a CPU only XLA's side runs."""

import json

import pytest

import fused_passes


def _check(report, tmp_path, cases):
    assert json.loads((tmp_path / "fused_passes.json").read_text()) == report
    assert not report["errors"]
    assert {(e["pass"], e["row"]) for e in report["results"]} == cases
    for e in report["results"]:
        assert e["xla"]["ms"] > 0 and (e["least_bytes"] or 1) > 0
        assert ("cuda" in e) == (report["kernels_unavailable"] is None)
    text = (tmp_path / "fused_passes.md").read_text()
    for name, row in cases:
        assert f"| {name} | {row} |" in text


def test_smoke_report_of_one_pass(tmp_path):
    report = fused_passes.main(["--smoke", "--rows", "T2", "--rounds", "2",
                                "--out", str(tmp_path)])
    _check(report, tmp_path, {("quantize_transpose", "T2")})


@pytest.mark.slow  # every pass compiled
def test_smoke_report_of_every_pass(tmp_path):
    report = fused_passes.main(["--smoke", "--rounds", "2", "--out", str(tmp_path)])
    _check(report, tmp_path, {("quantize_transpose", "T1"), ("swiglu_forward", "T1"),
                              ("swiglu_backward", "T1"), ("quantize_transpose", "T2"),
                              ("swiglu_step", "T1")})
    step = next(e for e in report["results"] if e["pass"] == "swiglu_step")
    assert step["least_bytes"] is None and step["xla"]["bandwidth"] is None


def test_bad_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        fused_passes.main(["--smoke", "--passes", "layernorm"])
    assert "--passes: unknown ['layernorm']" in capsys.readouterr().err
