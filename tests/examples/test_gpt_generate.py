"""The GPT example's serving script (examples/gpt/generate.py, decode.py) on the CPU, `tiny`:
the cached forward against the model's full one, greedy and sampled generation, the three
variants, restoring a checkpoint train.py wrote, and the errors for bad input."""

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

for needed in ("flax", "optax", "tqdm"):  # the example's own requirements
    pytest.importorskip(needed)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from flax import nnx  # noqa: E402

import jax_epilog  # noqa: E402
from jax_epilog.planning.serving_plan import serving_way  # noqa: E402

from gpt import configs, data, decode, generate, generate_bench, train  # noqa: E402
from jaxprs import traced_equations  # noqa: E402

TINY = configs.get("tiny").replace(n_layers=1)  # one block: compiles in half the time
LLAMA_TINY = configs.get("llama_tiny").replace(n_layers=1)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def tiny_weights(tie_head=True, seed=0, config=TINY):
    """`config`'s (`tiny`'s) seed weights moved off their initialisation (nonzero biases, norms
    not 1), as trained ones are."""
    config = config.replace(tie_head=tie_head)
    rng = np.random.default_rng(seed)
    weights = generate.serving_weights(config, None, jnp.float32)
    return config, jax.tree.map(lambda p: jnp.asarray(
        p + 0.05 * rng.standard_normal(p.shape), p.dtype), weights)


def jitted(cached, read=None):
    """(the full forward, the cached forward `(tokens, cache, start, fresh=False)`) of
    `cached`, jitted, an FP8 cache read by `read` (None: the library's rule): eagerly, every
    op of each new shape compiles on its own, many times slower here."""
    graphdef, state = nnx.split(cached)
    full = jax.jit(lambda s, tokens: nnx.merge(graphdef, s)(tokens))
    step = jax.jit(lambda s, tokens, cache, start, fresh: nnx.merge(graphdef, s)(
        tokens, cache, start, fresh=fresh, read=read), static_argnums=4)
    return (lambda tokens: full(state, tokens),
            lambda tokens, cache, start, fresh=False: step(state, tokens, cache,
                                                           jnp.int32(start), fresh))


def cached_logits(cached, tokens, pieces, cache_dtype=jnp.float32, fresh: bool = False,
                  read=None, layout=None):
    """The logits of `tokens` fed to the cached forward in `pieces` (lengths), teacher
    forced: a prefill (`fresh`: as the Generator's, over the prompt itself), then shorter
    steps; an FP8 cache in `layout` read by `read` (None: the library's rule)."""
    _, step = jitted(cached, read)
    cache = decode.init_cache(cached.model.config, tokens.shape[0], tokens.shape[1],
                              cache_dtype, layout)
    out, start = [], 0
    for length in pieces:
        logits, cache = step(tokens[:, start:start + length], cache, start, fresh and start == 0)
        out.append(logits)
        start += length
    assert start == tokens.shape[1]
    return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("impl, tie_head, base", [
    ("stock", True, TINY), ("stock", False, TINY), ("epilog", True, TINY),
    ("stock", False, LLAMA_TINY),  # Llama: RoPE at the cache positions, 2 key/value heads
    ("epilog", False, LLAMA_TINY)])  # and jax_epilog's SwiGLU block
def test_cached_forward_equals_the_full_forward_teacher_forced(corpus, impl, tie_head, base):
    config, weights = tiny_weights(tie_head, config=base)
    cached = decode.CachedGPT(generate.model_with(config, impl, weights, jnp.float32))
    tokens = jnp.asarray(generate.prompts_from(corpus.validation, 3, 40))
    with jax.default_matmul_precision("highest"):
        full = jitted(cached)[0](tokens)
        stepped = cached_logits(cached, tokens, [17, 5] + [1] * 6 + [12])
        # the Generator's prefill: the prompt attends to itself, then steps read the cache
        fresh = cached_logits(cached, tokens, [17, 5] + [1] * 6 + [12], fresh=True)
    assert stepped.shape == full.shape == (3, 40, 256)
    np.testing.assert_allclose(stepped, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fresh, full, rtol=1e-5, atol=1e-5)
    # A cache written at other positions does not leak into these: the mask hides it.
    cache = decode.init_cache(config.model, 3, 48, jnp.float32)
    cache = decode.KVCache(cache.keys + 7.0, cache.values - 3.0)
    with jax.default_matmul_precision("highest"):
        logits, _ = jitted(cached)[1](tokens, cache, 0)
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


