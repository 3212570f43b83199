"""benchmarks/fp8_profile.py: the per-step breakdown of a trace's kernels, and a smoke run."""


import pytest


import fp8_profile  # noqa: E402
from gpu_trace import Kernel  # noqa: E402


def _kernels(steps):
    """Per step: two GEMMs (1 ms, 2 ms) and a fusion (0.5 ms), back to back."""
    kernels, t = [], 0.0
    for _ in range(steps):
        for name, ms in (("nvjet_hsh_gemm", 1.0), ("loop_convert_fusion", 0.5),
                         ("sm90_xmma_gemm_e4m3", 2.0)):
            kernels.append(Kernel(t, t + ms * 1e6, "Stream #1", name, None))
            t += ms * 1e6
    return kernels


def test_breakdown_is_per_step():
    b = fp8_profile.kernel_breakdown(_kernels(3), 3)
    assert b["gemm_ms"] == 3.0 and b["other_ms"] == 0.5 and b["kernel_ms"] == 3.5
    assert b["span_ms"] == 3.5 and b["gemms_per_step"] == 2 and b["kernels_per_step"] == 3
    assert [g["ms"] for g in b["gemm_sequence"]] == [1.0, 2.0]
    top = {k["name"]: k for k in b["top_kernels"]}
    assert top["sm90_xmma_gemm_e4m3"]["ms_per_step"] == 2.0 and top["nvjet_hsh_gemm"]["gemm"]
    assert not top["loop_convert_fusion"]["gemm"]


def test_no_kernels_is_said():
    assert "no GPU kernels" in fp8_profile.kernel_breakdown([], 3)["note"]


@pytest.mark.slow
def test_smoke_run_writes_a_report(tmp_path):
    report = fp8_profile.main(["--smoke", "--variants", "xla_bf16,xla_fp8", "--steps", "1",
                               "--out", str(tmp_path)])
    assert set(report["variants"]) == {"xla_bf16", "xla_fp8"}
    assert all("step_ms" in v for v in report["variants"].values())
    assert (tmp_path / "fp8_profile.md").read_text().startswith("# Where the FP8 step")


@pytest.mark.slow
def test_peer_rows_each_write_a_report(tmp_path):
    report = fp8_profile.main(["--smoke", "--peer", "--row", "S1,S1", "--steps", "1",
                               "--out", str(tmp_path)])
    assert report["peer"] and set(report["variants"]) == set(fp8_profile.PEER_VARIANTS)
    assert all("step_ms" in v and "model" in v for v in report["variants"].values())
    assert "Fp8DirectDotGeneralOp" in report["variants"]["flax_fp8_direct"]["model"]
    assert (tmp_path / "S1" / "fp8_profile.md").read_text().startswith("# Where the FP8 step")


@pytest.mark.slow
def test_swiglu_rows_profile_flax_fp8_beside_ours(tmp_path):
    report = fp8_profile.main(["--smoke", "--swiglu", "--steps", "1", "--out", str(tmp_path)])
    assert report["swiglu"] and report["row"] == "T1"
    assert set(report["variants"]) == set(fp8_profile.SWIGLU_VARIANTS)
    assert all("step_ms" in v and "model" in v for v in report["variants"].values())
    assert "SwiGLU" in report["variants"]["ours_swiglu_fp8"]["model"]
    assert (tmp_path / "fp8_profile.md").read_text().startswith("# Where the FP8 step")


def test_one_kind_of_rows_at_a_time(capsys):
    with pytest.raises(SystemExit):
        fp8_profile.main(["--peer", "--swiglu", "--out", "/tmp/unused"])
    assert "at most one" in capsys.readouterr().err
