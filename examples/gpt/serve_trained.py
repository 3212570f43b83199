"""Train a Llama on the standard library's sources, save it, and serve it: stock bf16 against
jax-epilog's FP8 serving (FP8 weights and the FP8 KV cache), with the quality targets and
greedy samples.

    python examples/gpt/serve_trained.py --out /tmp/served                # one H100
    python examples/gpt/serve_trained.py --config llama_tiny --steps 60 --batch 1 \\
        --fp8-min-features 16 --out /tmp/served_cpu                         # CPU, a minute

One process, three stages, everything under `--out`:

1. **Training**: `train.py`'s `train` of `--config` (`llama_served`: `llama_small` for 3000
   steps) with `--impl` (stock, bf16 compute on a GPU), for its steps or until
   `--train-seconds` of training have passed (then it stops at the next logged step, the
   cosine schedule unfinished, and says so), checkpointed (orbax) into `--checkpoint-dir`
   (default `OUT/checkpoint`). A second run with the same one resumes, or only serves where
   training had finished.
2. **Serving**: `generate.py --checkpoint-dir CHECKPOINT --compare` (with
   `generate_bench.py`'s switches): `stock` in the compute dtype with its KV cache in it, and
   the FP8 variants (`epilog_fp8`, `stock_fp8`: kernels stored in FP8, FP8 GEMMs, the FP8 KV
   cache) from the same saved weights; decode and prefill speed at each `--batch`, then the
   quality against stock, teacher forced over `--eval-batches` validation batches, each one
   prefill into the variant's own KV cache. It writes `gpt_generate.{json,md}`.
3. **The report**, `served.{json,md}`: the training (steps, time, tokens/s, the validation
   losses against the unigram level, the cross-entropy of a model that knows only each
   byte's frequency in the training text), the targets (the trained model well below the
   unigram level; every FP8 variant's validation loss within 0.5% of stock's and its
   next-token argmax stock's at >= 98% of positions), and greedy samples of every variant
   from the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):  # run as a script: make `gpt` (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from gpt import configs, data, decode, generate, generate_bench, train
from gpt.model import IMPLS

#: The quality targets of FP8 serving against stock (teacher forced, the same windows).
LOSS_WITHIN = 0.005
TOP1_AT_LEAST = 0.98
#: "Readable": the validation loss at most this share of the unigram level's.
READABLE_SHARE = 0.5
#: Greedy samples per variant in the report, and how much of each prompt it shows.
REPORT_SAMPLES = 3
PROMPT_TAIL = 200


def unigram_loss(corpus: data.Corpus) -> float:
    """The validation text's cross-entropy (nats per byte) under the training text's byte
    frequencies (add-one smoothed): what a model that learned nothing else would reach."""
    counts = np.bincount(corpus.train, minlength=256) + 1.0
    return float(-np.mean(np.log(counts / counts.sum())[corpus.validation]))


def quality_targets(variants: dict[str, dict], validation_loss: Optional[float],
                    unigram: float) -> list[dict[str, Any]]:
    """The targets, each {"target", "value", "met"}: the trained model's validation loss at
    most `READABLE_SHARE` of `unigram`'s, and per served variant other than stock its
    validation loss within `LOSS_WITHIN` of stock's and its top-1 agreement with stock at
    least `TOP1_AT_LEAST`."""
    targets = [{"target": f"trained: validation loss <= {READABLE_SHARE:.0%} of the unigram "
                          f"level ({unigram:.3f})",
                "value": "n/a" if validation_loss is None else f"{validation_loss:.4f}",
                "met": validation_loss is not None and
                validation_loss <= READABLE_SHARE * unigram}]
    for name, record in variants.items():
        if name == "stock":
            continue
        loss, top1 = record.get("validation_loss_vs_stock"), \
            record.get("top1_agreement_with_stock")
        targets += [
            {"target": f"{name}: validation loss within {LOSS_WITHIN:.1%} of stock's",
             "value": "n/a" if loss is None else f"{loss:+.3%}",
             "met": loss is not None and abs(loss) <= LOSS_WITHIN},
            {"target": f"{name}: top-1 agreement with stock >= {TOP1_AT_LEAST:.0%}",
             "value": "n/a" if top1 is None else f"{top1:.3%}",
             "met": top1 is not None and top1 >= TOP1_AT_LEAST}]
    return targets


def serving_argv(args: argparse.Namespace, checkpoint: Path) -> list[str]:
    """generate_bench.py's command line for the serving stage."""
    argv = ["--checkpoint-dir", str(checkpoint), "--compare", "--variants", args.variants,
            "--batch", *map(str, args.batch), "--prompt-len", str(args.prompt_len),
            "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
            "--eval-batches", str(args.eval_batches), "--out", str(args.out)]
    if args.weight_scales != "tensor":
        argv += ["--weight-scales", args.weight_scales]
    if args.fp8_min_features is not None:
        argv += ["--fp8-min-features", str(args.fp8_min_features)]
    return argv + (["--no-progress"] if args.no_progress else [])


