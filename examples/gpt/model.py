"""A decoder-only transformer in Flax NNX, GPT-2- or Llama-shaped, built from one of three sets
of layers.

`GPT(config, impl=..., rngs=...)`, by `config.arch`:

- "gpt": token and learned position embeddings, `n_layers` pre-LayerNorm blocks (causal
  self-attention, then a GELU MLP, each with its residual, every projection with a bias), a
  final LayerNorm and the head (tied to the token embedding, or its own projection).
- "llama": token embedding only, pre-RMSNorm blocks (causal self-attention with rotary
  position embeddings on queries and keys and `n_kv_heads` key/value heads shared by groups of
  the `n_heads` query heads, then a SwiGLU MLP `down(silu(gate(x)) * up(x))`), a final RMSNorm
  and an untied head; no biases anywhere.

The projections come from `impl`:

- "stock": `nnx.Linear`, `jax.nn.gelu` between the MLP's two layers.
- "epilog": `jax_epilog.nnx.Dense` (QKV and output projections) and `jax_epilog.nnx.MLP` (both MLP
  layers as one fused call, GELU in the first GEMM's epilog); `fp8=` trains them in FP8.
- "flax_fp8": Flax's own FP8, `linen.Dense(dot_general_cls=Fp8DirectDotGeneralOp)` wrapped for
  NNX by `nnx.bridge.ToNNX`.

The Llama MLP, `down(silu(gate(x)) * up(x))` without biases, is `SwiGLU` (three of `impl`'s
dense layers) for "stock" and "flax_fp8", and `jax_epilog.nnx.SwiGLU` for "epilog": the
block as one call, whose FP8 form runs gate and up as one FP8 GEMM and keeps only FP8
activations for its backward. Its parameters are the three layers' (`gate`, `up`, `down`,
each a `kernel`), drawn in the same order.

Every impl draws the same parameters from the same `nnx.Rngs`, in the same order, under the same
names (`blocks/0/attention/qkv/kernel`, `blocks/0/mlp/layers/1/bias`, ...), so one seed gives one
set of initial weights whichever layers run, and a checkpoint of one loads into the others. The
head stays in the compute dtype under FP8 (its N is the 256-byte vocabulary: too small to gain).

FP8 scaling state (`jax_epilog.nnx.AmaxHistory` under delayed scaling, Flax's
"_overwrite_with_gradient" variables) is selected by `FP8_STATE`: its gradient is its next value.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.linen import fp8_ops

import jax_epilog
import jax_epilog.nnx

IMPLS = ("stock", "epilog", "flax_fp8")
ATTENTION = ("auto", "cudnn", "xla")
ARCHS = ("gpt", "llama")

# Flax >= 0.12 wants lists of modules wrapped so it can see their state; older Flax takes lists.
_ModuleList = getattr(nnx, "List", list)

#: The NNX variable type `nnx.bridge` gives Flax's FP8 collection ("_overwrite_with_gradient").
FlaxFp8State = nnx.variablelib.variable_type_from_name(fp8_ops.OVERWRITE_WITH_GRADIENT,
                                                       allow_register=True)
#: Every FP8 scaling variable: not a parameter; its gradient is its next value.
FP8_STATE = nnx.Any(jax_epilog.nnx.AmaxHistory, FlaxFp8State)

#: GPT-2's embedding initialisation (the projections keep Flax's default, LeCun normal).
EMBEDDING_INIT = nnx.initializers.normal(stddev=0.02)

#: The largest vocabulary `TokenEmbedding` looks up with a one-hot matmul (larger ones gather).
ONE_HOT_MAX_VOCAB = 4096


class TokenEmbedding(nnx.Embed):
    """`nnx.Embed` whose lookup is a one-hot matmul for a small vocabulary.

    A gather's gradient is a scatter-add of every token's row into the table. With 256 byte
    values and 16384 tokens a step, most tokens land on a few rows, and XLA's scatter ran
    9.5 ms of a 97 ms FP8 step of the `large` config on the H200, in every variant. As a
    matmul the gradient is `one_hot(tokens)ᵀ @ dx` (34 GFLOP there), summed in float32
    rather than bf16. Same parameter, same values forward.
    """

    def __call__(self, tokens):
        if self.num_embeddings > ONE_HOT_MAX_VOCAB:
            return super().__call__(tokens)
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"tokens: expected integers, got {tokens.dtype}")
        embedding = self.embedding[...]
        embedding = embedding.astype(self.dtype or embedding.dtype)
        return jax.nn.one_hot(tokens, self.num_embeddings, dtype=embedding.dtype) @ embedding


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture (`arch`: module docstring). `vocab_size` 256: bytes. `n_kv_heads`
    (None: `n_heads`) key/value heads, "llama" only; `mlp_hidden` (None: `mlp_ratio * d_model`)
    the MLP's hidden width; `rope_theta` the rotary embeddings' base ("llama")."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    vocab_size: int = 256
    mlp_ratio: int = 4
    tie_head: bool = True
    arch: str = "gpt"
    n_kv_heads: Optional[int] = None
    mlp_hidden: Optional[int] = None
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch: expected one of {ARCHS}, got {self.arch!r}")
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "vocab_size", "mlp_ratio",
                     "n_kv_heads", "mlp_hidden"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_heads", "mlp_hidden"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads: expected a divisor of d_model={self.d_model}, got "
                             f"{self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads={self.n_heads}, got "
                             f"{self.n_kv_heads}")
        if self.arch == "gpt" and self.kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads: arch 'gpt' has n_heads={self.n_heads} key/value "
                             f"heads, got {self.n_kv_heads} (grouped-query attention is "
                             "arch='llama')")
        if self.arch == "llama":
            if self.tie_head:
                raise ValueError("tie_head: arch 'llama' has an untied head; set "
                                 "tie_head=False")
            if self.head_dim % 2:
                raise ValueError(f"n_heads: arch 'llama' rotates pairs of features, so "
                                 f"d_model / n_heads must be even, got {self.head_dim}")
            if not self.rope_theta > 0:
                raise ValueError(f"rope_theta: expected > 0, got {self.rope_theta!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `n_kv_heads`, or `n_heads` where that is None."""
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        return self.mlp_hidden or self.mlp_ratio * self.d_model


