"""A key/value cache for autoregressive decoding: `KVCache`, `init_kv_cache`, `write_kv`.

The cache holds each sequence's keys and values of one attention layer, or of every layer with
a leading layers axis (`layers=`), in a 16-bit dtype or in FP8 (float8_e4m3fn or e5m2). An FP8
cache stores each key or value vector (one head at one position) with a float32 scale of its
own, the vector's amax over the format's largest value (current scaling, set when the vector
is written: nothing to calibrate, nothing to drift), as TensorRT-LLM's and vLLM's FP8 caches
do with a scale per tensor or head; a byte a value plus 4 bytes a vector.

An FP8 cache is laid out one of three ways (`LAYOUTS`; a 16-bit cache is always
"positions_major"):

- "positions_major": keys and values `(batch, max_len, kv_heads, head_dim)`, scales
  `(batch, max_len, kv_heads)`, the order a prefill writes them in;
- "heads_major": keys `(batch, kv_heads, max_len, head_dim)`, values
  `(batch, kv_heads, head_dim, max_len)`, scales `(batch, kv_heads, max_len)`: each head's
  positions together, the values with the positions minor, the order a decode step's
  reductions read them in, so XLA need not transpose the cache around a decode loop;
- "heads_major_rows": as "heads_major" with the values stored as the keys, one row a position.

Which layout a cache gets by default is `planning.attention_plan`'s rule; `layout=` overrides.

Every write is one `dynamic_update_slice` of each whole array (a scatter where each sequence
writes at its own position), so a cache passed to a jitted function with
`donate_argnums` is updated in place, never copied. The functions take and return plain
arrays in a pytree (`KVCache`, its layout static), so they work in any attention module: keep
the cache in an `nnx.Variable` or Linen's "cache" collection (docs/kv_cache.md).

Imports only JAX and `planning.attention_plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.planning.attention_plan import LAYOUTS, decode_plan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # arrays: no elementwise ==, no hash of them
class KVCache:
    """Keys and values (see the module for their shapes per `layout`), with a leading
    `(layers,)` axis on every array when the cache holds several layers; for FP8 `key_scales`
    and `value_scales` float32, a stored vector times its scale being its value. Positions not
    yet written hold zeros (scale 1); attention masks them by each sequence's length."""

    keys: jax.Array
    values: jax.Array
    key_scales: Optional[jax.Array] = None
    value_scales: Optional[jax.Array] = None
    layout: str = dataclasses.field(default="positions_major", metadata={"static": True})

    @property
    def is_fp8(self) -> bool:
        return self.key_scales is not None

    @property
    def layered(self) -> bool:
        """Whether the arrays hold every layer (a leading layers axis)."""
        return self.keys.ndim == 5

    @property
    def layers(self) -> Optional[int]:
        return self.keys.shape[0] if self.layered else None

    def _dims(self) -> tuple[int, int, int, int]:
        """(batch, max_len, kv_heads, head_dim)."""
        batch, a, b, head_dim = self.keys.shape[-4:]
        return (batch, a, b, head_dim) if self.layout == "positions_major" else \
            (batch, b, a, head_dim)

    @property
    def batch(self) -> int:
        return self._dims()[0]

    @property
    def max_len(self) -> int:
        return self._dims()[1]

    @property
    def kv_heads(self) -> int:
        return self._dims()[2]

    @property
    def head_dim(self) -> int:
        return self._dims()[3]

    @property
    def nbytes(self) -> int:
        """Bytes in memory, the scales included."""
        return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
                   for leaf in jax.tree.leaves(self))

    def arrays(self) -> tuple:
        """(keys, values, key_scales, value_scales), the scales None for a 16-bit cache."""
        return self.keys, self.values, self.key_scales, self.value_scales

    def check_layer(self, layer) -> None:
        """`layer` must be an int (may be traced) for a layered cache, None for one layer."""
        if self.layered == (layer is None):
            raise ValueError("layer: expected an int for a cache of several layers, None for "
                             f"a cache of one; got {layer!r} for a cache of "
                             f"{self.layers or 1} layer(s)")

    def layer(self, index) -> "KVCache":
        """One layer's cache of a layered cache (`index` may be traced)."""
        if not self.layered:
            raise ValueError("layer: this cache holds one layer (no leading layers axis); "
                             "pass layer=None")
        return KVCache(*(None if a is None else a[index] for a in self.arrays()),
                       layout=self.layout)


