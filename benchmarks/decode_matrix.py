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
Reported: microseconds per step (the median of `--rounds` rounds, `jax_epilog.tools.timing`)
and each variant's speed against stock. A cell whose cache does not fit the card's memory
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
import gc
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import timing  # benchmarks/timing.py
import jax_epilog
from jax_epilog.planning import attention_plan

ARCHS = {"mha": (32, 32), "gqa": (32, 8), "mqa": (32, 1)}
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (384, 2048, 8192)
HEAD_DIM = 128
TINY = dict(archs={"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}, batches=(1, 3),
            contexts=(33, 65), head_dim=16)
FP8_VARIANTS = tuple(attention_plan.variant_name(read, layout) for read in attention_plan.READS
                     for layout in attention_plan.LAYOUTS)
VARIANTS = ("stock", "bf16") + FP8_VARIANTS
#: The share of the card's memory a cell's arrays may take.
MEMORY_SHARE = 0.85


def filled(shape, dtype, seed: float):
    """An array of `shape` in `dtype` of varied values in [-1, 1], made on the device in one
    fused loop (random bits of a whole 8k-context cache would take twice its memory)."""
    x = sum(jax.lax.broadcasted_iota(jnp.float32, shape, axis) * (0.37 + 0.61 * axis + seed)
            for axis in range(len(shape)))
    return jnp.sin(x).astype(dtype)


#: `filled` as one program per shape (eagerly, each of its ops would compile on its own).
filled_array = jax.jit(filled, static_argnums=(0, 1, 2))


def make_cache(variant: str, batch: int, context: int, kv_heads: int, head_dim: int,
               query_heads: int):
    """The variant's cache, full of varied keys and values (FP8 scales about 1/100)."""
    if variant == "stock":
        shape = (batch, context, kv_heads, head_dim)
        return tuple(filled_array(shape, jnp.bfloat16, s) for s in (0.0, 0.5))
    if variant == "bf16":
        empty = jax.eval_shape(lambda: jax_epilog.init_kv_cache(
            batch, context, kv_heads, head_dim, jnp.bfloat16))
    else:
        empty = jax.eval_shape(lambda: jax_epilog.init_kv_cache(
            batch, context, kv_heads, head_dim, jnp.float8_e4m3fn, query_heads=query_heads,
            layout=variant.split()[2]))
    make = jax.jit(lambda: jax.tree.map(
        lambda a: filled(a.shape, a.dtype, 0.3) if a.dtype != jnp.float32 else
        0.01 + 0.005 * filled(a.shape, a.dtype, 0.7), empty))
    return make()


def step_function(variant: str, context: int, steps: int):
    """`(cache, q, k, v) -> (cache, q)`: `steps` decode steps, the cache donated."""
    position = context - 1  # the cache stays full: every step reads `context` positions

    def attend(cache, q, k, v):
        if variant == "stock":
            keys, values = cache
            keys = jax.lax.dynamic_update_slice(keys, k, (0, position, 0, 0))
            values = jax.lax.dynamic_update_slice(values, v, (0, position, 0, 0))
            mask = (jnp.arange(context) <= position)[None, None, None, :]
            return (keys, values), jax.nn.dot_product_attention(q, keys, values, mask=mask)
        cache = jax_epilog.write_kv(cache, k, v, position)
        read = variant.split()[1] if variant != "bf16" else None
        return cache, jax_epilog.decode_attention(q, cache, context, read=read)

    def run(cache, q, k, v):
        def body(_, carry):
            cache, q = carry
            cache, y = attend(cache, q, k, v)
            return cache, (q + 1e-3 * y).astype(q.dtype)
        return jax.lax.fori_loop(0, steps, body, (cache, q))

    return jax.jit(run, donate_argnums=0)


class Chained:
    """One timed call: the step on the cache the last call returned (donation consumes it)."""

    def __init__(self, step, cache, q, k, v):
        self.step, self.cache, self.q, self.kv = step, cache, q, (k, v)

    def __call__(self):
        self.cache, self.q = self.step(self.cache, self.q, *self.kv)
        return self.q


def cache_bytes(variant: str, batch: int, context: int, kv_heads: int, head_dim: int) -> int:
    values = 2 * batch * context * kv_heads * head_dim
    if variant in ("stock", "bf16"):
        return 2 * values
    return values + 2 * 4 * batch * context * kv_heads


def needed_bytes(variant: str, batch, context, kv_heads, query_heads, head_dim) -> int:
    """What a variant surely needs: its cache and the float32 scores and probabilities (a
    dot's 16-bit copy of an FP8 cache, where XLA does not fuse the convert into it, may need
    more: that shows as an allocation failure, and the cell is skipped then)."""
    return cache_bytes(variant, batch, context, kv_heads, head_dim) + \
        3 * 4 * batch * query_heads * context


def memory_limit() -> Optional[int]:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def measure(variant: str, arch: tuple[int, int], batch: int, context: int, head_dim: int,
            steps: int, rounds: int, limit: Optional[int]) -> dict[str, Any]:
    query_heads, kv_heads = arch
    need = needed_bytes(variant, batch, context, kv_heads, query_heads, head_dim)
    if limit is not None and need > MEMORY_SHARE * limit:
        return {"seconds": None, "skipped": f"needs about {need / 2**30:.1f} GiB of "
                                            f"{limit / 2**30:.1f}"}
    shape = (batch, 1, query_heads, head_dim)
    q = filled_array(shape, jnp.bfloat16, 0.1)
    k, v = (filled_array((batch, 1, kv_heads, head_dim), jnp.bfloat16, s) for s in (0.2, 0.4))
    start = time.perf_counter()
    try:
        step = step_function(variant, context, steps)
        chained = Chained(step, make_cache(variant, batch, context, kv_heads, head_dim,
                                           query_heads), q, k, v)
        timed = timing.time_calls(chained, [()], rounds=rounds, round_seconds=0.01,
                                  warmup_calls=1)
    except Exception as error:  # noqa: BLE001 (out of memory, or a compiler's refusal)
        if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error):
            raise
        return {"seconds": None, "skipped": "out of memory"}
    finally:
        chained = None
        gc.collect()
    return {"seconds": timed.seconds / steps, "rounds": [r / steps for r in timed.rounds],
            "steps_per_call": steps, "wall_s": time.perf_counter() - start,
            "cache_bytes": cache_bytes(variant, batch, context, kv_heads, head_dim)}


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
                        if time.perf_counter() > deadline else measure(
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
