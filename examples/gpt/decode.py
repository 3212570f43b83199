"""Batched prefill and KV-cache decoding for the model of `model.py` (either arch), from the
model's own layers.

`CachedGPT(model)` wraps a `GPT`: `CachedGPT(model)(tokens)` is the model's full forward, and
`CachedGPT(model)(tokens, cache, start)` runs `tokens` at positions `start, start + 1, ...`
against a preallocated `KVCache`, writing their keys and values into it. Both go through the
wrapper's one `__call__` so that a library that intercepts a model's `__call__` (Qwix's
post-training quantization) quantizes the cached forward and the full one alike.

The cached forward reuses every submodule of the model (embeddings, each block's
`attention_norm`, `attention.project` (the `qkv` projection, and RoPE at the cache positions
for "llama"), `attention.out`, `mlp_norm` and `mlp`, `final_norm`, the tied head or `head`),
so its logits are the full forward's for the same tokens, whatever layers the model was built
from (tested, teacher forced, to float tolerance). Only the attention is the library's
(`jax_epilog.write_kv` and `jax_epilog.decode_attention` over a `jax_epilog.KVCache` of every
layer, docs/kv_cache.md): each query attends over the whole cache with positions after it
masked out, so one compiled decode step serves every position. A prompt's prefill (`fresh`:
from position 0) runs the block's own causal attention over the prompt instead, as the full
forward does, and only writes the cache. Each layer's keys and values are written into the
whole `(layers, ...)` cache arrays with one `dynamic_update_slice` each, so the donated cache
is updated in place (no copy of it per step).

The cache is in the compute dtype, or in FP8 (`init_cache(..., jnp.float8_e4m3fn)`, as
TensorRT-LLM and vLLM offer for FP8 serving): each head's key or value vector stored with
a float32 scale of its own. How a decode step reads it and how it is laid out is the
library's measured rule, or `Generator(fp8_read=..., cache_layout=...)`.

`Generator` jits a prefill once per batch shape and a decode call once per batch shape and
step count (the cache donated, so it is updated in place) and samples greedily or with
temperature and top-k. One decode call runs up to `steps_per_call` decode steps in a device
loop: dispatching a step from Python (its arguments: every weight, the cache) takes about as
long as the step itself on an H200 at small batches, so one dispatch per token would measure
the host, not the model.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jax_epilog.layers.decode_attention import decode_attention
from jax_epilog.layers.kv_cache import KVCache, init_kv_cache, is_fp8, write_kv
from jax_epilog.layers.kv_cache import quantize_vectors  # noqa: F401 (the example's name for it)
from jax_epilog.planning.attention_plan import READS

from .model import GPT, ModelConfig


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype,
               layout: Optional[str] = None) -> KVCache:
    """An empty cache of every layer in `dtype`: the compute dtype, or an FP8 dtype (scaled per
    head vector), laid out by `layout` (FP8 only; None: the library's rule)."""
    if max_len > config.seq_len:
        raise ValueError(f"max_len: {max_len} is more than the model's seq_len "
                         f"{config.seq_len} (its learned positions)")
    return init_kv_cache(batch, max_len, config.kv_heads, config.head_dim, dtype,
                         layers=config.n_layers, query_heads=config.n_heads, layout=layout)


def _attend_to_cache(block, x, cache: KVCache, layer: int, start, fresh: bool,
                     read: Optional[str] = None):
    """One block's attention for `x` `(B, T, width)` at positions `start...`, and the cache
    with this step's keys and values written into `layer`. `fresh`: `forward_with_cache`'s;
    `read`: an FP8 cache's read form (None: the library's rule)."""
    batch, length, width = x.shape
    q, k, v = block.attention.project(x, start + jnp.arange(length))
    cache = write_kv(cache, k, v, start, layer=layer)
    if fresh:  # the block's own causal attention over this call's keys and values
        with jax.named_scope("cached_attention"):
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                             implementation=block.attention.implementation)
    else:
        # Query i (position start + i) sees cache positions up to its own; later ones are
        # empty.
        y = decode_attention(q, cache, start + length, layer=layer, read=read)
    return block.attention.out(y.reshape(batch, length, width)), cache


