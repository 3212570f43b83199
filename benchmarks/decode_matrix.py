"""The decode attention over a KV cache, one layer, over a matrix of architectures, batches
and contexts: the measurements behind `jax_epilog.decode_attention`'s choice of an FP8
cache's read form and layout (docs/kv_cache.md).

Cells: architecture (MHA 32/32, GQA 32/8, MQA 32/1 query/key-value heads, head_dim 128) x
batch (1, 4, 16, 64, 256) x context (384, 2048, 8192 positions, the cache full). Per cell,
the variants (`--variants`):

- stock: a bf16 cache `(batch, context, kv_heads, head_dim)` written by
  `lax.dynamic_update_slice` and read by `jax.nn.dot_product_attention` with a mask, as a user
  would write it;
- bf16: a bf16 cache through the library (`init_kv_cache`, `write_kv`, `decode_attention`);
- fp8 READ LAYOUT: an FP8 cache through the library, each read form ("reduce", "dots") in
  each layout ("positions_major", "heads_major", "heads_major_rows").

One timed call runs `--steps` decode steps in a device loop (the cache donated and carried,
as a served model's decode call runs them): each step writes one new key and value per
sequence and attends over the whole cache, its query depending on the step before, so the
steps run one after the other. Timing one step per call would measure the host's dispatch.
The measurement is the library's (`jax_epilog.tools.attention_tune`, which `python -m
jax_epilog.tune --serving` runs on the user's own attention). Reported: microseconds per step
(the median of `--rounds` rounds) and each variant's speed against stock. A cell whose cache does not fit the card's memory
(or that fails to allocate) is skipped and said so; so are the cells left when `--budget`
seconds are spent. One jit per cell and variant.

    python benchmarks/decode_matrix.py --out benchmarks/results/decode_matrix   # GPU: --budget 330 s
    python benchmarks/decode_matrix.py --tiny --out /tmp/decode_matrix            # any CPU
    python benchmarks/decode_matrix.py --table-from OUT/decode_matrix.json

The last form (OUT: the first's `--out`) writes the measured cells into the rule's table
(jax_epilog/planning/tables/attention/decode.json, the section of the card that ran them,
replacing it), which the library's default then reads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import timing  # benchmarks/timing.py
from jax_epilog.planning import attention_plan
from jax_epilog.tools import attention_tune
from jax_epilog.tools.attention_tune import memory_limit

ARCHS = {"mha": (32, 32), "gqa": (32, 8), "mqa": (32, 1)}
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (384, 2048, 8192)
HEAD_DIM = 128
TINY = dict(archs={"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}, batches=(1, 3),
            contexts=(33, 65), head_dim=16)
#: The variants and what one timed call runs: the library's `tune --serving` times the same.
VARIANTS = attention_tune.VARIANTS


def commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None


def run_matrix(args, save=lambda report: None) -> dict[str, Any]:
    """The matrix's report; `save(report)` after each cell, so that a run stopped from outside
    (a compile that outlasts the budget, a time limit) still leaves the cells it measured."""
    grid = TINY if args.tiny else dict(archs=ARCHS, batches=BATCHES, contexts=CONTEXTS,
                                       head_dim=HEAD_DIM)
    archs = {name: grid["archs"][name] for name in args.archs}
    batches, contexts = args.batches or grid["batches"], args.contexts or grid["contexts"]
    meta = timing.run_metadata() | {"commit": commit(),
                                    "command": " ".join(["python"] + sys.argv)}
    report: dict[str, Any] = {"meta": meta, "settings": {
        "head_dim": grid["head_dim"], "steps": args.steps, "rounds": args.rounds,
        "variants": list(args.variants), "budget_s": args.budget}, "cells": []}
    limit, deadline = memory_limit(), time.perf_counter() + args.budget
    for context in contexts:
        for batch in batches:
            for name, (query_heads, kv_heads) in archs.items():
                cell = {"arch": name, "query_heads": query_heads, "kv_heads": kv_heads,
                        "head_dim": grid["head_dim"], "batch": batch, "context": context,
                        "variants": {}}
                for variant in args.variants:
                    cell["variants"][variant] = {"seconds": None, "skipped": "time budget"} \
                        if time.perf_counter() > deadline else attention_tune.time_variant(
                            variant, (query_heads, kv_heads), batch, context,
                            grid["head_dim"], args.steps, args.rounds, limit)
                report["cells"].append(cell)
                save(report)
                print(name, batch, context, {v: _us(t) for v, t in cell["variants"].items()},
                      flush=True)
    return report


def _us(timed: dict) -> str:
    return f"{timed['seconds'] * 1e6:.1f}" if timed.get("seconds") else "-"


def render(report: dict) -> str:
    meta, settings = report["meta"], report["settings"]
    variants = settings["variants"]
    fp8 = [v for v in variants if v.startswith("fp8")]
    lines = ["# Decode attention over a KV cache, one layer", "",
             timing.provenance(meta, f"commit {meta['commit']}"), "",
             f"`{meta['command']}`", "",
             f"head_dim {settings['head_dim']}; {settings['steps']} decode steps per call, "
             f"median of {settings['rounds']} rounds. Microseconds per step for stock (a bf16 "
             "cache read by `jax.nn.dot_product_attention`), then each variant's speed "
             "against it (>1: faster); best: the fastest FP8 read and layout.", ""]
    short = {v: v.replace("fp8 ", "").replace("positions_major", "pos").replace(
        "heads_major_rows", "rows").replace("heads_major", "heads") for v in variants}
    lines += ["| arch | batch | context | " + " | ".join(short[v] for v in variants) +
              " | best FP8 |", "|" + "---|" * (len(variants) + 4)]
    for cell in report["cells"]:
        timed = cell["variants"]
        stock = timed.get("stock", {}).get("seconds")
        cells = []
        for v in variants:
            s = timed[v].get("seconds")
            if s is None:
                cells.append(f"skipped ({timed[v].get('skipped')})")
            elif v == "stock" or stock is None:
                cells.append(f"{s * 1e6:.1f} µs")
            else:
                cells.append(f"{stock / s:.2f}")
        best = attention_plan.best_fp8({v: timed[v].get("seconds") for v in fp8})
        lines.append(f"| {cell['arch']} {cell['query_heads']}/{cell['kv_heads']} | "
                     f"{cell['batch']} | {cell['context']} | " + " | ".join(cells) +
                     f" | {' '.join(best) if best else '-'} |")
    slower = [c for c in report["cells"] if _best_vs_stock(c) is not None and
              _best_vs_stock(c) < 1]
    lines += ["", f"Cells where the best FP8 read is slower than stock: {len(slower)}"
              + (": " + ", ".join(f"{c['arch']} b{c['batch']} c{c['context']}"
                                  for c in slower) if slower else ".")]
    return "\n".join(lines) + "\n"


def _best_vs_stock(cell: dict) -> Optional[float]:
    timed = cell["variants"]
    stock = timed.get("stock", {}).get("seconds")
    fp8 = [t["seconds"] for v, t in timed.items() if v.startswith("fp8") and t.get("seconds")]
    return stock / min(fp8) if stock and fp8 else None


def main(argv: Optional[list[str]] = None) -> Optional[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for decode_matrix.json and .md")
    parser.add_argument("--tiny", action="store_true", help="small shapes, any CPU")
    ints = lambda text: tuple(int(x) for x in text.split(","))
    parser.add_argument("--batches", type=ints, help="e.g. 1,64 (default the matrix's)")
    parser.add_argument("--contexts", type=ints, help="e.g. 384,8192")
    parser.add_argument("--archs", type=lambda t: t.split(","), default=list(ARCHS),
                        help="of mha,gqa,mqa")
    parser.add_argument("--variants", type=lambda t: [v.strip() for v in t.split(",")],
                        default=list(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=330.0,
                        help="seconds for the whole matrix; later cells are skipped")
    parser.add_argument("--table-from", type=Path, metavar="JSON",
                        help="write this report's cells into the rule's table and stop")
    parser.add_argument("--table", type=Path, default=attention_plan.TABLE_PATH,
                        help="the table --table-from writes")
    args = parser.parse_args(argv)
    if args.table_from is not None:
        section = attention_plan.section_from_report(json.loads(args.table_from.read_text()))
        attention_plan.write_section(section, args.table)
        print(f"wrote {len(section['entries'])} cells of {section['device']} to {args.table}")
        return None
    if args.out is None:
        parser.error("--out: required to run the matrix")
    for name, values, known in (("--archs", args.archs, ARCHS), ("--variants", args.variants,
                                                                 VARIANTS)):
        if not values or set(values) - set(known):
            parser.error(f"{name}: expected names among {', '.join(known)}, got "
                         f"{','.join(values)}")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if "stock" not in args.variants:
        args.variants = ["stock"] + args.variants  # every speed is against it
    return run_matrix(args, lambda report: timing.write_report(report, args.out,
                                                               "decode_matrix", render))


if __name__ == "__main__":
    main()
