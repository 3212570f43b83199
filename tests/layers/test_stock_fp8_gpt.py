"""The example's stock GPT and Llama (`examples/gpt`, impl "stock", `nnx.Linear` projections)
trained in FP8 by `jax_epilog.nnx.fp8_training`, the model's code unchanged, through the
example's own `Trainer` (which keeps Flax's FP8 state as its FP8 state)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("optax")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from flax import nnx  # noqa: E402

import jax_epilog  # noqa: E402
from gpt import configs, data, train  # noqa: E402

ALL = jax_epilog.Fp8(layers="all")


def _linears(model) -> list[str]:
    return ["/".join(map(str, path)) for path, m in nnx.iter_modules(model)
            if isinstance(m, nnx.Linear)]


@pytest.mark.parametrize("config", ["tiny", "llama_tiny"])
def test_every_projection_gets_the_fp8_op_named_by_its_path(config):
    stock = train.build_model(configs.CONFIGS[config], "stock")
    trained = jax_epilog.nnx.fp8_training(stock, fp8=ALL)
    linears = _linears(trained)
    assert linears and all(
        isinstance(m.dot_general, jax_epilog.nnx.Fp8DotGeneral) and
        m.dot_general.name == "/".join(map(str, path))
        for path, m in nnx.iter_modules(trained) if isinstance(m, nnx.Linear))
    assert all(m.dot_general is jax.lax.dot_general for path, m in nnx.iter_modules(stock)
               if isinstance(m, nnx.Linear))
    only_mlp = jax_epilog.nnx.fp8_training(stock, rules=r".*/mlp/.*", fp8=ALL)
    chosen = {"/".join(map(str, p)) for p, m in nnx.iter_modules(only_mlp)
              if isinstance(getattr(m, "dot_general", None), jax_epilog.nnx.Fp8DotGeneral)}
    assert chosen and chosen == {p for p in linears if "/mlp/" in p}


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tiny", "llama_tiny"])
def test_the_example_trainer_trains_the_stock_model_in_fp8(config):
    config = configs.CONFIGS[config]
    corpus = np.random.default_rng(0).integers(0, 255, 5000).astype(np.uint8)
    batches = data.Batches(corpus, 4, config.model.seq_len, 0)
    losses = {}
    for name in ("stock", "fp8"):
        stock = train.build_model(config, "stock")
        model = jax_epilog.nnx.fp8_training(stock, fp8=ALL) if name == "fp8" else stock
        trainer = train.Trainer(model, train.make_optimizer(config))
        state, losses[name] = trainer.initial, []
        for i in range(3):
            state, metrics = trainer.step(state, *batches.batch(i))
            losses[name].append(float(metrics["loss"]))
    fp8_state = jax.tree.leaves(state.fp8)  # the FP8 model's, written by its gradients
    assert len(fp8_state) == 6 * len(_linears(model))
    assert all(float(jnp.max(leaf)) > 0 for leaf in fp8_state)
    np.testing.assert_allclose(losses["fp8"], losses["stock"], rtol=5e-3)