def test_quantize_vectors_is_the_reference_per_head_vector():
    rng = np.random.default_rng(1)
    # head vectors of very different sizes, one all zero
    x = rng.standard_normal((3, 5, 2, 16)) * 10.0 ** rng.integers(-3, 3, (3, 5, 2, 1))
    x[1, 2, 0] = 0
    x = x.astype(np.float32)
    stored, scales = decode.quantize_vectors(jnp.asarray(x), jnp.float8_e4m3fn)
    assert stored.dtype == jnp.float8_e4m3fn and scales.shape == (3, 5, 2)
    largest = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    amax = np.abs(x).max(-1)
    expected_scales = np.where(amax > 0, amax * (1 / largest), np.float32(1))
    np.testing.assert_array_equal(scales, expected_scales)
    expected = (x / expected_scales[..., None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(stored).astype(np.float32),
                                  expected.astype(np.float32))
    # each vector's largest magnitude is the format's largest value; the zero vector stays 0
    assert np.all(np.abs(np.asarray(stored).astype(np.float32)).max(-1)[amax > 0] == largest)
    assert not np.any(np.asarray(stored[1, 2, 0]).astype(np.float32))


@pytest.mark.parametrize("base, pieces", [
    (TINY, [1, 1, 29, 1, 1, 30, 1]),  # a one-token prompt; prefills of odd lengths after it
    (LLAMA_TINY, [27, 1, 1, 1, 33])])  # grouped-query attention: 4 query heads, 2 key heads
def test_fp8_cache_decodes_as_the_full_forward_to_fp8_rounding(corpus, base, pieces):
    config, weights = tiny_weights(tie_head=base.model.tie_head, config=base)
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    tokens = jnp.asarray(generate.prompts_from(corpus.validation, 3, sum(pieces)))
    with jax.default_matmul_precision("highest"):
        full = jitted(cached)[0](tokens)
        exact = cached_logits(cached, tokens, pieces)
        fp8 = cached_logits(cached, tokens, pieces, jnp.float8_e4m3fn)
        # one prefill: attention over the dequantized cache, the reference of the decode
        # steps' multiply-reduces over the FP8 bytes (each vector is stored alike either way)
        prefilled = cached_logits(cached, tokens, [sum(pieces)], jnp.float8_e4m3fn)
    np.testing.assert_allclose(exact, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fp8, prefilled, rtol=1e-5, atol=1e-5)
    # The Generator's prefill attends over the prompt's own 16-bit keys and values: the full
    # forward's logits; it writes the cache as the other prefill does.
    _, step = jitted(cached)
    caches = [decode.init_cache(config.model, 3, 64, jnp.float8_e4m3fn) for _ in range(2)]
    with jax.default_matmul_precision("highest"):
        (fresh, fresh_cache), (_, read_cache) = (
            step(tokens[:, :pieces[0]], cache, 0, flag) for cache, flag in zip(caches, (True, False)))
    np.testing.assert_allclose(fresh, full[:, :pieces[0]], rtol=1e-5, atol=1e-5)
    for name in ("keys", "values", "key_scales", "value_scales"):
        np.testing.assert_array_equal(np.asarray(getattr(fresh_cache, name), np.float32),
                                      np.asarray(getattr(read_cache, name), np.float32))
    # FP8 keys and values change the logits, a little (3 mantissa bits, a scale a vector):
    # 2.6% and 3.8% here (root mean square, relative).
    error = float(jnp.sqrt(jnp.mean((fp8 - full) ** 2) / jnp.mean(full ** 2)))
    assert 0 < error < 0.06
    assert np.mean(np.argmax(fp8, -1) == np.argmax(full, -1)) > 0.85
    # a byte a value and a float32 scale per head vector, against 4 bytes a value
    cache = decode.init_cache(config.model, 3, 64, jnp.float8_e4m3fn)
    assert cache.nbytes == decode.init_cache(config.model, 3, 64, jnp.float32).nbytes * \
        (1 + 4 / config.model.head_dim) / 4


def test_greedy_generation_with_an_fp8_cache_is_the_argmax_of_its_cached_forward(corpus):
    config, weights = tiny_weights(config=LLAMA_TINY, tie_head=False)
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    prompt = generate.prompts_from(corpus.validation, 4, 9)
    generator = decode.Generator(cached, cache_dtype=jnp.float8_e4m3fn)
    assert generator.cache_dtype == jnp.float8_e4m3fn
    generated = generator.generate(prompt, 6, jax.random.key(0)).tokens
    tokens = jnp.concatenate([jnp.asarray(prompt), jnp.asarray(generated[:, :-1])], axis=1)
    logits = cached_logits(cached, tokens, [9] + [1] * 5, jnp.float8_e4m3fn, fresh=True)
    np.testing.assert_array_equal(np.argmax(logits[:, 8:], -1), generated)


@pytest.mark.parametrize("config", [TINY, LLAMA_TINY], ids=["gpt", "llama_gqa"])
def test_fp8_decode_attention_by_dots_equals_the_multiply_reduces(config):
    # generate.py --fp8-attention: the two forms of a decode step over one FP8 cache
    config, weights = tiny_weights(config=config, tie_head=False)
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (3, 13)), jnp.int32)
    by_form = {}
    for form in ("reduce", "dots"):
        with jax.default_matmul_precision("highest"):
            by_form[form] = cached_logits(cached, tokens, [9, 1, 1, 1, 1], jnp.float8_e4m3fn,
                                          read=form)
    np.testing.assert_allclose(by_form["dots"], by_form["reduce"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="read: expected None"):
        cached_logits(cached, tokens, [12, 1], jnp.float8_e4m3fn, read="flash")
    with pytest.raises(ValueError, match="fp8_read: expected None"):
        decode.Generator(cached, cache_dtype=jnp.float8_e4m3fn, fp8_read="flash")


@pytest.mark.parametrize("config, form", [(TINY, "reduce"), (LLAMA_TINY, "dots")],
                         ids=["gpt_reduce", "llama_gqa_dots"])
@pytest.mark.parametrize("heads_major", ["heads_major", "heads_major_rows"])
def test_fp8_cache_heads_major_holds_and_decodes_as_positions_major(config, form, heads_major):
    # generate.py --fp8-cache-layout: the same bytes in another order, the same math
    config, weights = tiny_weights(config=config, tie_head=False)
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    prompt = np.random.default_rng(5).integers(0, 256, (3, 7))
    by_layout = {}
    for layout in ("positions_major", heads_major):
        generator = decode.Generator(cached, cache_dtype=jnp.float8_e4m3fn, steps_per_call=4,
                                     cache_layout=layout, fp8_read=form)
        tokens, cache = generator.prefill(generator.new_cache(3, 13), prompt, jax.random.key(0))
        out, cache = generator.decode(cache, tokens, 7, 3, jax.random.key(0))
        assert cache.max_len == 13 and cache.layout == layout
        by_layout[layout] = (np.asarray(out[:3]), cache)
    (tokens, old), (new_tokens, new) = by_layout.values()
    np.testing.assert_array_equal(new_tokens, tokens)
    heads_first = lambda x: np.swapaxes(np.asarray(x, np.float32), 2, 3)
    np.testing.assert_array_equal(heads_first(old.keys), np.asarray(new.keys, np.float32))
    values = heads_first(old.values) if heads_major == "heads_major_rows" else \
        np.moveaxis(np.asarray(old.values, np.float32), 2, 4)
    np.testing.assert_array_equal(values, np.asarray(new.values, np.float32))
    for scales in ("key_scales", "value_scales"):
        np.testing.assert_array_equal(heads_first(getattr(old, scales)), getattr(new, scales))
    with jax.default_matmul_precision("highest"):
        logits = {}
        for layout in ("positions_major", heads_major):
            logits[layout] = cached_logits(cached, jnp.asarray(np.random.default_rng(6).integers(
                0, 256, (2, 11))), [9, 1, 1], jnp.float8_e4m3fn, read=form, layout=layout)
    # the reductions' float32 sums in another memory order: equal to rounding (about 1e-6)
    np.testing.assert_allclose(logits[heads_major], logits["positions_major"], rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="layout: expected one of"):
        decode.init_cache(config.model, 1, 8, jnp.float8_e4m3fn, "rows")


#: Entry instructions that write no memory of their own.
_NOT_WRITTEN = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def written_arrays(hlo: str) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(dtype, dims, opcode, the called computation's body) of each array an instruction of a
    compiled program's entry computation writes: what is materialised (a fusion's inside is
    not; a multi-output fusion writes each of its results)."""
    bodies = dict(re.findall(r"^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo, re.M | re.S))
    entry = hlo[hlo.index("\nENTRY"):].split("\n}", 1)[0].splitlines()[1:]
    found = []
    for line in entry:
        match = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([\w\-]+)\(", line)
        if not match or match.group(2) in _NOT_WRITTEN:
            continue
        called = re.search(r"calls=%?([\w.\-]+)", line)
        body = bodies.get(called.group(1), "") if called else ""
        found += [(dtype, tuple(int(d) for d in dims.split(",") if d), match.group(2), body)
                  for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))]
    return found


def decode_step(config, cache_dtype, compute_dtype=jnp.float32, batch=4, layout=None,
                read=None):
    """One compiled decode step of `config`'s stock model, a cache for prompts of 20 and 17
    new tokens (the body of a decode call's device loop, on its own: its writes are the
    entry computation's)."""
    weights = generate.serving_weights(config, None, compute_dtype)
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, compute_dtype))
    generator = decode.Generator(cached, cache_dtype=cache_dtype, cache_layout=layout,
                                 fp8_read=read)
    cache = jax.eval_shape(lambda: generator.new_cache(batch, 37))
    step = jax.jit(generator._forward_and_sample, donate_argnums=1)
    return step.lower(generator.state, cache, jax.ShapeDtypeStruct((batch, 1), jnp.int32),
                      jnp.int32(20), jax.random.key(0)).compile()