def forward_with_cache(model: GPT, tokens, cache: KVCache, start, *, last_only: bool = False,
                       fresh: bool = False, read: Optional[str] = None):
    """(logits, updated cache) for `tokens` `(B, T)` at positions `start ... start + T - 1`;
    `last_only`: the logits of the last position only `(B, 1, vocab)` (the head's GEMM for the
    others is skipped: generation needs only the next token). `fresh`: `start` is 0 and the
    cache holds nothing yet (a prompt's prefill), so each block attends to this call's own
    keys and values, in the compute dtype, by its own causal attention (cuDNN's fused one on
    a GPU), as the full forward does: nothing is read back from the cache, and no query
    scores the empty positions after the prompt."""
    x = model.embed(tokens, start + jnp.arange(tokens.shape[1]))
    for layer, block in enumerate(model.blocks):
        attended, cache = _attend_to_cache(block, block.attention_norm(x), cache, layer, start,
                                           fresh, read)
        x = x + attended
        x = x + block.mlp(block.mlp_norm(x))
    if last_only:
        x = x[:, -1:]
    return model.logits(x), cache


class CachedGPT(nnx.Module):
    """`(tokens)`: the model's full forward; `(tokens, cache, start)`: the cached one
    (`forward_with_cache`). One `__call__` for both: the module docstring says why."""

    def __init__(self, model: GPT):
        self.model = model

    def __call__(self, tokens, cache: Optional[KVCache] = None, start=0, *,
                 last_only: bool = False, fresh: bool = False, read: Optional[str] = None):
        if cache is None:
            return self.model(tokens)
        return forward_with_cache(self.model, tokens, cache, start, last_only=last_only,
                                  fresh=fresh, read=read)


def sample(logits, key, *, temperature: float = 0.0, top_k: Optional[int] = None):
    """The next tokens `(B,)` int32 from `logits` `(B, vocab)`: the argmax where `temperature`
    is 0, else a draw from softmax(logits / temperature) over the `top_k` largest."""
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0, got {temperature!r}")
    if top_k is not None and not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k: expected 1 to {logits.shape[-1]}, got {top_k!r}")
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


#: XLA's option that compiles a program without command buffers (CUDA graphs).
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}


