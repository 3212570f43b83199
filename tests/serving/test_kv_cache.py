"""The library's KV cache (`jax_epilog.KVCache`, `init_kv_cache`, `write_kv`,
`decode_attention`) against a float64 NumPy attention: MHA, GQA and MQA, head_dim 64 and 128,
sequences of lengths 1, 127, 129 and 8193 side by side, one and several new tokens, FP8 in
every layout and bf16; the two FP8 read forms; the in-place update under jit; the rule that
picks the read form; and the errors for bad input."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_epilog
from jax_epilog.planning import attention_plan

FP8 = jnp.float8_e4m3fn


def reference_attention(q, keys, values, lengths):
    """float64 attention of `q` `(B, T, H, D)` over `keys`, `values` `(B, L, kv, D)`: query
    `i` of sequence `b` sees positions up to `lengths[b] - T + i`."""
    q, keys, values = (np.asarray(x, np.float64) for x in (q, keys, values))
    batch, new, heads, dim = q.shape
    group = heads // keys.shape[2]
    keys, values = (np.repeat(x, group, axis=2) for x in (keys, values))
    scores = np.einsum("bthd,blhd->bhtl", q, keys) / np.sqrt(dim)
    last = np.asarray(lengths)[:, None] - new + np.arange(new)  # (B, T)
    visible = np.arange(keys.shape[1])[None, None] <= last[:, :, None]
    scores = np.where(visible[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhtl,blhd->bthd", weights, values)


def stored(cache):
    """(keys, values) a one-layer cache holds, dequantized, `(B, L, kv, D)` float64."""
    f64 = lambda x: np.asarray(np.asarray(x).astype(np.float32), np.float64)
    keys, values = f64(cache.keys), f64(cache.values)
    if cache.is_fp8:
        keys = keys * f64(cache.key_scales)[..., None]
        values = values * (f64(cache.value_scales)[:, :, None] if cache.layout == "heads_major"
                           else f64(cache.value_scales)[..., None])
    if cache.layout != "positions_major":
        keys = np.swapaxes(keys, 1, 2)
        values = np.transpose(values, (0, 3, 1, 2)) if cache.layout == "heads_major" else \
            np.swapaxes(values, 1, 2)
    return keys, values


def normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


#: (query heads, kv heads, head_dim, new tokens): MQA, GQA, MHA.
CASES = [(4, 1, 64, 1), (6, 2, 128, 3), (3, 3, 64, 2)]
#: Each sequence's prompt: one empty (its first token is new), and 126 and 128 positions, so
#: that the sequences' lengths after one new token are 1, 127 and 129.
PROMPTS = np.array([0, 126, 128])


@pytest.mark.parametrize("query_heads, kv_heads, head_dim, new", CASES,
                         ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("dtype, layout", [
    (jnp.bfloat16, None), (FP8, "positions_major"), (FP8, "heads_major"),
    (FP8, "heads_major_rows")], ids=["bf16", "fp8_positions", "fp8_heads", "fp8_rows"])
def test_decode_attention_is_the_float64_attention_of_what_the_cache_holds(
        query_heads, kv_heads, head_dim, new, dtype, layout):
    check_against_float64(query_heads, kv_heads, head_dim, new, dtype, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, layout", [(jnp.bfloat16, None), (FP8, "heads_major"),
                                           (FP8, "heads_major_rows")])
def test_decode_attention_on_the_gpu_is_the_float64_attention(dtype, layout):
    with jax.default_device(jax.devices("cuda")[0]):
        check_against_float64(6, 2, 128, 1, dtype, layout)
        check_against_float64(4, 1, 64, 3, dtype, layout)


def check_against_float64(query_heads, kv_heads, head_dim, new, dtype, layout):
    """Right-padded prompts of `PROMPTS`' lengths and `new` tokens each written into a cache
    and attended to, by both read forms, against the float64 attention."""
    rng = np.random.default_rng(query_heads * 10 + new)
    batch, max_len = len(PROMPTS), int(PROMPTS.max()) + new
    prompt_k, prompt_v = (normal(rng, batch, 128, kv_heads, head_dim) for _ in range(2))
    new_k, new_v = (normal(rng, batch, new, kv_heads, head_dim) for _ in range(2))
    q = normal(rng, batch, new, query_heads, head_dim)
    lengths = jnp.asarray(PROMPTS + new, jnp.int32)

    @jax.jit
    def step(cache):
        # a right-padded prefill for every sequence, then each one's new tokens at its length
        cache = jax_epilog.write_kv(cache, prompt_k, prompt_v, 0)
        cache = jax_epilog.write_kv(cache, new_k, new_v, jnp.asarray(PROMPTS, jnp.int32))
        return cache, {read: jax_epilog.decode_attention(q, cache, lengths, read=read)
                       for read in attention_plan.READS}

    cache = jax_epilog.init_kv_cache(batch, max_len, kv_heads, head_dim, dtype,
                                     query_heads=query_heads, layout=layout)
    with jax.default_matmul_precision("highest"):
        cache, out = step(cache)
    assert cache.layout == (layout or "positions_major")
    keys, values = stored(cache)
    expected = reference_attention(q, keys, values, lengths)
    for read, y in out.items():
        assert y.shape == q.shape and y.dtype == q.dtype
        np.testing.assert_allclose(y, expected, rtol=2e-5, atol=2e-5, err_msg=read)
    np.testing.assert_allclose(out["dots"], out["reduce"], rtol=2e-5, atol=2e-5)
    # what the cache holds is what was written, to the dtype's rounding
    truth_k, truth_v = _written(prompt_k, new_k, max_len), _written(prompt_v, new_v, max_len)
    error = np.abs(keys - truth_k).max() / np.abs(truth_k).max()
    assert 0 < error < (0.07 if dtype == FP8 else 0.005)
    # and the attention of the exact keys and values differs from it by that rounding only
    exact = reference_attention(q, truth_k, truth_v, lengths)
    assert np.abs(out["dots"] - exact).max() < (0.1 if dtype == FP8 else 0.02)


def _written(prompt, new, max_len):
    """The exact `(B, max_len, kv, D)` array the two writes of the test above make."""
    whole = np.zeros((prompt.shape[0], max_len) + prompt.shape[2:], np.float32)
    whole[:, :prompt.shape[1]] = prompt
    whole[np.arange(len(PROMPTS))[:, None], PROMPTS[:, None] + np.arange(new.shape[1])] = new
    return whole


@pytest.mark.parametrize("read", attention_plan.READS)
def test_a_long_fp8_cache_of_8193_positions(read):
    rng = np.random.default_rng(8)
    length, heads, dim = 8193, 3, 64
    k, v = (normal(rng, 1, length, 1, dim) for _ in range(2))
    q = normal(rng, 1, 1, heads, dim)
    step = jax.jit(lambda cache: (lambda c: (c, jax_epilog.decode_attention(
        q, c, length, read=read)))(jax_epilog.write_kv(cache, k, v, 0)))
    cache, y = step(jax_epilog.init_kv_cache(1, length, 1, dim, FP8, query_heads=heads,
                                             layout="heads_major"))
    np.testing.assert_allclose(y, reference_attention(q, *stored(cache), [length]),
                               rtol=2e-5, atol=2e-5)


def test_a_layered_cache_writes_and_reads_one_layer():
    rng = np.random.default_rng(2)
    cache = jax_epilog.init_kv_cache(2, 9, 2, 16, FP8, layers=3, query_heads=4,
                                     layout="heads_major")
    assert (cache.layers, cache.batch, cache.max_len, cache.kv_heads, cache.head_dim) == \
        (3, 2, 9, 2, 16)
    k, v = (normal(rng, 2, 5, 2, 16) for _ in range(2))
    q = normal(rng, 2, 1, 4, 16)
    step = jax.jit(lambda c, layer: (lambda c: (c, jax_epilog.decode_attention(
        q, c, 5, layer=layer)))(jax_epilog.write_kv(c, k, v, 0, layer=layer)))
    written, y = step(cache, 1)
    for name in ("keys", "values", "key_scales", "value_scales"):
        before, after = (np.asarray(getattr(c, name), np.float32) for c in (cache, written))
        np.testing.assert_array_equal(np.delete(after, 1, 0), np.delete(before, 1, 0))
        assert not np.array_equal(after[1], before[1])
    np.testing.assert_allclose(y, reference_attention(q, *stored(written.layer(1)), [5, 5]),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype, layout, positions", [
    (jnp.bfloat16, None, 3), (FP8, "heads_major", 3), (FP8, "heads_major", [3, 0])])
def test_a_donated_cache_is_updated_in_place(dtype, layout, positions):
    cache = jax_epilog.init_kv_cache(2, 64, 2, 32, dtype, layers=2, layout=layout)
    k = v = jnp.ones((2, 1, 2, 32), jnp.float32)
    write = jax.jit(lambda c: jax_epilog.write_kv(c, k, v, jnp.asarray(positions), layer=1),
                    donate_argnums=0)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(cache)]
    out = write(cache)
    assert all(a.is_deleted() for a in jax.tree.leaves(cache))
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(out)] == pointers
    text = write.lower(out).compile().as_text()
    assert "copy(" not in text.split("ENTRY")[1]  # no copy of the cache, only its update
    at = (1, 0, 3, 0, 0) if out.layout == "positions_major" else (1, 0, 0, 3, 0)
    assert float(np.asarray(out.keys[at], np.float32)) != 0


def test_the_rule_reads_the_table_nearest_cell_first(tmp_path):
    plan = attention_plan.decode_plan
    assert plan(32, 8, 64, 384, device=None) == attention_plan.constant_plan(32, 8)
    assert plan(32, 32, 64, 384, device=None)[:2] == ("dots", "heads_major")
    seeded = attention_plan.read_table()[0]
    device = seeded["device"]
    assert seeded["measured"]  # the shipped section is a matrix's run
    cells = {(e["query_heads"] // e["kv_heads"], e["batch"], e["context"]): e
             for e in seeded["entries"]}

    def shipped(group, batch, context):
        return cells[group, batch, context]["read"], cells[group, batch, context]["layout"]
    # the nearest cell decides: the nearest group, then the nearest batch and context
    assert plan(32, 8, 64, 8192, device=device)[:2] == shipped(4, 64, 384)
    assert plan(32, 1, 256, 384, device=device)[:2] == shipped(32, 16, 384)
    assert plan(32, 2, 100, 384, device=device)[:2] == shipped(32, 16, 384)  # group 16: MQA's
    assert plan(32, 32, 64, 384, device="another GPU")[:2] == shipped(1, 64, 384)
    # a table made from a benchmark report: each cell's fastest FP8 variant decides
    name = attention_plan.variant_name
    cell = {"query_heads": 32, "kv_heads": 8, "head_dim": 128, "batch": 16, "context": 2048}
    times = {"stock": 2.0, name("reduce", "heads_major"): 1.5, name("dots", "heads_major"): 1.0,
             name("reduce", "positions_major"): 0.8, name("dots", "positions_major"): 0.9}
    report = {"meta": {"device": "GPU X", "commit": "abc", "jax": jax.__version__,
                       "date": "today", "command": "decode_matrix.py"},
              "cells": [cell | {"variants": {k: {"seconds": s} for k, s in times.items()}},
                        cell | {"batch": 64, "variants": {"stock": {"seconds": None}}}]}
    path = tmp_path / "decode.json"
    attention_plan.write_section(attention_plan.section_from_report(report), path)
    attention_plan.write_section(dict(seeded, device="GPU Y"), path)
    sections = json.loads(path.read_text())["sections"]
    assert [s["device"] for s in sections] == ["GPU Y", "GPU X"]
    assert len(sections[1]["entries"]) == 1 and sections[1]["measured"]
    assert plan(32, 8, 16, 2048, device="GPU X", path=path)[:2] == ("reduce", "positions_major")
    # a cache made in another layout: the fastest read measured in that layout
    assert plan(32, 8, 16, 2048, device="GPU X", path=path, layout="heads_major").read == "dots"


def test_the_default_layout_and_read_follow_the_rule():
    mqa = jax_epilog.init_kv_cache(2, 16, 1, 8, FP8, query_heads=4)
    assert mqa.layout == attention_plan.decode_plan(4, 1, 2, 16).layout
    assert jax_epilog.init_kv_cache(2, 16, 1, 8, jnp.bfloat16).layout == "positions_major"


def test_a_cache_in_nnx_and_linen_state():
    nnx = pytest.importorskip("flax.nnx")

    class Attention(nnx.Module):
        def __init__(self):
            self.cache = nnx.Cache(jax_epilog.init_kv_cache(2, 8, 1, 4, FP8, query_heads=2))

        def __call__(self, q, k, v, position):
            self.cache.set_value(jax_epilog.write_kv(self.cache.get_value(), k, v, position))
            return jax_epilog.decode_attention(q, self.cache.get_value(), position + 1)

    module, rng = Attention(), np.random.default_rng(3)
    q, k, v = normal(rng, 2, 1, 2, 4), normal(rng, 2, 1, 1, 4), normal(rng, 2, 1, 1, 4)
    y = nnx.jit(lambda m, *args: m(*args))(module, q, k, v, 0)
    # one position: the attention is that position's value, to its FP8 rounding
    np.testing.assert_allclose(y, np.repeat(np.asarray(v), 2, axis=2), rtol=0.07, atol=0.07)
    assert isinstance(module.cache.get_value(), jax_epilog.KVCache)
    assert np.asarray(module.cache.get_value().keys).astype(np.float32).any()

    nn = pytest.importorskip("flax.linen")

    class LinenAttention(nn.Module):
        @nn.compact
        def __call__(self, q, k, v, position):
            cache = self.variable("cache", "kv", jax_epilog.init_kv_cache, 2, 8, 1, 4, FP8,
                                  query_heads=2)
            cache.value = jax_epilog.write_kv(cache.value, k, v, position)
            return jax_epilog.decode_attention(q, cache.value, position + 1)

    linen = LinenAttention()
    variables = linen.init(jax.random.key(0), q, k, v, 0)
    y_linen, state = jax.jit(lambda variables, *args: linen.apply(
        variables, *args, mutable=["cache"]))(variables, q, k, v, 0)
    np.testing.assert_array_equal(y_linen, y)
    assert isinstance(state["cache"]["kv"], jax_epilog.KVCache)


def test_bad_input_names_the_argument():
    cache = jax_epilog.init_kv_cache(2, 8, 2, 4, FP8, query_heads=4)
    k = jnp.ones((2, 1, 2, 4))
    q = jnp.ones((2, 1, 4, 4))
    errors = [
        (lambda: jax_epilog.init_kv_cache(2, 8, 2, 4, jnp.int8), "dtype: expected a floating"),
        (lambda: jax_epilog.init_kv_cache(0, 8, 2, 4), "batch: expected an int >= 1"),
        (lambda: jax_epilog.init_kv_cache(2, 8, 2, 4, query_heads=3), "query_heads: expected "
                                                                       "a multiple of kv_heads"),
        (lambda: jax_epilog.init_kv_cache(2, 8, 2, 4, layout="heads_major"),
         "layout: a bfloat16 cache is 'positions_major' only"),
        (lambda: jax_epilog.init_kv_cache(2, 8, 2, 4, FP8, layout="rows"), "layout: expected"),
        (lambda: jax_epilog.write_kv(cache, jnp.ones((2, 1, 3, 4)), k, 0), "keys: expected"),
        (lambda: jax_epilog.write_kv(cache, k, jnp.ones((2, 2, 2, 4)), 0), "values: expected"),
        (lambda: jax_epilog.write_kv(cache, jnp.ones((2, 9, 2, 4)), jnp.ones((2, 9, 2, 4)), 0),
         "keys: 9 new positions do not fit"),
        (lambda: jax_epilog.write_kv(cache, k, k, jnp.zeros(3, jnp.int32)), "positions: expected"),
        (lambda: jax_epilog.write_kv(cache, k, k, 0, layer=0), "layer: expected an int for"),
        (lambda: jax_epilog.write_kv(cache.keys, k, k, 0), "cache: expected a KVCache"),
        (lambda: jax_epilog.decode_attention(jnp.ones((2, 1, 3, 4)), cache, 1), "q: expected"),
        (lambda: jax_epilog.decode_attention(q, cache, 1.0), "lengths: expected"),
        (lambda: jax_epilog.decode_attention(q, cache, 1, read="flash"), "read: expected"),
        (lambda: cache.layer(0), "layer: this cache holds one layer"),
    ]
    for call, message in errors:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


def test_quantize_vectors_gives_each_vector_the_formats_largest_value():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 16)) * 10.0 ** rng.integers(-3, 3, (3, 5, 1))
    x[1, 2] = 0
    stored_x, scales = jax_epilog.layers.kv_cache.quantize_vectors(jnp.asarray(x), FP8)
    largest = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    values = np.asarray(stored_x).astype(np.float32)
    assert np.all(np.abs(values).max(-1)[np.abs(x).max(-1) > 0] == largest)
    assert not values[1, 2].any() and scales[1, 2] == 1
    np.testing.assert_allclose(values * np.asarray(scales)[..., None], x, rtol=0.07,
                               atol=1e-30)