def is_cache_sized(dims, config, batch, max_len=37) -> bool:
    """Whether `dims` are the whole keys' or values' of `config` in some order."""
    m = config.model
    return sorted(dims) == sorted((m.n_layers, batch, max_len, m.kv_heads, m.head_dim))


def assert_writes_the_cache_in_place(compiled, config, batch):
    """Every cache-sized array the step writes (in either layout, or transposed) is a
    `dynamic_update_slice` (into the donated cache, in place): none is a copy or a
    concatenation."""
    cache_sized = [(opcode, body) for _, dims, opcode, body in written_arrays(
        compiled.as_text()) if is_cache_sized(dims, config, batch)]
    writes = [opcode for opcode, body in cache_sized
              if opcode == "dynamic-update-slice" or "dynamic-update-slice(" in body]
    assert len(writes) >= 2 * config.model.n_layers  # keys and values of each layer, where they are
    assert len(writes) == len(cache_sized), cache_sized  # and nothing else of the cache's size


@pytest.mark.parametrize("cache_dtype, layout", [
    (jnp.float32, "positions_major"), (jnp.float8_e4m3fn, "positions_major"),
    (jnp.float8_e4m3fn, "heads_major"), (jnp.float8_e4m3fn, "heads_major_rows")])
def test_a_decode_step_writes_the_cache_in_place(cache_dtype, layout):
    # Two layers: the old step sliced each layer out, updated it and stacked them back, a
    # concatenation (a copy) of the whole cache every step.
    config = TINY.replace(n_layers=2)
    assert_writes_the_cache_in_place(decode_step(config, cache_dtype, layout=layout), config, 4)


def assert_the_decode_loop_keeps_the_cache_as_it_is(config, batch, layout):
    """A decode call (its device loop) of `config`'s stock model over an FP8 cache compiled
    for the default backend: outside the loop nothing cache-sized is written (an H200's
    positions-major FP8 cache was transposed whole at the loop's entry and exit)."""
    generator = decode.Generator(decode.CachedGPT(generate.model_with(
        config, "stock", generate.serving_weights(config, None, jnp.bfloat16), jnp.bfloat16)),
        cache_dtype=jnp.float8_e4m3fn, steps_per_call=4, cache_layout=layout)
    compiled = generator.compile(batch, 20, 17, jax.random.key(0))["decode"][4]
    cache_sized = [(dtype, dims, opcode) for dtype, dims, opcode, _ in written_arrays(
        compiled.as_text()) if is_cache_sized(dims, config, batch)]
    assert ("f8e4m3fn", "while") in {(dtype, opcode) for dtype, _, opcode in cache_sized}
    outside = [written for written in cache_sized if written[2] != "while"]
    assert not outside, outside


