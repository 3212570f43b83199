"""Timing the decode attention over a KV cache on this GPU, and `python -m jax_epilog.tune
--serving`'s attention part: `tune_attention` times the reads and layouts of an FP8 cache
(`planning.attention_plan`) for the user's own attention (query heads, key-value heads,
head_dim) at their batches and contexts, and writes each cell's fastest into the user's
decode-attention table, which `attention_plan.decode_plan` reads before the shipped one.

What one timed call runs (`benchmarks/decode_matrix.py` times the same over its matrix): a
layer's decode steps in a device loop, the cache donated and carried as a served model's
decode call carries it; each step writes one new key and value per sequence and attends over
the whole (full) cache, its query depending on the step before, so the steps run one after
the other. One step per call would time the host's dispatch instead. The variants:

- "stock": a bf16 cache `(batch, context, kv_heads, head_dim)` written by
  `lax.dynamic_update_slice` and read by `jax.nn.dot_product_attention` with a mask;
- "bf16": a bf16 cache through the library (`init_kv_cache`, `write_kv`, `decode_attention`);
- "fp8 READ LAYOUT": an FP8 cache through the library, read by READ in LAYOUT
  (`attention_plan.variant_name`).

A variant whose arrays would not fit the device's memory, or that fails to allocate, is
skipped and said so, never chosen.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_epilog.layers.decode_attention import decode_attention
from jax_epilog.layers.kv_cache import init_kv_cache, write_kv
from jax_epilog.planning import attention_plan
from jax_epilog.tools import timing

#: Every FP8 read and layout: what `tune_attention` chooses among.
FP8_VARIANTS = tuple(attention_plan.variant_name(read, layout) for read in attention_plan.READS
                     for layout in attention_plan.LAYOUTS)
VARIANTS = ("stock", "bf16") + FP8_VARIANTS
#: The share of the device's memory one variant's arrays may take.
MEMORY_SHARE = 0.85
#: `tune --serving`'s attention by default: Llama 3 8B's (32 query / 8 key-value heads of
#: 128), at decode batches 1, 16 and 64 over a 2k context.
SHAPE = (32, 8, 128)
BATCHES = (1, 16, 64)
CONTEXTS = (2048,)


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
        empty = jax.eval_shape(lambda: init_kv_cache(batch, context, kv_heads, head_dim,
                                                     jnp.bfloat16))
    else:
        empty = jax.eval_shape(lambda: init_kv_cache(
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
        cache = write_kv(cache, k, v, position)
        read = variant.split()[1] if variant != "bf16" else None
        return cache, decode_attention(q, cache, context, read=read)

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
    more: that shows as an allocation failure, and the variant is skipped then)."""
    return cache_bytes(variant, batch, context, kv_heads, head_dim) + \
        3 * 4 * batch * query_heads * context


def memory_limit() -> Optional[int]:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def time_variant(variant: str, arch: tuple[int, int], batch: int, context: int, head_dim: int,
                 steps: int, rounds: int, limit: Optional[int]) -> dict[str, Any]:
    """{"seconds": per decode step, ...} of one variant at one cell, or {"seconds": None,
    "skipped": why} where it does not fit `limit` bytes or runs out of memory."""
    query_heads, kv_heads = arch
    need = needed_bytes(variant, batch, context, kv_heads, query_heads, head_dim)
    if limit is not None and need > MEMORY_SHARE * limit:
        return {"seconds": None, "skipped": f"needs about {need / 2**30:.1f} GiB of "
                                            f"{limit / 2**30:.1f}"}
    q = filled_array((batch, 1, query_heads, head_dim), jnp.bfloat16, 0.1)
    k, v = (filled_array((batch, 1, kv_heads, head_dim), jnp.bfloat16, s) for s in (0.2, 0.4))
    start, chained = time.perf_counter(), None
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


def time_cell(shape: tuple[int, int, int], batch: int, context: int, *,
              variants: Sequence[str] = FP8_VARIANTS, steps: int = 8, rounds: int = 3,
              limit: Optional[int] = None) -> dict[str, Any]:
    """One cell as `benchmarks/decode_matrix.py` reports it (`attention_plan.entry_from_cell`
    reads it): its sizes and each of `variants`' times."""
    query_heads, kv_heads, head_dim = shape
    return {"query_heads": query_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "batch": batch, "context": context,
            "variants": {v: time_variant(v, (query_heads, kv_heads), batch, context, head_dim,
                                         steps, rounds, limit) for v in variants}}