def attention_implementation(choice: str, dtype) -> str:
    """`jax.nn.dot_product_attention`'s implementation for `choice`: "auto" is cuDNN's fused
    attention on a GPU in 16-bit, XLA's otherwise. (JAX's own None currently means XLA on every
    platform, which materialises the T x T scores.)"""
    if choice not in ATTENTION:
        raise ValueError(f"attention: expected one of {ATTENTION}, got {choice!r}")
    if choice != "auto":
        return choice
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if jax.default_backend() == "gpu" and sixteen_bit else "xla"


class StackedMLP(nnx.Module):
    """Two projections with GELU (tanh approximation, as cuBLASLt's epilog) between, stored as
    `layers` like `jax_epilog.nnx.MLP`."""

    def __init__(self, up: nnx.Module, down: nnx.Module):
        self.layers = _ModuleList([up, down])

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x), approximate=True))


class SwiGLU(nnx.Module):
    """Llama's MLP, `down(silu(gate(x)) * up(x))`, from three dense layers without bias: the
    state of `jax_epilog.nnx.SwiGLU`, which replaces it whole for impl "epilog"."""

    def __init__(self, gate: nnx.Module, up: nnx.Module, down: nnx.Module):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def rope(x, positions, theta: float = 10000.0):
    """Rotary position embeddings on `x` `(B, T, heads, head_dim)` at `positions` `(T,)`: the
    feature pairs (i, i + head_dim/2) rotated by `position * theta**(-2i/head_dim)` (Llama's
    and MaxText's layout), in float32, returned in `x`'s dtype."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.asarray(positions, jnp.float32)[:, None] * frequencies  # (T, half)
    cos, sin = jnp.cos(angles)[:, None], jnp.sin(angles)[:, None]       # (T, 1, half)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return rotated.astype(x.dtype)


def flax_fp8_linear(stock: nnx.Linear) -> nnx.Module:
    """`stock`'s layer (same parameters) as Flax's FP8 dense layer:
    `linen.Dense(dot_general_cls=Fp8DirectDotGeneralOp)` under `nnx.bridge.ToNNX`. Its FP8
    scales and amax histories are `FlaxFp8State` variables."""
    layer = nnx.bridge.ToNNX(
        linen.Dense(stock.out_features, use_bias=stock.bias is not None, dtype=stock.dtype,
                    param_dtype=stock.param_dtype,
                    dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
        rngs=nnx.Rngs(0))  # draws thrown away: the parameters are `stock`'s
    nnx.bridge.lazy_init(layer, jnp.zeros((1, stock.in_features), stock.param_dtype))
    layer.to_nnx__rngs = None  # a dense layer draws nothing when applied
    nnx.update(layer, nnx.state(stock, nnx.Param))
    return layer


@dataclasses.dataclass(frozen=True)
class Layers:
    """Builds the model's projections for one `impl` (module docstring), in `dtype`, with
    `fp8` (a `jax_epilog.Fp8`, "epilog" only) on the quantized ones."""

    impl: str
    dtype: Any
    fp8: Optional[jax_epilog.Fp8] = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl: expected one of {IMPLS}, got {self.impl!r}")
        if self.fp8 is not None and self.impl != "epilog":
            raise ValueError(f"fp8: jax_epilog's FP8 is for impl='epilog', got impl="
                             f"{self.impl!r} (Flax's own FP8 is impl='flax_fp8')")

    def dense(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
              use_bias: bool = True, quantized: bool = True) -> nnx.Module:
        if self.impl == "epilog":
            return jax_epilog.nnx.Dense(in_features, out_features, use_bias=use_bias,
                                        dtype=self.dtype, fp8=self.fp8 if quantized else None,
                                        rngs=rngs)
        stock = nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=self.dtype,
                           rngs=rngs)
        return flax_fp8_linear(stock) if self.impl == "flax_fp8" and quantized else stock

    def mlp(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, arch: str = "gpt") -> nnx.Module:
        if arch == "llama" and self.impl == "epilog":
            return jax_epilog.nnx.SwiGLU(d_model, hidden, dtype=self.dtype, fp8=self.fp8,
                                         rngs=rngs)
        if arch == "llama":
            return SwiGLU(*(self.dense(i, o, use_bias=False, rngs=rngs) for i, o in
                            ((d_model, hidden), (d_model, hidden), (hidden, d_model))))
        if self.impl == "epilog":
            return jax_epilog.nnx.MLP(d_model, [hidden, d_model], activation="gelu",
                                      dtype=self.dtype, fp8=self.fp8, rngs=rngs)
        return StackedMLP(self.dense(d_model, hidden, rngs=rngs),
                          self.dense(hidden, d_model, rngs=rngs))


class CausalSelfAttention(nnx.Module):
    """Queries, keys and values from one projection `qkv` (its columns: the `n_heads` query
    heads, then the key heads, then the value heads), RoPE on queries and keys for "llama",
    `jax.nn.dot_product_attention` (grouped where there are fewer key/value heads), `out`."""

    def __init__(self, config: ModelConfig, layers: Layers, attention: str, *, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta if config.arch == "llama" else None
        self.implementation = attention_implementation(attention, layers.dtype)
        bias = config.arch == "gpt"
        width = (config.n_heads + 2 * config.kv_heads) * config.head_dim
        self.qkv = layers.dense(config.d_model, width, use_bias=bias, rngs=rngs)
        self.out = layers.dense(config.d_model, config.d_model, use_bias=bias, rngs=rngs)

    def project(self, x, positions):
        """(queries `(B, T, n_heads, head_dim)`, keys, values `(B, T, n_kv_heads, head_dim)`)
        of `x` `(B, T, d_model)` at `positions` `(T,)`."""
        batch, length, _ = x.shape
        heads = self.qkv(x).reshape(batch, length, self.n_heads + 2 * self.n_kv_heads,
                                    self.head_dim)
        q, k, v = jnp.split(heads, [self.n_heads, self.n_heads + self.n_kv_heads], axis=2)
        if self.rope_theta is not None:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        return q, k, v

    def __call__(self, x):
        batch, length, width = x.shape
        q, k, v = self.project(x, jnp.arange(length))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=self.implementation)
        return self.out(y.reshape(batch, length, width))


def norm(config: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
    """LayerNorm ("gpt") or RMSNorm, scale only ("llama")."""
    kind = nnx.RMSNorm if config.arch == "llama" else nnx.LayerNorm
    return kind(config.d_model, dtype=dtype, rngs=rngs)


class Block(nnx.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layers: Layers, attention: str, *, rngs: nnx.Rngs):
        self.attention_norm = norm(config, layers.dtype, rngs)
        self.attention = CausalSelfAttention(config, layers, attention, rngs=rngs)
        self.mlp_norm = norm(config, layers.dtype, rngs)
        self.mlp = layers.mlp(config.d_model, config.hidden, rngs=rngs, arch=config.arch)

    def __call__(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nnx.Module):
    """`GPT(config, impl=..., dtype=..., fp8=..., rngs=...)(tokens)`: logits `(B, T, vocab)` in
    the compute dtype for `tokens` `(B, T)` of ints below `vocab_size`, `T <= seq_len`.

    Args:
      impl: "stock", "epilog" or "flax_fp8" (module docstring).
      dtype: the compute dtype (parameters are float32).
      fp8: None, or a `jax_epilog.Fp8` for every projection of impl "epilog".
      attention: "auto", "cudnn" or "xla" (`attention_implementation`).
    """

    def __init__(self, config: ModelConfig, *, impl: str = "stock", dtype: Any = jnp.float32,
                 fp8: Optional[jax_epilog.Fp8] = None, attention: str = "auto",
                 rngs: nnx.Rngs):
        layers = Layers(impl, dtype, fp8)
        self.config = config
        embed = dict(embedding_init=EMBEDDING_INIT, dtype=dtype, rngs=rngs)
        self.token_embedding = TokenEmbedding(config.vocab_size, config.d_model, **embed)
        self.position_embedding = nnx.Embed(config.seq_len, config.d_model, **embed) \
            if config.arch == "gpt" else None  # "llama": RoPE in the attention
        self.blocks = _ModuleList([Block(config, layers, attention, rngs=rngs)
                                   for _ in range(config.n_layers)])
        self.final_norm = norm(config, dtype, rngs)
        self.head = None if config.tie_head else layers.dense(
            config.d_model, config.vocab_size, use_bias=False, quantized=False, rngs=rngs)

    def __call__(self, tokens):
        if tokens.ndim != 2 or tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"tokens: expected shape (batch, length <= {self.config.seq_len}), "
                             f"got {tokens.shape}")
        x = self.embed(tokens, jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    def embed(self, tokens, positions):
        """The blocks' input for `tokens` `(B, T)` at `positions` `(T,)`."""
        x = self.token_embedding(tokens)
        return x if self.position_embedding is None else x + self.position_embedding(positions)

    def logits(self, x):
        """The final norm and the head on the blocks' output."""
        x = self.final_norm(x)
        return self.token_embedding.attend(x) if self.head is None else self.head(x)


def split(model: GPT):
    """(graphdef, parameters, FP8 scaling state, the rest) of `model`, for a functional step."""
    return nnx.split(model, nnx.Param, FP8_STATE, ...)