@pytest.mark.parametrize("layout", ["positions_major", "heads_major", "heads_major_rows"])
def test_a_decode_call_on_the_cpu_keeps_the_fp8_cache_as_it_is(layout):
    assert_the_decode_loop_keeps_the_cache_as_it_is(LLAMA_TINY.replace(n_layers=2), 4, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["heads_major", "heads_major_rows"])
def test_a_decode_call_on_the_gpu_keeps_a_heads_major_fp8_cache_as_it_is(layout):
    with jax.default_device(jax.devices("cuda")[0]):
        assert_the_decode_loop_keeps_the_cache_as_it_is(LLAMA_TINY.replace(n_layers=2), 64,
                                                        layout)


def test_an_fp8_decode_step_reads_the_cache_with_no_dot():
    # A dot of the FP8 cache would want a 16-bit copy of it (a GPU's GEMMs read no mixed
    # operands); the decode attention is multiply-reduces instead, which XLA fuses with the
    # conversion (test_a_decode_step_on_the_gpu_reads_the_fp8_cache_as_it_is).
    config = LLAMA_TINY
    generator = decode.Generator(decode.CachedGPT(generate.model_with(
        config, "stock", generate.serving_weights(config, None, jnp.float32), jnp.float32)),
        cache_dtype=jnp.float8_e4m3fn, fp8_read="reduce")
    cache = generator.new_cache(2, 37)
    dots = [eqn for eqn in traced_equations(
        generator._forward_and_sample, generator.state, cache, jnp.zeros((2, 1), jnp.int32),
        jnp.int32(5), jax.random.key(0)) if eqn.primitive.name == "dot_general"]
    assert dots and all(37 not in var.aval.shape for eqn in dots for var in eqn.invars)
    prefill = [eqn for eqn in traced_equations(
        generator._forward_and_sample, generator.state, cache, jnp.zeros((2, 9), jnp.int32),
        jnp.int32(0), jax.random.key(0)) if eqn.primitive.name == "dot_general"]
    assert any(37 in var.aval.shape for eqn in prefill for var in eqn.invars)  # its GEMMs
    # the Generator's prefill reads nothing back from the cache
    fresh = [eqn for eqn in traced_equations(
        generator._prefill_and_sample, generator.state, cache, jnp.zeros((2, 9), jnp.int32),
        jax.random.key(0)) if eqn.primitive.name == "dot_general"]
    assert fresh and all(37 not in var.aval.shape for eqn in fresh for var in eqn.invars)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["positions_major", "heads_major", "heads_major_rows"])
def test_a_decode_step_on_the_gpu_reads_the_fp8_cache_as_it_is(layout):
    config = LLAMA_TINY.replace(n_layers=2)
    m = config.model
    with jax.default_device(jax.devices("cuda")[0]):
        # the multiply-reduces ("reduce"): what reads the FP8 bytes as they are
        compiled = decode_step(config, jnp.float8_e4m3fn, jnp.bfloat16, batch=64, layout=layout,
                               read="reduce")
    layer = 64 * 37 * m.kv_heads * m.head_dim
    # no 16- or 32-bit array of a layer's cache, or more, is written between kernels
    wide = [(dtype, dims, opcode) for dtype, dims, opcode, _ in written_arrays(
        compiled.as_text()) if dtype in ("bf16", "f16", "f32") and np.prod(dims) >= layer]
    assert not wide, wide
    assert_writes_the_cache_in_place(compiled, config, 64)


def greedy_by_full_forward(cached, prompt, new_tokens):
    """Greedy generation the slow way: the full forward of everything so far, each step."""
    tokens, full = jnp.asarray(prompt), jitted(cached)[0]
    for _ in range(new_tokens):
        following = jnp.argmax(full(tokens)[:, -1], axis=-1).astype(tokens.dtype)
        tokens = jnp.concatenate([tokens, following[:, None]], axis=1)
    return np.asarray(tokens[:, prompt.shape[1]:])


def test_greedy_generation_is_the_argmax_of_the_full_forward_step_by_step(corpus):
    config, weights = tiny_weights()
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    prompt = generate.prompts_from(corpus.validation, 4, 20)
    generator = decode.Generator(cached)
    with jax.default_matmul_precision("highest"):
        first = generator.generate(prompt, 4, jax.random.key(0))
        again = generator.generate(prompt, 4, jax.random.key(1))  # greedy: the key is unused
        expected = greedy_by_full_forward(cached, prompt, 4)
    assert first.tokens.shape == (4, 4) and first.tokens.dtype == np.int32
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.tokens, expected)
    assert first.prefill_s > 0 and first.decode_s > 0


def test_top_k_1_sampling_is_greedy_and_sampling_follows_the_seed(corpus):
    config, weights = tiny_weights()
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    prompt = generate.prompts_from(corpus.validation, 4, 16)
    greedy = decode.Generator(cached).generate(prompt, 8, jax.random.key(0)).tokens
    top_1 = decode.Generator(cached, temperature=1.5, top_k=1)
    np.testing.assert_array_equal(top_1.generate(prompt, 8, jax.random.key(3)).tokens, greedy)
    sampler = decode.Generator(cached, temperature=2.0)
    drawn = [sampler.generate(prompt, 8, jax.random.key(seed)).tokens for seed in (5, 5, 6)]
    np.testing.assert_array_equal(drawn[0], drawn[1])
    assert not np.array_equal(drawn[0], drawn[2])
    assert not np.array_equal(drawn[0], greedy)


