"""The example's `--impl stock` GPT and Llama (`examples/gpt/model.py`, `nnx.Linear`
projections) switched to FP8 by one call, the model's code unchanged: `train.py --impl stock
--fp8` (and compare.py's `stock_fp8`) build it through `train.build_model`, which calls
`jax_epilog.nnx.fp8_training` on the stock model. Serving the same model by one call
(`generate.py --variant stock_fp8`) is tested in test_gpt_generate.py and
test_generate_cli.py. On the CPU, one block of the tiny configs."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("tqdm")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from flax import nnx  # noqa: E402

import jax_epilog  # noqa: E402
from gpt import configs, data, model, train  # noqa: E402

TINY = configs.get("tiny").replace(n_layers=1)
LLAMA_TINY = configs.get("llama_tiny").replace(n_layers=1)
ALL = jax_epilog.Fp8(layers="all")  # the tiny configs are too small for "auto" to pick FP8


def _linears(module) -> dict[str, nnx.Module]:
    return {"/".join(map(str, path)): m for path, m in nnx.iter_modules(module)
            if isinstance(m, nnx.Linear)}


@pytest.mark.parametrize("config", [TINY, LLAMA_TINY], ids=["tiny", "llama_tiny"])
def test_build_model_switches_the_stock_model_by_one_call(config, monkeypatch):
    monkeypatch.setattr(train, "FP8_RECIPE", ALL)
    stock = train.build_model(config, "stock")
    fp8 = train.build_model(config, "stock", fp8=True)
    assert type(fp8) is model.GPT and not model.split(stock)[2]  # same class, code unchanged
    linears = _linears(fp8)
    per_block = 5 if config.model.arch == "llama" else 4  # qkv, out, the MLP's 3 or 2
    assert linears.keys() == _linears(stock).keys()
    assert len(linears) >= per_block * config.model.n_layers
    for path, layer in linears.items():
        assert layer.dot_general.name == path
        # GPT's projections have biases: run whole, the bias in the FP8 GEMM's epilog
        assert type(layer).__name__ == ("TrainedLinear" if layer.bias is not None else "Linear")
    assert any(m.bias is not None for m in linears.values()) == (config.model.arch == "gpt")
    params = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
    for got, want in zip(params(fp8), params(stock)):
        np.testing.assert_array_equal(got, want)  # the same initial weights
    # Flax's FP8 state, six variables a projection, in the Trainer's FP8 part
    assert len(jax.tree.leaves(model.split(fp8)[2])) == 6 * len(linears)
    with pytest.raises(ValueError, match="block scaling is for impl='epilog'"):
        train.build_model(config, "stock", fp8=True, fp8_scaling="block")
    with pytest.raises(ValueError, match="impl 'epilog' .* or 'stock'"):
        train.build_model(config, "flax_fp8", fp8=True)


def test_train_trains_the_stock_model_in_fp8(monkeypatch):
    """`train.py --impl stock --fp8`: FP8 GEMMs in the compiled step, the FP8 state written by
    the step, and a loss close to the 16-bit stock model's."""
    monkeypatch.setattr(train, "FP8_RECIPE", ALL)
    config = TINY.replace(batch_size=4)
    corpus = np.random.default_rng(0).integers(0, 255, 5000).astype(np.uint8)
    batch = data.Batches(corpus, config.batch_size, config.model.seq_len, 0).batch(0)
    losses = {}
    for fp8 in (False, True):
        trainer = train.Trainer(train.build_model(config, "stock", fp8=fp8),
                                train.make_optimizer(config))
        compiled, _ = trainer.compile(trainer.initial, batch)
        state, metrics = compiled(trainer.initial, *batch)
        losses[fp8] = float(metrics["loss"])
    hlo = compiled.as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo
    histories = [leaf for leaf in jax.tree.leaves(state.fp8) if leaf.shape != (1,)]
    assert histories and all(float(jnp.max(h)) > 0 for h in histories)
    np.testing.assert_allclose(losses[True], losses[False], rtol=5e-3)
