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


def test_targets_are_issue_62s_ratios_at_decode_rows():
    import stock_serving_bench

    def row(m, **ms):
        return {"M": m, **{n: {"careful_ms": t, "user_ms": t * 1.1} for n, t in ms.items()}}

    rows = [row(1, stock_bf16=2.0, stock_fp8=1.0, ours_fp8=0.98, qwix_fp8=1.5, qwix_epilog=1.0),
            row(64, stock_bf16=2.0, stock_fp8=1.2, ours_fp8=1.0, qwix_fp8=1.5, qwix_epilog=1.2),
            row(2048, stock_bf16=1.0, stock_fp8=9.0, ours_fp8=1.0, qwix_fp8=1.0)]
    found = {t["target"]: t for t in stock_serving_bench.targets(rows)}
    ours = found["stock_fp8 >= 0.97x ours_fp8 at M <= 64"]
    assert ours["worst"] == pytest.approx(1.0 / 1.2) and not ours["met"]  # the worst row's
    qwix = found["stock_fp8 >= 1.3x qwix_fp8 at M <= 64"]
    assert qwix["worst"] == pytest.approx(1.5 / 1.2) and not qwix["met"]
    assert found["qwix_epilog >= 0.97x stock_fp8 at M <= 64"]["met"]
    assert found["stock_fp8 >= 1.0x stock_bf16 at M <= 64"]["met"]  # 2048 is no decode row