def test_decode_calls_of_any_length_give_the_same_tokens(corpus):
    # 7 decode steps in calls of 1, 3 (3 + 3 + 1) and 16 (one partial call), sampled, so a
    # step's position and key must survive the device loop.
    config, weights = tiny_weights()
    cached = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    prompt = generate.prompts_from(corpus.validation, 3, 9)
    drawn = [decode.Generator(cached, temperature=1.5, steps_per_call=steps)
             .generate(prompt, 8, jax.random.key(2)).tokens for steps in (1, 3, 16)]
    assert drawn[0].shape == (3, 8)
    np.testing.assert_array_equal(drawn[1], drawn[0])
    np.testing.assert_array_equal(drawn[2], drawn[0])
    with pytest.raises(ValueError, match="steps_per_call"):
        decode.Generator(cached, steps_per_call=0)


def test_a_decode_call_loops_a_trip_count_xla_knows():
    # A loop whose count is an argument makes XLA wait for its condition on the host after
    # every step; one compiled per count is queued step after step.
    config, weights = tiny_weights()
    generator = decode.Generator(decode.CachedGPT(generate.model_with(
        config, "stock", weights, jnp.float32)), steps_per_call=4)
    assert generator.decode_counts(9) == (4,)  # 8 steps: two full calls
    assert generator.decode_counts(8) == (3, 4)  # 7 steps: 4 + 3
    assert generator.decode_counts(3) == (2,) and generator.decode_counts(1) == ()
    compiled = generator.compile(2, 5, 8, jax.random.key(0))
    assert sorted(compiled["decode"]) == [3, 4]
    for count, program in compiled["decode"].items():
        assert re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', program.as_text()) == [str(count)]
    cache = generator.new_cache(2, 13)
    tokens, cache = generator.prefill(cache, np.ones((2, 5), np.int32), jax.random.key(0),
                                      compiled["prefill"])
    with pytest.raises(ValueError, match=r"compiled: holds decode calls of \[3, 4\] steps, not 2"):
        generator.decode(cache, tokens, 5, 2, jax.random.key(0), compiled["decode"])
    for count in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="count: expected an int from 1 to steps_per_call"):
            generator.decode(cache, tokens, 5, count, jax.random.key(0))


def test_one_new_token_is_measured_without_a_decode_call(tmp_path):
    # the prefill makes the only new token: nothing to decode, nothing decode-sized reported
    measured = run_main("--random-init", "--variant", "stock", "--batch", "2",
                        "--prompt-len", "5", "--new-tokens", "1", "--repeats", "1",
                        "--eval-batches", "1")["result"]["variants"]["stock"]["by_batch"]["2"]
    assert measured["decode_tokens_per_s"] is None and measured["fp8_gemms_decode"] is None
    assert measured["decode_step_memory"] is None and measured["prefill_tokens_per_s"] > 0


def test_sample_keeps_to_the_top_k():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((64, 256)), jnp.float32)
    top_3 = np.asarray(jax.lax.top_k(logits, 3)[1])
    drawn = np.stack([np.asarray(decode.sample(logits, jax.random.key(i), temperature=5.0,
                                               top_k=3)) for i in range(20)])
    assert all(token in top_3[row] for row in range(64) for token in drawn[:, row])
    assert len(np.unique(drawn)) > 3  # more than one of the three is drawn per row


@pytest.mark.parametrize("base, projections", [
    (TINY, 4),  # qkv, out, MLP up and down
    (LLAMA_TINY, 5)])  # qkv, out, the SwiGLU block's gate, up and down (the head stays 16-bit)
@pytest.mark.parametrize("weight_scales", ["tensor", "channel"])
def test_epilog_fp8_stores_fp8_kernels_and_with_static_scales_decodes_as_its_full_forward(
        corpus, monkeypatch, base, projections, weight_scales):
    # One way for every call: the full forward's rows and a decode step's rows would
    # otherwise take different ways (serving_plan.serving_way).
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")
    config, weights = tiny_weights(tie_head=base.model.tie_head, config=base)
    validation = data.validation_batches(corpus.validation, 4, config.model.seq_len, 1)
    cached = generate.epilog_fp8(config, weights, jnp.float32, attention="auto",
                                 fp8_min_features=64,
                                 calibration=[jnp.asarray(x) for x, _ in validation],
                                 weight_scales=weight_scales)
    kernels = [leaf for leaf in jax.tree.leaves(
        nnx.state(cached, nnx.Param), is_leaf=lambda x: isinstance(x, jax_epilog.Fp8Weight))
        if isinstance(leaf, jax_epilog.Fp8Weight)]
    assert len(kernels) == projections * config.model.n_layers
    assert all(k.input_scale is not None and k.data.dtype == jnp.float8_e4m3fn
               for k in kernels)
    assert all(k.scale.shape == (() if weight_scales == "tensor" else k.data.shape[:1])
               for k in kernels)
    stock = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    # each stored kernel: a byte per float32 value, plus its float32 scales
    assert generate.weight_bytes(stock) - generate.weight_bytes(cached) == \
        sum(3 * k.data.size - 4 * k.scale.size - 4 for k in kernels)
    # Static scales quantize each row alike whatever else is in the call: the cached
    # forward is the full one.
    tokens = jnp.asarray(validation[0][0][:, :24])
    full = jitted(cached)[0](tokens)
    np.testing.assert_allclose(cached_logits(cached, tokens, [16] + [1] * 8), full,
                               rtol=1e-4, atol=1e-4)
    # FP8 changes the logits, a little.
    difference = float(jnp.max(jnp.abs(full - jitted(stock)[0](tokens))))
    assert 0 < difference < 0.2 * float(jnp.max(jnp.abs(full)))