def is_fp8(dtype) -> bool:
    """Whether a cache in `dtype` is stored scaled, one byte a value."""
    return jnp.dtype(dtype).itemsize == 1


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def init_kv_cache(batch: int, max_len: int, kv_heads: int, head_dim: int,
                  dtype=jnp.bfloat16, *, layers: Optional[int] = None,
                  query_heads: Optional[int] = None, layout: Optional[str] = None) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` positions, `kv_heads` key/value
    heads of `head_dim`, in `dtype` (16-bit, float32, or FP8: scaled per vector), holding
    `layers` layers (a leading axis) or one (None). `layout`: an FP8 cache's (`LAYOUTS`), by
    default the rule's choice for `query_heads` query heads (default `kv_heads`) at this
    batch and length; a 16-bit cache is "positions_major"."""
    batch, max_len, kv_heads, head_dim = (_positive(n, v) for n, v in (
        ("batch", batch), ("max_len", max_len), ("kv_heads", kv_heads),
        ("head_dim", head_dim)))
    if layers is not None:
        _positive("layers", layers)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype: expected a floating-point cache dtype, got {dtype!r}")
    query_heads = kv_heads if query_heads is None else _positive("query_heads", query_heads)
    if query_heads % kv_heads:
        raise ValueError(f"query_heads: expected a multiple of kv_heads ({kv_heads}), got "
                         f"{query_heads}")
    lead = () if layers is None else (layers,)
    if not is_fp8(dtype):
        if layout not in (None, "positions_major"):
            raise ValueError(f"layout: a {jnp.dtype(dtype).name} cache is 'positions_major' "
                             f"only, got {layout!r} (the other layouts are FP8's)")
        shape = lead + (batch, max_len, kv_heads, head_dim)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    if layout is None:
        layout = decode_plan(query_heads, kv_heads, batch, max_len, head_dim=head_dim).layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "positions_major":
        keys = values = lead + (batch, max_len, kv_heads, head_dim)
        scales = lead + (batch, max_len, kv_heads)
    else:
        keys = values = lead + (batch, kv_heads, max_len, head_dim)
        if layout == "heads_major":
            values = lead + (batch, kv_heads, head_dim, max_len)
        scales = lead + (batch, kv_heads, max_len)
    # four arrays, not one array twice: the cache is donated
    return KVCache(jnp.zeros(keys, dtype), jnp.zeros(values, dtype),
                   jnp.ones(scales, jnp.float32), jnp.ones(scales, jnp.float32), layout=layout)


def quantize_vectors(x, dtype):
    """(`x` in FP8 `dtype`, float32 scales `x.shape[:-1]`): each last-axis vector (a head's
    key or value) scaled so that its amax is the format's largest value; an all-zero vector
    gets scale 1."""
    largest = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scales = jnp.where(amax > 0, amax * (1 / largest), 1.0)  # XLA multiplies either way
    return jnp.clip(x / scales[..., None], -largest, largest).astype(dtype), scales


def _check_kv(cache: KVCache, keys, values) -> None:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected a KVCache (init_kv_cache), got {type(cache).__name__}")
    want = (cache.batch, cache.kv_heads, cache.head_dim)
    for name, x in (("keys", keys), ("values", values)):
        shape = np.shape(x)
        if len(shape) != 4 or (shape[0], shape[2], shape[3]) != want or shape[1] < 1:
            raise ValueError(f"{name}: expected (batch, new positions, kv_heads, head_dim) = "
                             f"({want[0]}, T, {want[1]}, {want[2]}), got {shape}")
        if shape[1] > cache.max_len:
            raise ValueError(f"{name}: {shape[1]} new positions do not fit the cache's "
                             f"max_len {cache.max_len}")
    if np.shape(keys) != np.shape(values):
        raise ValueError(f"values: expected the keys' shape {np.shape(keys)}, got "
                         f"{np.shape(values)}")


def per_sequence(name: str, value, batch: int, what: str):
    """`value` as int32, a scalar (one for every sequence) or `(batch,)` (`what` each
    sequence's value is, for the error)."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer) or value.shape not in ((), (batch,)):
        raise ValueError(f"{name}: expected an int or an int array of shape ({batch},) "
                         f"({what}), got {value.dtype} {value.shape}")
    return value.astype(jnp.int32)


def write_kv(cache: KVCache, keys, values, positions, *, layer=None) -> KVCache:
    """`cache` with `keys` and `values` `(batch, T, kv_heads, head_dim)` (RoPE already applied
    to the keys, if the model uses it) written at positions `positions ... positions + T - 1`:
    `positions` an int for every sequence or `(batch,)` for each its own; `layer` (an int,
    may be traced) the layer of a layered cache. Keep `positions + T <= max_len`: past it,
    one position for every sequence is moved back to fit (as `dynamic_update_slice` does),
    and a sequence's own positions are dropped. Pass the cache donated to the jitted caller
    to update it in place."""
    _check_kv(cache, keys, values)
    cache.check_layer(layer)
    positions = per_sequence("positions", positions, cache.batch,
                             "each sequence's first new position")
    with jax.named_scope("kv_cache"):
        if cache.is_fp8:
            (keys, key_scales), (values, value_scales) = (
                quantize_vectors(x, cache.keys.dtype) for x in (keys, values))
        else:
            key_scales = value_scales = None
        if cache.layout != "positions_major":
            # (B, T, kv, ...) -> (B, kv, T, ...): this step's few vectors move, never the cache
            keys, key_scales, value_scales = (jnp.swapaxes(x, 1, 2) for x in (
                keys, key_scales, value_scales))
            values = jnp.swapaxes(values, 1, 2) if cache.layout == "heads_major_rows" else \
                jnp.transpose(values, (0, 2, 3, 1))
        position_axis = 1 if cache.layout == "positions_major" else 2
        parts = (keys, values, key_scales, value_scales)
        axes = (position_axis, 3 if cache.layout == "heads_major" else position_axis,
                position_axis, position_axis)
        return KVCache(*(None if whole is None else _put(whole, part, axis, positions, layer)
                         for whole, part, axis in zip(cache.arrays(), parts, axes)),
                       layout=cache.layout)


def _put(whole, part, axis: int, positions, layer):
    """`whole` with `part` (one layer's, no layers axis) at `positions` on `axis` (of the
    layer's array) of `layer`: one `dynamic_update_slice`, or a scatter of one per sequence
    where `positions` is `(batch,)`."""
    part = part.astype(whole.dtype)
    if positions.ndim == 0:
        at = [0] * part.ndim
        at[axis] = positions
        if layer is None:
            return jax.lax.dynamic_update_slice(whole, part, at)
        return jax.lax.dynamic_update_slice(whole, part[None], [layer] + at)
    # each sequence at its own position: a scatter into the whole array (in place, donated)
    length = part.shape[axis]
    rows = jnp.arange(part.shape[0])[:, None]
    at = (rows,) + (slice(None),) * (axis - 1) + (positions[:, None] + jnp.arange(length),)
    part = jnp.moveaxis(part, axis, 1)  # (B, T, ...): NumPy's order for these indices
    if layer is not None:
        at = (layer,) + at
    return whole.at[at].set(part, mode="drop")
