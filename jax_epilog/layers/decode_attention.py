"""The attention of a decode step's queries over a `KVCache`: `decode_attention`.

Each sequence has its own length (prompts of different lengths, right-padded): query `i` of
`T` new ones in sequence `b` sits at position `lengths[b] - T + i` and sees the positions up
to its own, so the same compiled step serves every position and every mix of lengths.

A 16-bit cache is read by XLA's attention (`jax.nn.dot_product_attention`, which takes the
per-sequence mask; cuDNN's fused attention takes no arbitrary mask). An FP8 cache is read
in the FP8 bytes by one of two forms (`planning.attention_plan`: "reduce" or "dots"), chosen
per call by the measured rule unless `read=` says; several new tokens read by "dots".
Multi-head, grouped-query and multi-query attention alike: the query heads are grouped over
the cache's key/value heads, never the cache repeated.

Imports `layers.kv_cache` and `planning.attention_plan`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.layers.kv_cache import KVCache, per_sequence
from jax_epilog.planning.attention_plan import READS, decode_plan


def visible_positions(lengths, new: int, max_len: int):
    """`(batch, new, max_len)` booleans: query `i` of sequence `b` (at position
    `lengths[b] - new + i`) sees the cache positions up to its own."""
    query_positions = lengths[:, None] - new + jnp.arange(new)
    return jnp.arange(max_len)[None, None, :] <= query_positions[:, :, None]


def _reduce_positions_major(q, keys, values, key_scales, value_scales, visible, scale):
    """One query per sequence `(B, 1, H, D)` over keys and values `(B, L, kv, D)`, scales
    `(B, L, kv)`, `visible` `(B, L)`: multiply-reduces over the FP8 bytes."""
    batch, _, n_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    q = q.astype(jnp.float32).reshape(batch, 1, kv_heads, n_heads // kv_heads, head_dim)
    # (B, L, kv, group): each query head with its group's key head
    scores = jnp.sum(q * keys[:, :, :, None, :].astype(jnp.float32), axis=-1)
    scores = scores * (key_scales[..., None] * scale)
    scores = jnp.where(visible[:, :, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=1) * value_scales[..., None]
    y = jnp.sum(weights[..., None] * values[:, :, :, None, :].astype(jnp.float32), axis=1)
    return y.reshape(batch, 1, n_heads, head_dim)


def _reduce_heads_major(q, keys, values, key_scales, value_scales, visible, scale,
                        value_rows: bool):
    """`_reduce_positions_major` over keys `(B, kv, L, D)`, values `(B, kv, D, L)` (or
    `(B, kv, L, D)` with `value_rows`), scales `(B, kv, L)`: each reduction over the minor
    axis of what it reads."""
    batch, _, n_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    q = q.astype(jnp.float32).reshape(batch, kv_heads, n_heads // kv_heads, 1, head_dim)
    # (B, kv, group, L)
    scores = jnp.sum(q * keys[:, :, None].astype(jnp.float32), axis=-1)
    scores = scores * (key_scales[:, :, None] * scale)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1) * value_scales[:, :, None]
    if value_rows:  # (B, kv, group, L, 1) x (B, kv, 1, L, D), summed over L
        y = jnp.sum(weights[..., None] * values[:, :, None].astype(jnp.float32), axis=-2)
    else:
        y = jnp.sum(weights[:, :, :, None] * values[:, :, None].astype(jnp.float32), axis=-1)
    return y.reshape(batch, 1, n_heads, head_dim)


#: Each layout's key and value operands in `_dots`' einsums.
_KEYS = {"positions_major": "blkd", "heads_major": "bkld", "heads_major_rows": "bkld"}
_VALUES = {"positions_major": "blkd", "heads_major": "bkdl", "heads_major_rows": "bkld"}


def _dots(q, keys, values, key_scales, value_scales, visible, scale, layout: str):
    """`T` queries per sequence `(B, T, H, D)` as two batched dots over the FP8 cache
    converted where the dot reads it, the key scales multiplying the scores and the value
    scales the probabilities; `visible` `(B, T, L)`."""
    batch, new, n_heads, head_dim = q.shape
    kv_heads = keys.shape[2 if layout == "positions_major" else 1]
    dtype, group = q.dtype, n_heads // kv_heads
    t = "t" if new > 1 else ""  # one query: no axis for it, as a decode step's dot
    q = q.reshape(batch, new, kv_heads, group, head_dim)
    q = jnp.transpose(q, (0, 2, 3, 1, 4)) if new > 1 else q[:, 0]
    scores = jnp.einsum(f"bkg{t}d,{_KEYS[layout]}->bkg{t}l", q, keys.astype(dtype),
                        preferred_element_type=jnp.float32)
    if layout == "positions_major":  # (B, L, kv) -> (B, kv, L)
        key_scales, value_scales = (jnp.swapaxes(s, 1, 2) for s in (key_scales, value_scales))
    per_position = (lambda s: s[:, :, None, None]) if new > 1 else (lambda s: s[:, :, None])
    scores = scores * (per_position(key_scales) * scale)
    visible = visible[:, None, None] if new > 1 else visible[:, None, None, 0]
    scores = jnp.where(visible, scores, -jnp.inf)
    weights = (jax.nn.softmax(scores, axis=-1) * per_position(value_scales)).astype(dtype)
    y = jnp.einsum(f"bkg{t}l,{_VALUES[layout]}->bkg{t}d", weights, values.astype(dtype),
                   preferred_element_type=jnp.float32)
    if new > 1:
        y = jnp.transpose(y, (0, 3, 1, 2, 4))
    return y.reshape(batch, new, n_heads, head_dim)


def _check(q, cache: KVCache, layer, read) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a KVCache (init_kv_cache), got {type(cache).__name__}")
    shape = np.shape(q)
    if len(shape) != 4 or shape[0] != cache.batch or shape[3] != cache.head_dim or \
            shape[2] % cache.kv_heads or not 1 <= shape[1] <= cache.max_len:
        raise ValueError(f"q: expected (batch, new tokens, query heads, head_dim) with batch "
                         f"{cache.batch}, 1 to {cache.max_len} new tokens, a multiple of "
                         f"{cache.kv_heads} query heads and head_dim {cache.head_dim}, got "
                         f"{shape}")
    cache.check_layer(layer)
    if read is not None and read not in READS:
        raise ValueError(f"read: expected None (the measured rule) or one of {READS}, got "
                         f"{read!r}")


def decode_attention(q, cache: KVCache, lengths, *, layer=None, read: Optional[str] = None,
                     scale: Optional[float] = None):
    """Attention of `q` `(batch, T, query_heads, head_dim)` (RoPE applied, if used) over
    `cache` (of `layer`, for a cache of several layers), `(batch, T, query_heads, head_dim)`
    in `q`'s dtype. `lengths`: an int or `(batch,)`, each sequence's length with the `T` new
    tokens (already written by `write_kv`); it must be at least `T`. `read`: an FP8 cache's
    read form ("reduce" or "dots"), None for `attention_plan.decode_plan`'s choice; a 16-bit
    cache has one. `scale`: the scores' factor, default `1 / sqrt(head_dim)`."""
    _check(q, cache, layer, read)
    if layer is not None:
        cache = cache.layer(layer)
    batch, new, n_heads, head_dim = q.shape
    scale = float(1 / np.sqrt(head_dim) if scale is None else scale)
    lengths = per_sequence("lengths", lengths, batch,
                           "each sequence's length, the new tokens included")
    visible = visible_positions(jnp.broadcast_to(lengths, (batch,)), new, cache.max_len)
    with jax.named_scope("cached_attention"):
        if not cache.is_fp8:
            return jax.nn.dot_product_attention(
                q, cache.keys.astype(q.dtype), cache.values.astype(q.dtype),
                mask=visible[:, None], scale=scale, implementation="xla")
        if read is None:
            read = decode_plan(n_heads, cache.kv_heads, batch, cache.max_len,
                               layout=cache.layout, head_dim=head_dim).read
        arrays = (cache.keys, cache.values, cache.key_scales, cache.value_scales)
        if new > 1 or read == "dots":
            y = _dots(q, *arrays, visible, scale, cache.layout)
        elif cache.layout == "positions_major":
            y = _reduce_positions_major(q, *arrays, visible[:, 0], scale)
        else:
            y = _reduce_heads_major(q, *arrays, visible[:, 0], scale,
                                    cache.layout == "heads_major_rows")
    return y.astype(q.dtype)