@pytest.mark.parametrize("base, projections", [(TINY, 4), (LLAMA_TINY, 5)])
def test_stock_fp8_serves_the_stock_model_as_epilog_fp8_serves_ours(corpus, monkeypatch, base,
                                                                     projections):
    """The stock model's code through `jax_epilog.serve_fp8`: the same kernels stored as
    `epilog_fp8` stores them, and weight-only (the input unrounded) the same logits, up to
    float32 rounding (GELU and SwiGLU's gate are outside the stock layers' GEMMs)."""
    monkeypatch.setenv("JAX_EPILOG_SERVING", "weight_only")
    config, weights = tiny_weights(tie_head=base.model.tie_head, config=base)
    stock_fp8, epilog_fp8 = (generate.build_variant(name, config, weights, jnp.float32,
                                                    fp8_min_features=64)
                             for name in ("stock_fp8", "epilog_fp8"))
    served = [type(m).__name__ for _, m in nnx.iter_modules(stock_fp8) if
              isinstance(m, nnx.Linear)]
    assert served.count("ServedLinear") == projections * config.model.n_layers
    assert generate.fp8_kernels(stock_fp8) == generate.fp8_kernels(epilog_fp8)
    assert generate.cache_dtype("stock_fp8", "auto", jnp.float32) == jnp.float8_e4m3fn
    tokens = jnp.asarray(generate.prompts_from(corpus.validation, 2, 24))
    logits = jitted(stock_fp8)[0](tokens)
    np.testing.assert_allclose(logits, jitted(epilog_fp8)[0](tokens), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(cached_logits(stock_fp8, tokens, [16] + [1] * 8), logits,
                               rtol=1e-4, atol=1e-4)


def test_qwix_fp8_quantizes_the_projections_only(corpus):
    pytest.importorskip("qwix")
    config, weights = tiny_weights()
    tokens = jnp.asarray(generate.prompts_from(corpus.validation, 2, 24))
    cached = generate.qwix_fp8(config, weights, jnp.float32, attention="auto",
                               sample_tokens=tokens[:1])
    dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in
              jax.tree_util.tree_leaves_with_path(nnx.state(cached))}
    fp8 = sorted(path for path, dtype in dtypes.items() if dtype == jnp.float8_e4m3fn)
    assert len(fp8) == 4 * config.model.n_layers
    assert all("embedding" not in path and "norm" not in path for path in fp8)
    stock = decode.CachedGPT(generate.model_with(config, "stock", weights, jnp.float32))
    full, reference = jitted(cached)[0](tokens), jitted(stock)[0](tokens)
    assert 0 < float(jnp.max(jnp.abs(full - reference))) < 0.2 * float(jnp.max(jnp.abs(full)))
    # Its cached forward runs quantized too (Qwix intercepts CachedGPT's one __call__).
    logits = cached_logits(cached, tokens, [16] + [1] * 8)
    assert not np.allclose(logits, reference, atol=1e-6)
    np.testing.assert_allclose(logits, full, atol=0.2 * float(jnp.max(jnp.abs(full))))


@pytest.mark.parametrize("base, impl, fp8", [
    (TINY, "stock", False),
    # a checkpoint of jax_epilog's FP8 SwiGLU block serves in every variant
    pytest.param(LLAMA_TINY, "epilog", True, marks=pytest.mark.slow)])
def test_restores_the_parameters_train_py_saved(corpus, tmp_path, base, impl, fp8):
    pytest.importorskip("orbax.checkpoint")
    config = base.replace(steps=2, warmup_steps=1, eval_every=2, log_every=1, n_layers=1)
    trained = train.train(config, impl, fp8=fp8, corpus=corpus, progress=False,
                          checkpoint_dir=tmp_path)
    restored_config, saved, step = generate.restore_parameters(tmp_path)
    assert restored_config == config and step == 2
    weights = generate.serving_weights(restored_config, saved, jnp.float32)
    expected = trained["state"].params
    assert jax.tree.structure(weights) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(weights), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(got, want)
    # Read onto the host (this orbax describes the saved state), cast there for a GPU.
    assert generate._on_the_host(tmp_path / "2" / "state") is not None
    in_bf16 = generate.serving_weights(restored_config, saved, jnp.bfloat16)
    for got, want in zip(jax.tree.leaves(in_bf16), jax.tree.leaves(expected)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want.astype(jnp.bfloat16))
    # Both served variants hold them: the FP8 one's logits are the stock one's to FP8 rounding.
    tokens = jnp.asarray(generate.prompts_from(corpus.validation, 2, 12))
    stock, fp8_logits = (jitted(generate.build_variant(
        variant, restored_config, weights, jnp.float32, fp8_min_features=16))[0](tokens)
        for variant in ("stock", "epilog_fp8"))
    difference = float(jnp.max(jnp.abs(fp8_logits - stock)))
    assert 0 < difference < 0.2 * float(jnp.max(jnp.abs(stock)))


def run_main(*args):
    """generate_bench.py's command line: generate.py's with the experiment switches."""
    return generate_bench.main([*args, "--no-progress"])


@pytest.mark.slow
@pytest.mark.parametrize("name, projections", [
    ("tiny", 4),  # qkv, out, MLP up and down
    ("llama_tiny", 5)])  # qkv, out, the SwiGLU block's gate, up and down
