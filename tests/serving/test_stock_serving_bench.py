"""benchmarks/stock_serving_bench.py's tiny mode: every variant runs, the report is written."""

from __future__ import annotations


import pytest

pytest.importorskip("flax")


@pytest.mark.slow
def test_stock_serving_smoke_report(tmp_path):
    import stock_serving_bench
    report = stock_serving_bench.main(["--smoke", "--rounds", "1", "--rows", "1,129",
                                       "--out", str(tmp_path)])
    assert [r["M"] for r in report["rows"]] == [1, 129]
    for row in report["rows"]:
        assert {"stock_bf16", "stock_fp8", "ours_fp8"} <= set(row)
        assert 0 < row["stock_fp8"]["error"] < 0.1  # FP8 ran, and ran right
        assert row["stock_fp8"]["error"] == pytest.approx(row["ours_fp8"]["error"], rel=0.5)
    assert (tmp_path / "stock_serving.md").read_text().startswith("# A stock Flax model")