def tune_attention(shape: tuple[int, int, int] = SHAPE, batches: Sequence[int] = BATCHES,
                   contexts: Sequence[int] = CONTEXTS, *, output: Optional[Path] = None,
                   device: Optional[str] = "auto", steps: int = 8, rounds: int = 3,
                   measure: Callable[..., dict] = time_cell) -> list[dict]:
    """Time every FP8 read and layout of an attention of `shape` (query heads, key-value
    heads, head_dim) at each batch and context, and merge each cell's entry into `output`
    (default: the user's decode-attention table, `attention_plan.user_table_path()`) as it is
    measured, under `device` ("auto": this host's CUDA GPU). `measure(shape, batch, context,
    steps=, rounds=, limit=)` -> a cell (`time_cell`; tests inject their own). Returns the
    entries; a cell where no variant ran is reported and not written."""
    shape, batches, contexts = check_shape(shape), check_sizes("batches", batches), \
        check_sizes("contexts", contexts)
    device = attention_plan.cuda_device() if device == "auto" else device
    if device is None:
        raise RuntimeError("jax_epilog.tune --serving's attention needs a CUDA GPU: JAX sees "
                           "none on this machine")
    path = Path(output) if output is not None else attention_plan.user_table_path()
    if path is None:
        raise ValueError("output: no table to write (set JAX_EPILOG_DECISIONS or HOME)")
    limit, entries, started = memory_limit(), [], time.perf_counter()
    source = f"python -m jax_epilog.tune --serving, jax {jax.__version__}"
    for context in contexts:
        for batch in batches:
            cell = measure(shape, batch, context, steps=steps, rounds=rounds, limit=limit)
            entry = attention_plan.entry_from_cell(cell)
            times = ", ".join(f"{name} {_us(t)}" for name, t in cell["variants"].items())
            if entry is None:
                print(f"attention {shape[0]}/{shape[1]} heads, batch {batch}, context "
                      f"{context}: nothing ran ({times})", flush=True)
                continue
            attention_plan.merge_entries(path, device, [entry], source)
            entries.append(entry)
            print(f"attention {shape[0]}/{shape[1]} heads, batch {batch}, context {context}: "
                  f"{times} -> {entry['read']} over {entry['layout']}", flush=True)
    print(f"tuned the decode attention at {len(entries)} cells in "
          f"{time.perf_counter() - started:.1f} s into {path}", flush=True)
    return entries


def _us(timed: dict) -> str:
    return f"{timed['seconds'] * 1e6:.1f} µs" if timed.get("seconds") else \
        f"skipped ({timed.get('skipped')})"


def check_shape(shape) -> tuple[int, int, int]:
    """(query heads, key-value heads, head_dim), the query heads a multiple of the key-value
    heads, or a ValueError naming the argument."""
    try:
        out = tuple(int(x) for x in shape)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or min(out) < 1 or out[0] % out[1]:
        raise ValueError(f"shape: expected (query heads, key-value heads, head_dim), positive, "
                         f"the query heads a multiple of the key-value heads, got {shape!r}")
    return out


def check_sizes(name: str, sizes) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in sizes)
    except (TypeError, ValueError):
        out = ()
    if not out or min(out) < 1:
        raise ValueError(f"{name}: expected positive ints, got {sizes!r}")
    return out


def parse_cells(attention: Optional[str], batches: Optional[str], contexts: Optional[str]):
    """`tune --serving`'s `--attention`, `--attention-batches` and `--attention-contexts` (each
    None for the default) as (shape, batches, contexts), or None for `--attention none`; a
    ValueError naming the option."""
    if (attention or "").lower() == "none":
        if batches or contexts:
            raise ValueError("--attention-batches and --attention-contexts need an attention: "
                             "not --attention none")
        return None
    shape = parse_shape(attention) if attention else SHAPE
    return shape, *(check_sizes(name, text.split(",") if text else default)
                    for name, text, default in (("--attention-batches", batches, BATCHES),
                                                ("--attention-contexts", contexts, CONTEXTS)))


def parse_shape(text: str) -> tuple[int, int, int]:
    """"32/8/128" -> (32, 8, 128): query heads / key-value heads / head_dim."""
    try:
        return check_shape(tuple(text.split("/")))
    except ValueError:
        raise ValueError(f"--attention: expected QUERY_HEADS/KV_HEADS/HEAD_DIM (e.g. 32/8/128), "
                         f"the query heads a multiple of the key-value heads, got "
                         f"{text!r}") from None