def test_compare_writes_every_variant_with_quality(tmp_path, name, projections):
    report = run_main("--random-init", "--config", name, "--compare", "--batch", "1", "3",
                      "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                      "--eval-batches", "1", "--fp8-min-features", "64", "--out",
                      str(tmp_path))
    written = json.loads((tmp_path / "gpt_generate.json").read_text())
    assert written["result"] == json.loads(json.dumps(report["result"]))
    variants, skipped = written["result"]["variants"], written["result"]["skipped"]
    # Qwix is optional (pip install qwix): without it its variant is skipped, the others run.
    missing = set() if importlib.util.find_spec("qwix") else {"qwix_fp8"}
    assert not written["result"]["failed"]
    assert skipped == {name: generate.QWIX_MISSING for name in missing}
    assert list(variants) == [name for name in generate.VARIANTS if name not in missing]
    for record in variants.values():
        assert set(record["by_batch"]) == {"1", "3"}
        for batch, measured in record["by_batch"].items():
            assert measured["decode_tokens_per_s"] > 0 and measured["prefill_tokens_per_s"] > 0
            assert measured["time_to_first_token_s"] > 0 and measured["compile_s"] > 0
            assert len(measured["sample"]["prompt"]) == 8
            step_memory = measured["decode_step_memory"]
            assert step_memory is None or step_memory["peak_bytes"] > 0
        assert 0.5 < record["top1_agreement_with_stock"] <= 1
    assert variants["stock"]["top1_agreement_with_stock"] == 1
    assert [variants[variant]["kv_cache"] for variant in variants] == \
        ["float32", "float8_e4m3fn", "float8_e4m3fn", "float32"][:len(variants)]
    assert variants["stock"]["validation_loss_vs_stock"] == 0
    assert variants["epilog_fp8"]["weight_bytes"] < variants["stock"]["weight_bytes"]
    assert [variants[variant]["fp8_kernels"] for variant in variants] == \
        [0] + [2 * projections] * (len(variants) - 1)  # 2 blocks
    text = (tmp_path / "gpt_generate.md").read_text()
    assert all(f"| {variant} | 3 |" in text for variant in variants)
    assert written["config"]["model"]["arch"] == configs.get(name).model.arch
    assert written["metadata"]["platform"] == jax.default_backend()


def test_kv_cache_and_profile_options_reach_the_report(tmp_path):
    report = run_main("--random-init", "--variant", "epilog_fp8", "--batch", "2",
                      "--prompt-len", "5", "--new-tokens", "4", "--repeats", "1",
                      "--eval-batches", "1", "--fp8-min-features", "64", "--profile",
                      str(tmp_path / "traces"), "--fp8-cache-layout", "positions_major",
                      "--fp8-attention", "reduce", "--out", str(tmp_path))
    record = report["result"]["variants"]["epilog_fp8"]
    measured = record["by_batch"]["2"]
    assert record["kv_cache"] == "float8_e4m3fn"  # "auto": FP8 for epilog_fp8
    assert measured["kv_cache_bytes"] == decode.init_cache(
        configs.get("tiny").model, 2, 9, jnp.float8_e4m3fn).nbytes
    # On the CPU the trace holds no GPU kernel; on a GPU, kernel times by kind.
    profiled = measured["profile"]
    assert profiled["steps"] == 3 and profiled["prefill"]["prefills"] == generate.PROFILE_STEPS
    for what in ("decode", "prefill"):  # a trace of each
        assert list((tmp_path / "traces" / "epilog_fp8_batch2" / what).rglob("*.xplane.pb"))
    for p in (profiled, profiled["prefill"]):
        assert "no GPU kernels" in p["note"] if jax.default_backend() == "cpu" else \
            p["kernel_ms"] > 0
    host = profiled["prefill"]["host"]  # the prefill's host side, traced events included
    assert 0 < host["dispatch_ms"] <= host["whole_ms"] and host["events"]
    text = (tmp_path / "gpt_generate.md").read_text()
    assert text.count("| epilog_fp8 | 2 | float8_e4m3fn |") == 2  # the profiles' rows
    assert "Where a prefill's time goes" in text
    assert "| epilog_fp8 | 2 | " in text.split("A prefill's host side")[1]
    assert "the host's longest events of a traced prefill" in text
    assert "| float8_e4m3fn, " in text  # the main table's KV cache cell
    assert "an FP8 KV cache positions_major, read by reduce" in text
    assert "the prefill compiled without command buffers" in text  # the default


def test_prefill_without_command_buffers_is_an_option():
    """`--prefill-command-buffers` reaches the Generator, which by default compiles its
    prefill without them on a GPU (and as usual elsewhere), giving the same tokens."""
    for flag, want in (([], False), (["--prefill-command-buffers", "on"], True)):
        args = generate.parse_args(["--random-init", *flag], generate_bench.build_parser())
        assert generate.settings_for(args, configs.get("tiny")).prefill_command_buffers is want
    config = configs.get("tiny").model
    cached = decode.CachedGPT(generate.model_with(
        configs.get("tiny"), "stock", generate.serving_weights(configs.get("tiny"), None,
                                                               jnp.float32), jnp.float32))
    plain, off = (decode.Generator(cached, prefill_command_buffers=flag) for flag in (True, False))
    assert decode.Generator(cached).prefill_options == off.prefill_options
    lowered = off.lower(2, 5, 4, jax.random.key(0))["prefill"]  # the jit carries them
    assert dict(lowered._lowering._compiler_options_kvs) == (off.prefill_options or {})
    assert plain.prefill_options is None
    assert off.prefill_options == (decode.NO_COMMAND_BUFFERS if jax.default_backend() == "gpu"
                                   else None)
    prompt = np.arange(10, dtype=np.int32).reshape(2, 5) % config.vocab_size
    key = jax.random.key(0)
    np.testing.assert_array_equal(plain.generate(prompt, 4, key).tokens,
                                  off.generate(prompt, 4, key, compiled=off.compile(
                                      2, 5, 4, key)).tokens)


