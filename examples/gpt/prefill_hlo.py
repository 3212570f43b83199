"""What a prefill's program holds, stock against the FP8 served variants, lowered for CUDA on
any host (no GPU needed): the custom calls, GEMMs, reductions, casts to FP8, cache writes and
transposes of `generate.py`'s prefill step, per layer and for the rest of the program.

    python examples/gpt/prefill_hlo.py --config llama_large --out /tmp/prefill_hlo   # CPU, ~1 min

Each variant is built as `generate.py` builds it (random weights of the config's seed, bf16,
the KV cache `--kv-cache auto` gives it: FP8 for the FP8 variants) and its prefill step traced
for `--batch` prompts of `--prompt-len` tokens, then lowered for `--platform` (JAX's
`Traced.lower(lowering_platforms=...)`): the StableHLO a GPU would compile, before XLA's
fusion. It is lowered with 1 and with 2 layers; the difference is one layer's ops, the rest
(embedding, final norm, head, sampling) the fixed part. The full forward's attention is XLA's
here (cuDNN's fused attention does not trace without cuDNN), the same in every variant.

Where the lowering decides by the GPU (the served way of a layer over so many rows, the FP8
cache's layout and read), a host without one decides by the rules' constants; a forced way
(`epilog_fp8@weight_only`) decides as on any host. The counts are StableHLO ops, not kernels:
XLA fuses elementwise work into its neighbours, but each reduction to a scale, each custom call
and each cache write stays at least one kernel of its own, and at batch 1, where a prefill's
kernels are short, each kernel's launch is host time.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `gpt` (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

from gpt import configs, generate
from gpt.decode import Generator

#: The counted kinds: a name and the pattern of one op of it in the StableHLO text.
KINDS = {
    "custom calls": r"stablehlo\.custom_call @",
    "XLA dots": r"stablehlo\.dot_general ",
    "max-reductions (scales, softmax)": r"applies stablehlo\.maximum across dimensions",
    "casts to FP8": r"stablehlo\.convert .*-> tensor<[0-9x]*f8E4M3FN>",
    "cache writes": r"stablehlo\.dynamic_update_slice ",
    "transposes": r"stablehlo\.transpose ",
    "concatenates": r"stablehlo\.concatenate ",
}
VARIANTS = ("stock", "epilog_fp8", "epilog_fp8@weight_only")


def counts(text: str) -> dict[str, Any]:
    """`KINDS` counted in a lowered module's text, and the custom calls by target."""
    found = {kind: len(re.findall(pattern, text)) for kind, pattern in KINDS.items()}
    found["custom call targets"] = dict(collections.Counter(
        re.findall(r"stablehlo\.custom_call @(\w+)", text)))
    return found


def lowered_prefill(name: str, config: configs.TrainConfig, batch: int, prompt_len: int,
                    platform: str, fp8_min_features) -> str:
    """The StableHLO text of variant `name`'s prefill step for `platform`."""
    base, way = generate.variant_parts(name)
    dtype = jnp.bfloat16
    weights = generate.serving_weights(config, None, dtype)
    with generate.forced_serving_way(way):
        cached = generate.build_variant(base, config, weights, dtype,
                                        fp8_min_features=fp8_min_features)
        generator = Generator(cached, cache_dtype=generate.cache_dtype(base, "auto", dtype))
        cache = jax.eval_shape(lambda: generator.new_cache(batch, prompt_len + 1))
        tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
        traced = generator._prefill_step.trace(generator.state, cache, tokens,
                                               jax.random.key(0))
        return traced.lower(lowering_platforms=(platform,)).as_text()


def compare(names, config: configs.TrainConfig, batch: int, prompt_len: int,
            platform: str = "cuda", fp8_min_features=None) -> dict[str, Any]:
    """Per variant: the counts of one layer (2 layers' less 1 layer's) and of the rest."""
    out = {}
    for name in names:
        one, two = (counts(lowered_prefill(name, config.replace(n_layers=layers), batch,
                                           prompt_len, platform, fp8_min_features))
                    for layers in (1, 2))
        per_layer = {k: two[k] - one[k] for k in KINDS}
        per_layer["custom call targets"] = {
            target: two["custom call targets"][target] - one["custom call targets"].get(target, 0)
            for target in two["custom call targets"]}
        rest = {k: one[k] - per_layer[k] for k in KINDS}
        out[name] = {"per_layer": per_layer, "rest": rest}
        print(name, "per layer", per_layer, "rest", rest, flush=True)
    return out


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    names = list(report["variants"])
    lines = [f"# A prefill's program: {', '.join(names)}", "",
             f"`{report['command']}`: `{s['config']}` at batch {s['batch']}, "
             f"{s['prompt_len']}-token prompts, lowered for {s['platform']} on "
             f"{report['host']} (jax {report['jax']}). StableHLO ops before XLA's fusion "
             "(method: examples/gpt/prefill_hlo.py's docstring).", ""]
    for part, title in (("per_layer", "one layer"), ("rest", "the rest of the program")):
        lines += [f"## {title}", "", "| kind | " + " | ".join(names) + " |",
                  "|---|" + "---|" * len(names)]
        lines += [f"| {kind} | " + " | ".join(str(report["variants"][n][part][kind])
                                              for n in names) + " |" for kind in KINDS]
        lines.append("")
    lines += ["Custom calls per layer by target: " + "; ".join(
        f"{n}: {report['variants'][n]['per_layer']['custom call targets'] or 'none'}"
        for n in names), ""]
    return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="llama_large", choices=tuple(configs.CONFIGS))
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="generate.py's names, epilog_fp8@WAY among them")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--fp8-min-features", type=int,
                        help="store kernels whose dims are both at least this in FP8 "
                             "(default: quantize_params' rule; tiny configs need less)")
    parser.add_argument("--out", type=Path, help="folder for prefill_hlo.json and .md")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    known = set(generate.VARIANTS) - {"qwix_fp8"}
    if not names or any(generate.variant_parts(n)[0] not in known for n in names):
        parser.error(f"--variants: expected names among {', '.join(sorted(known))} (with "
                     f"@WAY), got {args.variants!r}")
    if args.batch < 1 or args.prompt_len < 1:
        parser.error("--batch and --prompt-len: expected positive ints")
    config = configs.get(args.config)
    report = {"command": " ".join(["python examples/gpt/prefill_hlo.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "host": jax.default_backend(), "jax": jax.__version__,
              "settings": {"config": args.config, "batch": args.batch,
                           "prompt_len": args.prompt_len, "platform": args.platform},
              "variants": compare(names, config, args.batch, args.prompt_len, args.platform,
                                  args.fp8_min_features)}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefill_hlo.json").write_text(json.dumps(report, indent=1))
        (args.out / "prefill_hlo.md").write_text(render(report))
        print(f"wrote {args.out / 'prefill_hlo.md'}")
    return report


if __name__ == "__main__":
    main()