class Generator:
    """The jitted prefill step and decode calls of one `CachedGPT` (its state captured once).

    `prefill(cache, prompt, key)` returns (the next tokens `(B,)`, the updated cache);
    `decode(cache, tokens, position, count, key)` runs `count` (1 to `steps_per_call`) decode
    steps from `tokens` `(B,)` at `position` and returns (the next `count` tokens
    `(steps_per_call, B)`, rows past `count` unused; the updated cache). The cache argument is
    donated. A step's random key is `fold_in(key, position)`, so a seed gives one sequence
    however it is stepped. `cache_dtype`: the KV cache's (`init_cache`), None for the compute
    dtype; `cache_layout` and `fp8_read`: an FP8 cache's layout and read form (the library's
    `init_kv_cache` and `decode_attention` overrides; None: its measured rule). The prefill
    step is compiled without XLA's command buffers (CUDA graphs) on a GPU unless
    `prefill_command_buffers`: on the H200 they slowed jax-epilog's FP8 prefill (its custom
    calls inside the graph) by up to 1.3x and did not speed the bf16 one (docs/serving.md).

    A decode call is compiled once per `count` (a static argument; `generate` needs at most
    two: `steps_per_call` and the last call's remainder). Its device loop then has a trip
    count XLA knows, so XLA queues the steps back to back. A loop whose count is an argument
    makes XLA copy its condition to the host and wait for it after every step: a round trip
    between the GPU and the host per token."""

    def __init__(self, cached: CachedGPT, *, temperature: float = 0.0,
                 top_k: Optional[int] = None, cache_dtype=None, steps_per_call: int = 16,
                 prefill_command_buffers: bool = False, cache_layout: Optional[str] = None,
                 fp8_read: Optional[str] = None):
        sample(jnp.zeros((1, cached.model.config.vocab_size)), None if temperature == 0 else
               jax.random.key(0), temperature=temperature, top_k=top_k)  # checks the arguments
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"steps_per_call: expected an int >= 1, got {steps_per_call!r}")
        self.config = cached.model.config
        self.cache_dtype = jnp.dtype(cache_dtype or cached.model.final_norm.dtype
                                     or jnp.float32)
        if fp8_read not in (None, *READS):
            raise ValueError(f"fp8_read: expected None (the library's rule) or one of {READS}, "
                             f"got {fp8_read!r}")
        self.cache_layout, self.fp8_read = cache_layout, fp8_read
        jax.eval_shape(lambda: self.new_cache(1, 1))  # checks the dtype and layout
        self.steps_per_call = steps_per_call
        # The weights flattened once, a list of arrays: an nnx.State passed to each call is
        # flattened again in Python every time, host time in front of every prefill.
        self.graphdef, state = nnx.split(cached)
        self.state, self._state_def = jax.tree.flatten(state)
        self._sample = functools.partial(sample, temperature=temperature, top_k=top_k)
        self.prefill_options = None if prefill_command_buffers or \
            jax.default_backend() != "gpu" else NO_COMMAND_BUFFERS
        self._prefill_step = jax.jit(self._prefill_and_sample, donate_argnums=1,
                                     compiler_options=self.prefill_options)
        self._steps = jax.jit(self._decode_steps, donate_argnums=1, static_argnums=4)

    def _prefill_and_sample(self, state, cache, tokens, key):
        """A prompt's prefill: `tokens` from position 0 into an empty cache, each block's
        attention over the prompt itself (`forward_with_cache`'s `fresh`)."""
        return self._forward_and_sample(state, cache, tokens, 0, key, fresh=True)

    def _forward_and_sample(self, state, cache, tokens, start, key, fresh: bool = False):
        cached = nnx.merge(self.graphdef, jax.tree.unflatten(self._state_def, state))
        logits, cache = cached(tokens, cache, start, last_only=True, fresh=fresh,
                               read=self.fp8_read)
        position = start + tokens.shape[1] - 1  # of the last token: the key depends on it
        return self._sample(logits[:, -1], jax.random.fold_in(key, position)), cache

    def _decode_steps(self, state, cache, tokens, position, count, key):
        def step(i, carry):
            tokens, cache, out = carry
            tokens, cache = self._forward_and_sample(state, cache, tokens[:, None],
                                                     position + i, key)
            return tokens, cache, out.at[i].set(tokens)

        out = jnp.zeros((self.steps_per_call,) + tokens.shape, jnp.int32)
        _, cache, out = jax.lax.fori_loop(0, count, step, (tokens, cache, out))
        return out, cache

    def decode_counts(self, new_tokens: int) -> tuple[int, ...]:
        """The step counts of the decode calls `generate(..., new_tokens)` makes: a full call's
        and the last one's, where that differs (none for one new token)."""
        steps = new_tokens - 1
        return tuple(sorted({min(self.steps_per_call, steps), steps % self.steps_per_call} - {0}))

    def lower(self, batch: int, prompt_len: int, new_tokens: int, key, counts=None) -> dict:
        """The prefill step and the decode calls lowered for `batch` prompts of `prompt_len`
        tokens and a cache for `new_tokens` more: {"prefill": ..., "decode": {count: ...}},
        one decode call per count of `counts` (default `decode_counts(new_tokens)`)."""
        check_fits(self.config, prompt_len, new_tokens)
        cache = jax.eval_shape(lambda: self.new_cache(batch, prompt_len + new_tokens))
        tokens = lambda length: jax.ShapeDtypeStruct((batch,) + length, jnp.int32)
        counts = self.decode_counts(new_tokens) if counts is None else counts
        for count in counts:
            self._check_count(count)
        return {"prefill": self._prefill_step.lower(self.state, cache, tokens((prompt_len,)),
                                                    key),
                "decode": {count: self._steps.lower(self.state, cache, tokens(()),
                                                    jnp.int32(0), count, key)
                           for count in counts}}

    def compile(self, batch: int, prompt_len: int, new_tokens: int, key, *, counts=None,
                options=None) -> dict:
        """`lower`'s programs compiled, with `options` (XLA compiler options) where given,
        else the prefill with `prefill_options`, which its jit carries into the compile."""
        lowered = self.lower(batch, prompt_len, new_tokens, key, counts)
        return {"prefill": lowered["prefill"].compile(options),
                "decode": {count: program.compile(options)
                           for count, program in lowered["decode"].items()}}

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return init_cache(self.config, batch, max_len, self.cache_dtype,
                          self.cache_layout if is_fp8(self.cache_dtype) else None)

    def prefill(self, cache: KVCache, prompt, key, compiled=None):
        """(The next tokens `(B,)`, `cache` with `prompt` `(B, P)` written from position 0):
        the prompt attends to itself, not to what the cache held before."""
        step = compiled or self._prefill_step
        return step(self.state, cache, _int32_array(prompt), key)

    def decode(self, cache: KVCache, tokens, position: int, count: int, key, compiled=None):
        """`count` decode steps (see the class), by `compiled[count]` (`compile`'s "decode")
        where given, else by the jit."""
        self._check_count(count)
        # A NumPy scalar, not jnp.int32(...): that is an eager device op of its own, about
        # 0.5 ms of host time in front of every call (an H200 trace of the prefill).
        args = (self.state, cache, tokens, np.int32(position))
        if compiled is None:
            return self._steps(*args, count, key)
        if count not in compiled:
            raise ValueError(f"compiled: holds decode calls of {sorted(compiled)} steps, not "
                             f"{count}; compile them for these new_tokens (decode_counts)")
        return compiled[count](*args, key)

    def _check_count(self, count) -> None:
        if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or \
                not 1 <= count <= self.steps_per_call:
            raise ValueError(f"count: expected an int from 1 to steps_per_call "
                             f"({self.steps_per_call}), got {count!r}")

    def generate(self, prompt, new_tokens: int, key, *, compiled: Optional[dict] = None,
                 progress: bool = False) -> Generation:
        """`new_tokens` tokens after `prompt` `(B, P)`: the first from the prefill, the others
        from decode calls of up to `steps_per_call` steps each, with the `compiled` steps
        (`compile`) or jit's. Timed: the prefill until its tokens are on the host (time to
        first token), then the decode calls back to back until the last is ready.
        `progress`: a tqdm bar over the decode steps."""
        batch, prompt_len = np.shape(prompt)
        check_fits(self.config, prompt_len, new_tokens)
        compiled = compiled or {}
        cache = jax.block_until_ready(self.new_cache(batch, prompt_len + new_tokens))
        prompt = jax.block_until_ready(jnp.asarray(prompt, jnp.int32))
        start = time.perf_counter()
        token, cache = self.prefill(cache, prompt, key, compiled.get("prefill"))
        first = np.asarray(token)  # a server would hand the first tokens on here
        prefill_s = time.perf_counter() - start
        chunks, end = [], prompt_len + new_tokens - 1
        start = time.perf_counter()
        with tqdm(total=new_tokens - 1, desc="decode", unit="step",
                  disable=not progress) as bar:
            for position in range(prompt_len, end, self.steps_per_call):
                count = min(self.steps_per_call, end - position)
                out, cache = self.decode(cache, token, position, count, key,
                                         compiled.get("decode"))
                chunks.append((out, count))
                token = out[count - 1]
                bar.update(count)
        jax.block_until_ready(token)
        decode_s = time.perf_counter() - start
        decoded = [np.asarray(out)[:count] for out, count in chunks]
        return Generation(np.concatenate([first[None]] + decoded, axis=0).T, prefill_s,
                          decode_s)


def _int32_array(tokens):
    """`tokens` as int32 for a compiled call: a device array as it is, anything else as a
    NumPy array (which the call transfers), without an eager conversion on the device."""
    if isinstance(tokens, jax.Array) and tokens.dtype == jnp.int32:
        return tokens
    return np.asarray(tokens, np.int32)


class Generation(NamedTuple):
    """Generated tokens `(B, new_tokens)` and the wall times of the prefill (to the first
    tokens on the host) and of the decode steps."""

    tokens: np.ndarray
    prefill_s: float
    decode_s: float


def check_fits(config: ModelConfig, prompt_len: int, new_tokens: int) -> None:
    """The prompt and the new tokens must fit the model's learned positions."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len: expected >= 1, got {prompt_len}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens: expected >= 1, got {new_tokens}")
    if prompt_len + new_tokens > config.seq_len:
        raise ValueError(f"prompt_len + new_tokens: {prompt_len} + {new_tokens} = "
                         f"{prompt_len + new_tokens} is more than the model's seq_len "
                         f"{config.seq_len} (its learned positions)")