def test_cache_dtype_per_variant_and_choice():
    assert generate.cache_dtype("epilog_fp8", "auto", jnp.bfloat16) == jnp.float8_e4m3fn
    assert generate.cache_dtype("stock", "auto", jnp.bfloat16) == jnp.bfloat16
    assert generate.cache_dtype("qwix_fp8", "auto", jnp.float32) == jnp.float32
    assert generate.cache_dtype("stock", "fp8", jnp.float32) == jnp.float8_e4m3fn
    assert generate.cache_dtype("epilog_fp8", "bf16", jnp.float32) == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_cache: expected 'auto' or one of"):
        generate.cache_dtype("stock", "int8", jnp.float32)


def test_decode_kernels_are_sorted_by_the_scope_that_launched_them():
    kernel = lambda name, op: generate.profile.gpu_trace.Kernel(0, 1000, "Stream #1", name, op)
    hlo = "\n".join([
        "ENTRY %main (p: f32[4]) -> f32[4] {",
        '  %dus = f8e4m3fn[4] fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(f)/'
        'kv_cache/dynamic_update_slice"}',
        '  %scores = f32[4] fusion(%p), kind=kInput, calls=%c, metadata={op_name="jit(f)/'
        'cached_attention/reduce_sum"}',
        '  %dot = f32[4] custom-call(%p), metadata={op_name="jit(f)/dot_general"}',
        '  %norm = f32[4] fusion(%p), kind=kLoop, calls=%c, metadata={op_name="jit(f)/rsqrt"}',
        '  %amax = f32[] fusion(%p), kind=kInput, calls=%c, metadata={op_name="jit(f)/'
        'fp8_input/reduce_max"}',
        "}"])
    kernels = [kernel("loop_dynamic_update_slice_fusion", "dus"),
               kernel("input_reduce_fusion", "scores"), kernel("nvjet_hsh_64x8", "dot"),
               kernel("nvjet_hsh_64x8", "dot"), kernel("loop_rsqrt_fusion", "norm"),
               kernel("input_reduce_fusion", "amax")]
    got = generate.profile.breakdown(kernels, 1, hlo, generate.decode_kind,
                                     generate.DECODE_TOP_KERNELS)
    assert [got[f"{kind}_ms"] for kind in ("gemm", "attention", "cache", "quantize",
                                           "other")] == [0.002, 0.001, 0.001, 0.001, 0.001]
    assert {t["op"]: t["kind"] for t in got["top"]} == \
        {"dot": "gemm", "scores": "attention", "dus": "cache", "amax": "quantize",
         "norm": "other"}


def test_compare_runs_the_named_variants_stock_first():
    args = generate.parse_args(["--random-init", "--compare", "--variants",
                                "qwix_fp8, stock,qwix_fp8"])
    assert generate.compared_variants(args) == ("stock", "qwix_fp8")


def test_a_variant_served_one_way_is_epilog_fp8_with_that_way_while_it_runs(monkeypatch):
    args = generate.parse_args(["--random-init", "--compare", "--variants",
                                "stock,epilog_fp8,epilog_fp8@xla_fp8"])
    assert generate.compared_variants(args) == ("stock", "epilog_fp8", "epilog_fp8@xla_fp8")
    assert generate.variant_parts("epilog_fp8@xla_fp8") == ("epilog_fp8", "xla_fp8")
    assert generate.variant_parts("stock") == ("stock", None)
    monkeypatch.delenv("JAX_EPILOG_SERVING", raising=False)
    assert serving_way(1).choice == "weight_only"
    with generate.forced_serving_way("xla_fp8"):
        assert serving_way(1).choice == serving_way(4096).choice == "xla_fp8"
    assert serving_way(1).choice == "weight_only" and "JAX_EPILOG_SERVING" not in os.environ
    monkeypatch.setenv("JAX_EPILOG_SERVING", "fp8")
    with generate.forced_serving_way("weight_only"):
        assert serving_way(4096).choice == "weight_only"
    assert os.environ["JAX_EPILOG_SERVING"] == "fp8"


def test_bad_input_names_the_argument(tmp_path, capsys):
    def error_of(*args):
        with pytest.raises(SystemExit):
            run_main(*args)
        return capsys.readouterr().err

    assert "--prompt-len/--new-tokens" in error_of("--random-init", "--prompt-len", "65")
    assert "seq_len 64" in error_of("--random-init", "--prompt-len", "40", "--new-tokens", "30")
    assert "--batch: expected values >= 1" in error_of("--random-init", "--batch", "4", "0")
    assert f"--checkpoint-dir: no checkpoint in {tmp_path}" in error_of(
        "--checkpoint-dir", str(tmp_path))
    assert "is not a directory" in error_of("--checkpoint-dir", str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()
    assert "--random-init" in error_of()  # neither weights source
    with pytest.raises(ValueError, match="top_k"):
        decode.sample(jnp.zeros((1, 4)), jax.random.key(0), temperature=1.0, top_k=5)
    with pytest.raises(ValueError, match="temperature"):
        decode.Generator(decode.CachedGPT(generate.model_with(
            TINY, "stock", generate.serving_weights(TINY, None, jnp.float32), jnp.float32)),
            temperature=-1.0)
    with pytest.raises(ValueError, match="variant"):
        generate.build_variant("int4", TINY, None, jnp.float32)
    assert "--kv-cache: invalid choice" in error_of("--random-init", "--kv-cache", "int8")
    for variants in ("epilog_fp8", "stock,int4", "stock,epilog_fp8@int8",
                     "stock,qwix_fp8@xla_fp8"):  # stock is what quality compares with
        assert "--variants: expected names among" in error_of(
            "--random-init", "--compare", "--variants", variants)
    assert "--steps-per-call: expected values >= 1" in error_of(
        "--random-init", "--steps-per-call", "0")
    with pytest.raises(ValueError, match="dtype: expected a floating-point cache dtype"):
        decode.init_cache(TINY.model, 1, 8, jnp.int8)
