"""Run configurations: `tiny` (CPU, tests), `small` (d_model 2048) and `large` (d_model 4096),
GPT-2-shaped; `llama_tiny`, `llama_small` and `llama_large` the same sizes Llama-shaped
(`model.py`'s arch "llama").

`small` and `large` are sized for one H200: 16 x 1024 = 16384 tokens per step (the rows of
every projection GEMM) and a layer count that keeps a few hundred steps to a few minutes.
`llama_small` has Llama 3.2 1B's layer (d_model 2048, 32 query / 8 key-value heads, SwiGLU
hidden 8192) and `llama_large` Llama 3 8B's (d_model 4096, 32 / 8 heads, hidden 14336), four
layers of which hold about as many parameters as `large`'s four.

`large_8k` and `llama_large_8k` are `large` and `llama_large` with 8192 positions, for serving
long contexts (`generate.py --prompt-len 7936 --new-tokens 256` decodes over an 8k cache,
`--prompt-len 1792` over a 2k one): one sequence a batch, so that the validation passes' full
attention over 8192 positions (a float32 score per query and position) fits one GPU.

`llama_served` is `llama_small` trained ten times longer (3000 steps, 49M tokens: the training
text about 1.7 times), long enough to write readable Python, for `serve_trained.py`'s trained
model served in FP8. Its step costs about 1.2 times `small`'s FLOPs (363M parameters against
302M in the blocks), so at `small`'s H200 speed per FLOP, which is `llama_large`'s on an H100
(results/h200/gpt_compare.md, results/h100/llama_compare_300_steps.md), stock bf16 trains it at
about 230k tokens/s: about 70 ms a step, the 3000 steps in about 215 s.
"""

from __future__ import annotations

import dataclasses

from .model import ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    batch_size: int
    steps: int
    learning_rate: float
    warmup_steps: int
    min_learning_rate_ratio: float = 0.1  # the cosine decays to this fraction of the peak
    weight_decay: float = 0.1             # on the matrices (kernels, embeddings) only
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0                # global gradient norm
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    checkpoint_every: int = 0             # 0: only at the end (with --checkpoint-dir)
    seed: int = 0

    def __post_init__(self):
        for name in ("batch_size", "steps", "eval_every", "eval_batches", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"warmup_steps: expected 0 to steps={self.steps}, got "
                             f"{self.warmup_steps!r}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected >= 0, got {self.checkpoint_every!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes`; model fields (`d_model=...`) go to `model`."""
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
        model = dataclasses.replace(self.model, **{k: v for k, v in changes.items()
                                                   if k in model_fields})
        return dataclasses.replace(self, model=model, **{k: v for k, v in changes.items()
                                                         if k not in model_fields})


_LLAMA = dict(arch="llama", tie_head=False)

CONFIGS = {
    "tiny": TrainConfig(ModelConfig(d_model=64, n_layers=2, n_heads=4, seq_len=64),
                        batch_size=8, steps=60, learning_rate=3e-3, warmup_steps=10,
                        eval_every=20, eval_batches=2, log_every=5),
    "small": TrainConfig(ModelConfig(d_model=2048, n_layers=6, n_heads=16, seq_len=1024),
                         batch_size=16, steps=600, learning_rate=3e-4, warmup_steps=60,
                         eval_every=100, eval_batches=8),
    "large": TrainConfig(ModelConfig(d_model=4096, n_layers=4, n_heads=32, seq_len=1024),
                         batch_size=16, steps=400, learning_rate=2e-4, warmup_steps=40,
                         eval_every=100, eval_batches=8),
    "llama_tiny": TrainConfig(ModelConfig(d_model=64, n_layers=2, n_heads=4, seq_len=64,
                                          **_LLAMA, n_kv_heads=2, mlp_hidden=172),
                              batch_size=8, steps=60, learning_rate=3e-3, warmup_steps=10,
                              eval_every=20, eval_batches=2, log_every=5),
    "llama_small": TrainConfig(ModelConfig(d_model=2048, n_layers=6, n_heads=32, seq_len=1024,
                                           **_LLAMA, n_kv_heads=8, mlp_hidden=8192),
                               batch_size=16, steps=600, learning_rate=3e-4, warmup_steps=60,
                               eval_every=100, eval_batches=8),
    "llama_large": TrainConfig(ModelConfig(d_model=4096, n_layers=4, n_heads=32, seq_len=1024,
                                           **_LLAMA, n_kv_heads=8, mlp_hidden=14336),
                               batch_size=16, steps=400, learning_rate=2e-4, warmup_steps=40,
                               eval_every=100, eval_batches=8),
}
CONFIGS["llama_served"] = CONFIGS["llama_small"].replace(steps=3000, warmup_steps=150,
                                                       eval_every=500)
CONFIGS |= {f"{name}_8k": CONFIGS[name].replace(seq_len=8192, batch_size=1)
            for name in ("large", "llama_large")}


def get(name: str) -> TrainConfig:
    if name not in CONFIGS:
        raise ValueError(f"config: expected one of {tuple(CONFIGS)}, got {name!r}")
    return CONFIGS[name]
