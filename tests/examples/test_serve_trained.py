"""examples/gpt/serve_trained.py on the CPU: a tiny Llama trained, checkpointed, served stock
and in FP8 from that checkpoint, with the quality targets and greedy samples in the report;
the targets' arithmetic; the time limit of train.py's training; a second run resuming; bad
input refused before any training."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

for needed in ("flax", "optax", "tqdm", "orbax.checkpoint"):  # the example's own requirements
    pytest.importorskip(needed)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import configs, data, serve_trained, train  # noqa: E402

FLOW = ["--config", "llama_tiny", "--layers", "1", "--batch", "2",
        "--prompt-len", "7", "--new-tokens", "5", "--repeats", "1", "--eval-batches", "1",
        "--fp8-min-features", "16", "--variants", "stock,epilog_fp8", "--no-progress"]


@pytest.mark.slow  # about 25 s on the CPU: a training and two served variants compiled
def test_a_tiny_llama_is_trained_saved_and_served_with_its_quality_and_samples(tmp_path):
    # Any time at all is past this limit: training stops at its first logged step (5 of
    # llama_tiny's 60), with the validation loss there, and checkpoints there.
    report = serve_trained.main([*FLOW, "--train-seconds", "1e-9", "--out", str(tmp_path)])
    assert report["train"]["steps"] == [0, 5] and report["train"]["stopped_by_time_limit"]
    assert [step for step, _ in report["train"]["validation_loss"]] == [5]
    assert (tmp_path / "checkpoint" / "5").is_dir()  # saved, then served from there
    served = json.loads((tmp_path / "gpt_generate.json").read_text())
    assert served["weights"] == f"{tmp_path / 'checkpoint'} step 5"
    assert list(report["serving"]) == ["stock", "epilog_fp8"] and not report["failed"]
    fp8 = report["serving"]["epilog_fp8"]
    assert fp8["kv_cache"] == "float8_e4m3fn" and fp8["fp8_kernels"] == 5  # qkv, out, SwiGLU
    assert 0.5 < fp8["top1_agreement_with_stock"] <= 1
    # The samples: the same prompts for every variant, as many new bytes as asked.
    samples = report["samples"]
    assert [s["prompt"] for s in samples["stock"]] == [s["prompt"] for s in samples["epilog_fp8"]]
    assert len(samples["stock"]) == 2 and all(len(s["prompt"]) == 7 for s in samples["stock"])
    text = (tmp_path / "served.md").read_text()
    assert json.loads((tmp_path / "served.json").read_text())["targets"] == report["targets"]
    assert "| epilog_fp8: top-1 agreement with stock >= 98% |" in text
    assert samples["epilog_fp8"][1]["generated"] in text and "### Prompt 2" in text
    assert f"{report['unigram_loss']:.4f}" in text and "| 5 | " in text  # the loss table
    assert "stopped by the time limit" in text


def test_the_targets_compare_with_stock_at_their_bounds():
    variants = {"stock": {"validation_loss_vs_stock": 0.0, "top1_agreement_with_stock": 1.0},
                "a": {"validation_loss_vs_stock": 0.005, "top1_agreement_with_stock": 0.98},
                "b": {"validation_loss_vs_stock": -0.0051, "top1_agreement_with_stock": 0.9799},
                "c": {}}  # no quality measured
    targets = serve_trained.quality_targets(variants, 1.5, 3.0)
    assert [t["met"] for t in targets] == [True, True, True, False, False, False, False]
    assert targets[0]["value"] == "1.5000" and targets[-1]["value"] == "n/a"
    assert not serve_trained.quality_targets({}, 1.51, 3.0)[0]["met"]
    assert not serve_trained.quality_targets({}, None, 3.0)[0]["met"]


def test_the_unigram_level_is_the_cross_entropy_of_the_byte_frequencies():
    corpus = data.Corpus(train=np.array([1, 1, 1, 2], np.uint8),
                         validation=np.array([1, 2], np.uint8), train_files=(),
                         validation_files=(), root="")
    counts = np.ones(256)
    counts[1], counts[2] = 4, 2
    p = counts / counts.sum()
    assert serve_trained.unigram_loss(corpus) == pytest.approx(-(np.log(p[1]) + np.log(p[2])) / 2)


@pytest.mark.slow
def test_a_finished_training_resumes_to_nothing_and_serves_again(tmp_path):
    argv = [*FLOW, "--steps", "2", "--variants", "stock", "--checkpoint-dir",
            str(tmp_path / "saved")]
    first = serve_trained.main([*argv, "--out", str(tmp_path / "first")])
    again = serve_trained.main([*argv, "--out", str(tmp_path / "again")])
    assert (tmp_path / "saved" / "2").is_dir() and not (tmp_path / "first" / "checkpoint").exists()
    assert first["train"]["steps"] == [0, 2] and again["train"]["steps"] == [2, 2]
    assert again["serving"]["stock"]["validation_loss"] == \
        first["serving"]["stock"]["validation_loss"]
    # nothing trained the second time: the trained model's loss is stock's served one
    assert again["targets"][0]["value"] == f"{again['serving']['stock']['validation_loss']:.4f}"


def test_training_refuses_a_time_limit_that_is_not_positive():
    with pytest.raises(ValueError, match="time_limit_s"):
        train.train(configs.get("llama_tiny"), time_limit_s=0)


def test_bad_input_is_refused_before_training(tmp_path, capsys):
    for argv, message in ((["--prompt-len", "60", "--new-tokens", "10"], "--prompt-len"),
                          (["--variants", "epilog_fp8"], "--variants"),
                          (["--train-seconds", "0"], "--train-seconds"),
                          (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit):
            serve_trained.main(["--config", "llama_tiny", *argv, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written