def trained_config(args: argparse.Namespace) -> configs.TrainConfig:
    """`--config` with `--steps` and `--layers` (the warm-up shortened as train.py does)."""
    config = configs.get(args.config)
    steps = args.steps or config.steps
    overrides = {"steps": args.steps, "n_layers": args.layers,
                 "warmup_steps": steps // 10 if config.warmup_steps > steps else None}
    return config.replace(**{k: v for k, v in overrides.items() if v is not None})


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    start = time.perf_counter()
    config = trained_config(args)
    corpus = data.load_corpus()
    trained = train.train(config, args.impl, corpus=corpus, progress=not args.no_progress,
                          checkpoint_dir=args.checkpoint_dir,
                          time_limit_s=args.train_seconds)
    trained.pop("state")  # its buffers go before the variants are built
    print(f"trained: steps {trained['steps']}, validation loss "
          f"{trained['validation_loss'][-1][1] if trained['validation_loss'] else 'n/a'}",
          flush=True)
    served = generate_bench.main(serving_argv(args, args.checkpoint_dir))
    unigram = unigram_loss(corpus)
    variants = served["result"]["variants"]
    # A run that resumed a finished training evaluated nothing: stock's served loss is it.
    last = trained["validation_loss"][-1][1] if trained["validation_loss"] else \
        variants.get("stock", {}).get("validation_loss")
    report = {"benchmark": "served", "metadata": served["metadata"],
              "command": command, "config": dataclasses.asdict(config),
              "train": trained, "unigram_loss": unigram,
              "targets": quality_targets(variants, last, unigram),
              "serving": {name: {key: record.get(key) for key in (
                  "kv_cache", "fp8_kernels", "weight_bytes", "validation_loss",
                  "validation_loss_vs_stock", "top1_agreement_with_stock")}
                  for name, record in variants.items()},
              "failed": served["result"]["failed"],
              "samples": {name: next(reversed(record["by_batch"].values()))["samples"]
                          for name, record in variants.items()},
              "wall_s": time.perf_counter() - start}
    (args.out / "served.json").write_text(json.dumps(report, indent=1))
    (args.out / "served.md").write_text(render(report))
    for target in report["targets"]:
        print(f"{target['target']}: {target['value']} ({'met' if target['met'] else 'NOT met'})")
    print(f"wrote {args.out / 'served.md'} in {report['wall_s']:.0f} s")
    return report


def render(report: dict[str, Any]) -> str:
    meta, t, model = report["metadata"], report["train"], report["config"]["model"]
    row = generate._row
    speed = f"{t['tokens_per_s']:,.0f} tokens/s" if t["tokens_per_s"] else "tokens/s n/a"
    stop = ", stopped by the time limit (the cosine schedule unfinished)" \
        if t["stopped_by_time_limit"] else ""
    lines = ["# A trained model served: stock against jax-epilog's FP8", "",
             f"{meta['date']}, {meta['device']} ({meta['platform']}), jax {meta['jax']}. "
             f"`{report['command']}`, {report['wall_s']:.0f} s in all. Method: "
             "examples/gpt/serve_trained.py's docstring.", "",
             f"**Training**: `{t['impl']}` in {t['dtype']}, d_model {model['d_model']}, "
             f"{model['n_layers']} layer{'s' * (model['n_layers'] != 1)}, {model['n_heads']} query / {model['n_kv_heads']} "
             f"key-value heads, steps {t['steps'][0]} to {t['steps'][1]} of "
             f"{report['config']['steps']}{stop}, {t['train_s']:.0f} s, {speed}, compile "
             f"{t['compile_s']:.1f} s. The unigram level is {report['unigram_loss']:.4f}.", "",
             row("step", "validation loss"), row("---", "---")]
    lines += [row(step, f"{loss:.4f}") for step, loss in t["validation_loss"]]
    lines += ["", "**Served** (speeds: gpt_generate.md; teacher forced over the validation "
              "batches, each a prefill into the variant's own KV cache):", "",
              row("variant", "KV cache", "FP8 kernels", "weights MiB", "validation loss",
                  "vs stock", "top-1 agreement with stock"), row(*["---"] * 7)]
    lines += [row(name, s["kv_cache"], s["fp8_kernels"], generate._mib(s["weight_bytes"]),
                  f"{s['validation_loss']:.4f}",
                  generate._number(s["validation_loss_vs_stock"], "+.3%"),
                  generate._number(s["top1_agreement_with_stock"], ".3%"))
              for name, s in report["serving"].items()]
    lines += [row(name, f"failed: {error}", *[""] * 5)
              for name, error in report["failed"].items()]
    lines += ["", "## Targets", "", row("target", "value", "met"), row("---", "---", "---")]
    lines += [row(x["target"], x["value"], "yes" if x["met"] else "no")
              for x in report["targets"]]
    lines += ["", "## Greedy samples", "", f"The last {PROMPT_TAIL} bytes of each prompt "
              "(validation text), then what each variant generated from it.", ""]
    fence = "````"
    for i in range(REPORT_SAMPLES):
        variants = [(name, samples[i]) for name, samples in report["samples"].items()
                    if i < len(samples)]
        if not variants:
            break
        lines += [f"### Prompt {i + 1}", "", fence, variants[0][1]["prompt"][-PROMPT_TAIL:],
                  fence, ""]
        for name, sample in variants:
            lines += [f"{name}:", "", fence, sample["generated"], fence, ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama_served", choices=tuple(configs.CONFIGS))
    parser.add_argument("--impl", default="stock", choices=IMPLS, help="the trained model's")
    parser.add_argument("--steps", type=int, help="override the config's step count")
    parser.add_argument("--layers", type=int, help="override the config's n_layers")
    parser.add_argument("--train-seconds", type=float, default=240.0,
                        help="stop training at the first logged step past this (compile "
                             "excluded)")
    parser.add_argument("--variants", default="stock,epilog_fp8,stock_fp8",
                        help="served, stock among them (generate.py --variants)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs (the median)")
    parser.add_argument("--eval-batches", type=int, default=4,
                        help="validation batches for the quality pass")
    parser.add_argument("--fp8-min-features", type=int,
                        help="store kernels whose dims are both at least this in FP8 "
                             "(default: quantize_params' rule, 512; tiny configs need less)")
    parser.add_argument("--weight-scales", default="tensor", choices=("tensor", "channel"),
                        help="the FP8 variants' weight scales: one per kernel, or one per "
                             "output channel")
    parser.add_argument("--out", type=Path, required=True, help="the folder for the reports")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="where the trained model is saved and served from (default "
                             "OUT/checkpoint; a run again with it resumes, or only serves)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv=None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "layers", "prompt_len", "new_tokens", "repeats", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int, got {value}")
    if not args.train_seconds > 0:
        parser.error(f"--train-seconds: expected a positive number, got {args.train_seconds}")
    # What serving would refuse, refused before the training.
    try:
        decode.check_fits(trained_config(args).model, args.prompt_len, args.new_tokens)
    except ValueError as error:
        parser.error(f"--prompt-len/--new-tokens: {error}")
    args.checkpoint_dir = args.checkpoint_dir or args.out / "checkpoint"
    serving = generate.parse_args(serving_argv(args, args.checkpoint_dir),
                                  generate_bench.build_parser())
    generate.compared_variants(serving)
    args.out.mkdir(parents=True, exist_ok=True)
    argv = sys.argv[1:] if argv is None else argv
    return run(args, " ".join(["python examples/gpt/serve_trained.py", *argv]))


if __name__ == "__main__":
    main()
