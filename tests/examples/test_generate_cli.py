"""The GPT example's serving command line (examples/gpt/generate.py) and its benchmark entry
point (generate_bench.py): generate.py's help lists only the user's options, the experiment
switches reach the run through generate_bench.py, a missing Qwix skips its variant with one
line, and off a GPU the speed ratios over stock are marked not applicable (FP8 emulated)."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import pytest

for needed in ("flax", "optax", "tqdm"):  # the example's own requirements
    pytest.importorskip(needed)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import configs, generate, generate_bench  # noqa: E402

#: What a user of generate.py sets: the weights, the variants, the batch sizes, the prompt,
#: the sampling, the KV cache's dtype and the report.
USER_OPTIONS = {"--checkpoint-dir", "--random-init", "--config", "--variant", "--compare",
                "--variants", "--batch", "--prompt-len", "--new-tokens", "--temperature",
                "--top-k", "--seed", "--kv-cache", "--out", "--no-progress"}
EXPERIMENT_SWITCHES = {"--repeats", "--eval-batches", "--dtype", "--attention",
                       "--fp8-min-features", "--static-scales", "--weight-scales",
                       "--fp8-attention", "--fp8-cache-layout", "--steps-per-call",
                       "--prefill-command-buffers", "--profile"}


def options(parser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def test_the_help_lists_only_the_users_options():
    parser = generate.build_parser()
    assert options(parser) == USER_OPTIONS
    text = parser.format_help()
    assert all(flag in text for flag in USER_OPTIONS)
    assert not any(flag in text for flag in EXPERIMENT_SWITCHES - {"--profile"})
    assert "generate_bench.py --help" in text  # where the switches went
    bench = generate_bench.build_parser()
    assert options(bench) == USER_OPTIONS | EXPERIMENT_SWITCHES
    assert all(flag in bench.format_help() for flag in EXPERIMENT_SWITCHES)


def test_generate_py_given_an_experiment_switch_names_generate_bench(capsys):
    for argv in (["--random-init", "--repeats", "1"],
                 ["--random-init", "--batch", "1", "4", "--fp8-min-features", "64"]):
        with pytest.raises(SystemExit):
            generate.parse_args(argv)
        error = capsys.readouterr().err
        assert f"unrecognized arguments: {' '.join(argv[-2:])}" in error
        assert "generate_bench.py" in error


def test_the_switches_reach_the_settings_and_default_as_generate_py_runs():
    config = configs.get("tiny")
    bench = generate_bench.build_parser()
    plain = generate.settings_for(generate.parse_args(["--random-init"]), config)
    assert generate.settings_for(generate.parse_args(["--random-init"], bench), config) == plain
    switched = generate.settings_for(generate.parse_args([
        "--random-init", "--repeats", "2", "--eval-batches", "3", "--attention", "xla",
        "--fp8-min-features", "64", "--static-scales", "--weight-scales", "channel",
        "--fp8-attention", "dots", "--fp8-cache-layout", "positions_major",
        "--steps-per-call", "4", "--prefill-command-buffers", "on", "--profile", "/tmp/p"],
        bench), config)
    want = dict(repeats=2, eval_batches=3, attention="xla", fp8_min_features=64,
                static_scales=True, weight_scales="channel", fp8_attention="dots",
                fp8_cache_layout="positions_major", steps_per_call=4,
                prefill_command_buffers=True, profile="/tmp/p")
    assert set(want) == set(generate.EXPERIMENT_SETTINGS)
    assert {name: getattr(switched, name) for name in want} == want
    assert all(getattr(plain, name) != value for name, value in want.items())
    assert dataclasses.replace(switched, **{n: getattr(plain, n) for n in want}) == plain
    assert generate.parse_args(["--random-init", "--dtype", "bfloat16"], bench).dtype == \
        "bfloat16"


def test_the_fp8_threshold_takes_effect_through_generate_bench():
    # tiny's kernels (64 wide) stay 16-bit under the default rule; the switch stores them
    config = configs.get("tiny")
    weights = generate.serving_weights(config, None, jax.numpy.float32)
    default = generate.build_variant("stock_fp8", config, weights, jax.numpy.float32)
    assert generate.fp8_kernels(default) == 0
    report = generate_bench.main([
        "--random-init", "--variant", "stock_fp8", "--prompt-len", "5", "--new-tokens", "1",
        "--repeats", "1", "--eval-batches", "1", "--no-progress", "--fp8-min-features", "64"])
    assert report["result"]["variants"]["stock_fp8"]["fp8_kernels"] == 8  # 2 blocks x 4
    assert report["settings"]["fp8_min_features"] == 64


def test_a_missing_qwix_skips_its_variant_and_speeds_off_a_gpu_are_na(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setattr(generate, "qwix_installed", lambda: False)
    report = generate_bench.main([
        "--random-init", "--compare", "--variants", "stock,epilog_fp8,qwix_fp8",
        "--prompt-len", "5", "--new-tokens", "3", "--repeats", "1", "--eval-batches", "0",
        "--no-progress", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    result = report["result"]
    assert "qwix_fp8: skipped: Qwix is not installed (pip install qwix to add it)\n" in out
    assert result["skipped"] == {"qwix_fp8": generate.QWIX_MISSING} and not result["failed"]
    assert list(result["variants"]) == ["stock", "epilog_fp8"]
    text = (tmp_path / "gpt_generate.md").read_text()
    assert f"| qwix_fp8 | {generate.QWIX_MISSING} |" in text
    assert "FAILED" not in out and "failed" not in text
    # --eval-batches 0: a speed-only run, no quality pass
    assert all(r["validation_loss"] is None and "top1_agreement_with_stock" not in r
               for r in result["variants"].values())
    weights = generate._mib(result["variants"]["epilog_fp8"]["weight_bytes"])
    assert f"| epilog_fp8 | {weights} | n/a | n/a | n/a |" in text
    measured = result["variants"]["epilog_fp8"]["by_batch"]["1"]
    platform = jax.default_backend()
    if platform != "gpu":
        na = f"n/a ({platform.upper()}: FP8 emulated)"
        assert result["speed_ratio_note"] == na
        assert measured["decode_vs_stock"] is None and measured["prefill_vs_stock"] is None
        assert f"epilog_fp8 batch 1 vs stock: prefill {na}, decode {na}" in out
        assert out.startswith(f"Not a GPU ({platform}): FP8 is emulated in plain JAX")
        assert f"| epilog_fp8 | 1 | {measured['prefill_tokens_per_s']:,.0f} | " \
               f"{measured['decode_tokens_per_s']:,.0f} | {na} | {na} |" in text
        assert "FP8 is emulated in plain JAX" in text
    # On a GPU the same records give the ratios (tokens/s over stock's at the batch size).
    stock = result["variants"]["stock"]["by_batch"]["1"]
    generate.add_speed_ratios(result["variants"], None)
    assert measured["decode_vs_stock"] == pytest.approx(
        measured["decode_tokens_per_s"] / stock["decode_tokens_per_s"])
    gpu = json.loads(json.dumps(report))
    gpu["metadata"]["platform"], gpu["result"]["speed_ratio_note"] = "gpu", None
    rendered = generate.render(gpu)
    assert f"| {measured['prefill_vs_stock']:.2f}x | {measured['decode_vs_stock']:.2f}x |" \
        in rendered
    assert "n/a (" not in rendered and "emulated" not in rendered


def test_static_scales_need_validation_batches(capsys):
    with pytest.raises(SystemExit):
        generate_bench.main(["--random-init", "--static-scales", "--eval-batches", "0"])
    assert "--static-scales calibrates on the validation batches" in capsys.readouterr().err


def test_serving_qwix_alone_without_qwix_says_how_to_add_it(capsys, monkeypatch):
    monkeypatch.setattr(generate, "qwix_installed", lambda: False)
    with pytest.raises(SystemExit):
        generate.main(["--random-init", "--variant", "qwix_fp8"])
    assert "--variant qwix_fp8: skipped: Qwix is not installed (pip install qwix" in \
        capsys.readouterr().err
