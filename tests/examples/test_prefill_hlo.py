"""examples/gpt/prefill_hlo.py on the CPU: a Llama's prefill lowered for CUDA, stock against
the FP8 served variants, counted per layer and for the rest of the program."""

import json
import sys
from pathlib import Path

import pytest

for needed in ("flax", "optax", "tqdm"):  # the example's own requirements
    pytest.importorskip(needed)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import prefill_hlo  # noqa: E402


@pytest.mark.slow  # about 10 s: 3 variants traced and lowered twice
def test_the_served_prefill_lowered_for_cuda_holds_what_each_way_runs(tmp_path):
    # 16 rows: weight-only by the constants off a GPU, so our FP8 GEMM is forced
    names = ("stock", "epilog_fp8@fp8", "epilog_fp8@weight_only")
    report = prefill_hlo.main(["--config", "llama_tiny", "--prompt-len", "16",
                               "--variants", ",".join(names), "--fp8-min-features", "16",
                               "--out", str(tmp_path)])
    stock, fp8, weight_only = (report["variants"][name]["per_layer"] for name in names)
    # Per layer: the 5 projections as XLA dots (stock, weight-only) or our FP8 GEMMs, each
    # FP8 GEMM's input quantized once (gate and up share theirs), and the FP8 cache's
    # keys, values and their scales written, each key and value vector scaled by its amax.
    assert (stock["custom calls"], fp8["custom calls"], weight_only["custom calls"]) == (0, 5, 0)
    assert fp8["custom call targets"] == {"jax_epilog_matmul": 5}
    assert stock["XLA dots"] == weight_only["XLA dots"] == fp8["XLA dots"] + 5
    assert fp8["casts to FP8"] == 4 + 2 and weight_only["casts to FP8"] == 2
    assert (stock["cache writes"], fp8["cache writes"]) == (2, 4)
    key = "max-reductions (scales, softmax)"
    assert fp8[key] - stock[key] == 4 + 2 and weight_only[key] - stock[key] == 2
    assert report["variants"]["stock"]["rest"]["custom calls"] == 0
    text = (tmp_path / "prefill_hlo.md").read_text()
    assert "| custom calls | 0 | 5 | 0 |" in text and "lowered for cuda" in text
    assert json.loads((tmp_path / "prefill_hlo.json").read_text())["variants"] == \
        json.loads(json.dumps(report["variants"]))


def test_unknown_variants_are_refused(capsys):
    with pytest.raises(SystemExit):
        prefill_hlo.main(["--variants", "stock,qwix_fp8"])
    assert "--variants: expected" in capsys.readouterr().err
