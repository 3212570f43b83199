"""The GPT example (examples/gpt/): the data split, the same model from stock and jax-epilog
layers, training with a falling loss, bit-for-bit resumption, and the side-by-side benchmark.

On the CPU with the `tiny` config (a few seconds of compilation per model)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("tqdm")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from flax import nnx  # noqa: E402

import jax_epilog  # noqa: E402

from gpt import configs, data, model, train  # noqa: E402

TINY = configs.get("tiny").replace(n_layers=1)  # one block: compiles in half the time
LLAMA_TINY = configs.get("llama_tiny").replace(n_layers=1)


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus()


def params_of(module):
    return nnx.state(module, nnx.Param)


# --- data ------------------------------------------------------------------------------------

def test_split_is_by_file_deterministic_and_disjoint(corpus):
    again = data.load_corpus()
    assert again.train_files == corpus.train_files
    assert again.validation_files == corpus.validation_files
    np.testing.assert_array_equal(again.validation, corpus.validation)
    assert not set(corpus.train_files) & set(corpus.validation_files)
    assert set(corpus.train_files) | set(corpus.validation_files) == \
        set(data.source_files(Path(corpus.root)))
    assert all("site-packages" not in f for f in corpus.train_files)
    assert 0.01 < len(corpus.validation_files) / len(corpus.train_files) < 0.15
    # Each split is its files' bytes joined by the separator, nothing else.
    root = Path(corpus.root)
    first = (root / corpus.validation_files[0]).read_bytes()
    assert corpus.validation[:len(first)].tobytes() == first
    assert corpus.validation[len(first)] == data.FILE_SEPARATOR
    separators = np.count_nonzero(corpus.validation == data.FILE_SEPARATOR)
    assert separators >= len(corpus.validation_files) - 1


def test_split_follows_a_hash_of_the_path_not_the_file_set(tmp_path):
    """Adding a file moves no other file between the splits."""
    for i in range(60):
        (tmp_path / f"module_{i}.py").write_text(f"x = {i}\n")
    before = data.load_corpus(tmp_path, validation_percent=20)
    (tmp_path / "new_module.py").write_text("y = 1\n")
    after = data.load_corpus(tmp_path, validation_percent=20)
    assert set(before.validation_files) <= set(after.validation_files)
    assert set(before.train_files) <= set(after.train_files)


def test_batches_are_a_function_of_seed_and_position(corpus):
    batches = data.Batches(corpus.train, batch_size=3, seq_len=17, seed=5)
    drawn = [next(batches) for _ in range(4)]
    resumed = data.Batches(corpus.train, batch_size=3, seq_len=17, seed=5, position=2)
    for (x, y), (rx, ry) in zip(drawn[2:], [next(resumed), next(resumed)]):
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
    x, y = drawn[0]
    assert x.shape == y.shape == (3, 17) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert not np.array_equal(drawn[0][0], drawn[1][0])


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="validation_percent"):
        data.load_corpus(validation_percent=0)
    with pytest.raises(ValueError, match="seq_len"):
        data.Batches(np.zeros(10, np.uint8), batch_size=1, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="impl"):
        model.GPT(TINY.model, impl="torch", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fp8"):
        train.build_model(TINY, "flax_fp8", fp8=True)
    with pytest.raises(ValueError, match="fp8_scaling"):
        train.build_model(TINY, "stock", fp8=True, fp8_scaling="block")
    with pytest.raises(ValueError, match="n_heads"):
        model.ModelConfig(d_model=64, n_layers=1, n_heads=5, seq_len=8)
    with pytest.raises(ValueError, match="warmup_steps"):
        TINY.replace(steps=4, warmup_steps=5)
    with pytest.raises(ValueError, match="tokens"):
        model.GPT(TINY.model, rngs=nnx.Rngs(0))(jnp.zeros((1, TINY.model.seq_len + 1), int))


# --- the model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tie_head", [True, False])
def test_every_impl_starts_from_the_same_weights(tie_head):
    config = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, tie_head=tie_head))
    stock = params_of(train.build_model(config, "stock"))
    for impl, fp8 in [("epilog", False), ("epilog", True), ("flax_fp8", False)]:
        other = params_of(train.build_model(config, impl, fp8=fp8))
        assert jax.tree.structure(other) == jax.tree.structure(stock)
        for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(stock)):
            np.testing.assert_array_equal(a, b)
    different_seed = params_of(train.build_model(config.replace(seed=1), "stock"))
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(different_seed),
                                                        jax.tree.leaves(stock)))


@pytest.mark.parametrize("tie_head", [True, False])
def test_stock_and_epilog_give_the_same_logits_in_float32(tie_head):
    config = model.ModelConfig(d_model=48, n_layers=1, n_heads=3, seq_len=33,
                               tie_head=tie_head)
    logits_and_grads = nnx.jit(lambda m, tokens: (m(tokens), nnx.grad(
        lambda m: jnp.mean(m(tokens) ** 2))(m)))
    stock = model.GPT(config, impl="stock", rngs=nnx.Rngs(3))
    ours = model.GPT(config, impl="epilog", rngs=nnx.Rngs(3))
    # Trained-looking weights: random, nonzero biases and norm scales.
    rng = np.random.default_rng(0)
    weights = jax.tree.map(lambda p: jnp.asarray(
        p + 0.05 * rng.standard_normal(p.shape), p.dtype), params_of(stock))
    nnx.update(stock, weights)
    nnx.update(ours, weights)
    tokens = jnp.asarray(rng.integers(0, 256, (3, 31)))
    with jax.default_matmul_precision("highest"):
        expected, stock_grads = logits_and_grads(stock, tokens)
        got, our_grads = logits_and_grads(ours, tokens)
    stock_grads, our_grads = params_of(stock_grads), params_of(our_grads)
    assert got.shape == (3, 31, 256) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
    for a, b in zip(jax.tree.leaves(our_grads), jax.tree.leaves(stock_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("vocab", [1, 127, 256, model.ONE_HOT_MAX_VOCAB + 1])
def test_token_embedding_matches_a_gather_with_its_gradient(vocab):
    """The one-hot lookup gives nnx.Embed's rows and its gradient (a larger vocabulary than
    ONE_HOT_MAX_VOCAB gathers, as nnx.Embed does)."""
    rng = np.random.default_rng(vocab)
    tokens = jnp.asarray(rng.integers(0, vocab, (3, 129)))
    dy = jnp.asarray(rng.standard_normal((3, 129, 24)), jnp.float32)
    ours = model.TokenEmbedding(vocab, 24, rngs=nnx.Rngs(5))
    gather = nnx.Embed(vocab, 24, rngs=nnx.Rngs(5))
    with jax.default_matmul_precision("highest"):
        got, got_grad = jax.value_and_grad(
            lambda e: jnp.vdot(dy, nnx.merge(nnx.graphdef(ours), e)(tokens)))(nnx.state(ours))
    expected, expected_grad = jax.value_and_grad(
        lambda e: jnp.vdot(dy, nnx.merge(nnx.graphdef(gather), e)(tokens)))(nnx.state(gather))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(got_grad["embedding"][...], expected_grad["embedding"][...],
                               rtol=1e-5, atol=1e-5)
    # The gradient is a matmul, not a scatter-add of every token's row (a tenth of the H200's
    # `large` step when it was).
    backward = jax.make_jaxpr(jax.grad(lambda e: jnp.vdot(
        dy, nnx.merge(nnx.graphdef(ours), e)(tokens))))(nnx.state(ours))
    assert ("scatter" in str(backward)) == (vocab > model.ONE_HOT_MAX_VOCAB)
    with pytest.raises(ValueError, match="tokens"):
        model.TokenEmbedding(4, 2, rngs=nnx.Rngs(0))(jnp.ones((2,), jnp.float32))


def test_the_fp8_variants_carry_their_scaling_state():
    epilog_fp8 = train.build_model(TINY, "epilog", fp8=True)
    flax_fp8 = train.build_model(TINY, "flax_fp8")
    n_projections = 4 * TINY.model.n_layers  # qkv, out, mlp up and down
    _, _, epilog_state, rest = model.split(epilog_fp8)
    _, _, flax_state, _ = model.split(flax_fp8)
    assert len(jax.tree.leaves(epilog_state)) == 2 * n_projections  # input, gradient
    assert len(jax.tree.leaves(flax_state)) == 6 * n_projections    # 3 scales, 3 histories
    assert not jax.tree.leaves(rest)
    assert not jax.tree.leaves(model.split(train.build_model(TINY, "stock"))[2])
    # Llama: qkv and out, then the SwiGLU block's two GEMMs (gate/up as one, and down)
    llama = train.build_model(LLAMA_TINY, "epilog", fp8=True)
    assert isinstance(llama.blocks[0].mlp, jax_epilog.nnx.SwiGLU)
    assert len(jax.tree.leaves(model.split(llama)[2])) == 2 * 4 * LLAMA_TINY.model.n_layers


@pytest.mark.parametrize("config", [TINY, LLAMA_TINY], ids=["tiny", "llama_tiny"])
def test_the_fp8_step_has_no_host_round_trip(corpus, monkeypatch, config):
    """Every projection in FP8 (forced: `tiny` is too small for `fp8=True` to choose it; for
    Llama, the SwiGLU block's), the compiled training step has no conditional and no loop: on
    a GPU XLA copies their predicates to the host and waits, which stalled the H200 once per
    FP8 stack per step (examples/gpt/results/h200/gpt_profile.md)."""
    monkeypatch.setattr(train, "FP8_RECIPE", jax_epilog.Fp8(layers="all"))
    trainer = train.Trainer(train.build_model(config, "epilog", fp8=True),
                            train.make_optimizer(config))
    batches = data.Batches(corpus.train, config.batch_size, config.model.seq_len, config.seed)
    hlo = trainer.step.lower(trainer.initial, *next(batches)).compile().as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" in hlo
    assert " conditional(" not in hlo and " while(" not in hlo


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_block_recipe_trains_in_fp8_with_no_scaling_state(corpus, monkeypatch, arch):
    """`--fp8-scaling block`: no scaling state in the model; with every projection (and the
    Llama arch's SwiGLU block) block-scaled (forced: the tiny configs are too small for
    "auto", widened so every width is a multiple of 128), the step is e4m3 throughout (no
    e5m2 gradient) and the loss falls."""
    tiny = TINY if arch == "gpt" else configs.get("llama_tiny").replace(n_layers=1,
                                                                        mlp_hidden=256)
    assert not jax.tree.leaves(model.split(
        train.build_model(tiny, "epilog", fp8=True, fp8_scaling="block"))[2])
    monkeypatch.setattr(train, "FP8_BLOCK_RECIPE", jax_epilog.Fp8(scaling="block", layers="all"))
    config = tiny.replace(d_model=128, steps=6, warmup_steps=2, eval_every=6, log_every=1)
    trainer = train.Trainer(train.build_model(config, "epilog", fp8=True, fp8_scaling="block"),
                            train.make_optimizer(config))
    batches = data.Batches(corpus.train, config.batch_size, config.model.seq_len, config.seed)
    hlo = trainer.step.lower(trainer.initial, *next(batches)).compile().as_text()
    assert "f8e4m3fn" in hlo and "f8e5m2" not in hlo
    summary = train.train(config, "epilog", fp8=True, fp8_scaling="block", corpus=corpus,
                          progress=False)
    assert "scaling='block'" in summary["fp8_recipe"]
    losses = [loss for _, loss in summary["train_loss"]]
    assert losses[-1] < losses[0], losses
    with pytest.raises(ValueError, match="fp8_scaling: expected one of"):
        train.fp8_recipe("blocks")


def test_compare_judges_only_the_variants_it_ran():
    """The block variant runs only when `--variants` names it; a target about a variant that
    was not asked for is left out, not judged missed."""
    compare = compare_module()
    assert "epilog_fp8_block" not in compare.DEFAULT_VARIANTS
    report = json.loads((RESULTS / "h200" / "gpt_compare.json").read_text())
    assert not [row for row in compare.targets(report["results"])
                if "epilog_fp8_block" in row["target"]]
    large = report["results"]["large"]
    large["variants"]["epilog_fp8_block"] = dict(large["variants"]["epilog_fp8"])
    rows = [row for row in compare.targets(report["results"])
            if "epilog_fp8_block" in row["target"]]
    assert [row["target"] for row in rows] == [
        "large: epilog_fp8_block >= 1.3x stock tokens/s",
        "large: epilog_fp8_block validation loss within 1% of epilog's"]
    with pytest.raises(SystemExit):
        compare.main(["--variants", "epilog_fp8_blocks", "--out", "/tmp/unused"])


# --- the Llama arch -----------------------------------------------------------------------------

def perturbed(params, seed=0):
    """`params` moved off their initialisation (norm scales not 1), as trained ones are."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(p + 0.05 * rng.standard_normal(p.shape), p.dtype),
                        params)


def test_llama_arch_has_its_layers_and_no_bias():
    config = LLAMA_TINY.model
    m = model.GPT(config, rngs=nnx.Rngs(0))
    assert m.position_embedding is None and m.head is not None
    assert isinstance(m.final_norm, nnx.RMSNorm)
    block = m.blocks[0]
    assert isinstance(block.attention_norm, nnx.RMSNorm) and isinstance(block.mlp, model.SwiGLU)
    shapes = {jax.tree_util.keystr(path).removesuffix(".value"): leaf.shape
              for path, leaf in jax.tree_util.tree_leaves_with_path(params_of(m))}
    assert not any("bias" in path for path in shapes), shapes
    head_dim, width = config.head_dim, config.d_model
    assert shapes["['blocks'][0]['attention']['qkv']['kernel']"] == \
        (width, (4 + 2 * 2) * head_dim)  # 4 query heads, 2 key and 2 value heads
    assert shapes["['blocks'][0]['mlp']['gate']['kernel']"] == (width, 172)
    assert shapes["['blocks'][0]['mlp']['down']['kernel']"] == (172, width)
    assert shapes["['head']['kernel']"] == (width, 256)
    logits = m(jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 37))))
    assert logits.shape == (3, 37, 256) and bool(jnp.all(jnp.isfinite(logits)))


def test_llama_config_rejects_what_it_cannot_build():
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(LLAMA_TINY.model, n_kv_heads=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(TINY.model, n_kv_heads=2)  # GPT-2 has no grouped-query attention
    with pytest.raises(ValueError, match="tie_head"):
        dataclasses.replace(LLAMA_TINY.model, tie_head=True)
    with pytest.raises(ValueError, match="arch"):
        dataclasses.replace(LLAMA_TINY.model, arch="mamba")
    with pytest.raises(ValueError, match="mlp_hidden"):
        dataclasses.replace(LLAMA_TINY.model, mlp_hidden=0)
    with pytest.raises(ValueError, match="n_heads"):  # an odd head_dim cannot rotate in pairs
        model.ModelConfig(d_model=60, n_layers=1, n_heads=4, seq_len=8, arch="llama",
                          tie_head=False)


@pytest.mark.parametrize("shift", [1, 29])
def test_rope_scores_depend_on_the_relative_position_only(shift):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 7, 3, 18)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 7, 3, 18)), jnp.float32)
    positions = jnp.asarray([0, 1, 2, 5, 11, 40, 127])
    scores = lambda p: jnp.einsum("bqhd,bkhd->bhqk", model.rope(q, p), model.rope(k, p))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(scores(positions + shift), scores(positions), rtol=1e-4,
                                   atol=1e-4)
        # a rotation: norms kept, position 0 untouched, other positions moved
        np.testing.assert_allclose(jnp.linalg.norm(model.rope(q, positions), axis=-1),
                                   jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    np.testing.assert_array_equal(model.rope(q, positions)[:, 0], q[:, 0])
    assert not np.allclose(model.rope(q, positions)[:, 1:], q[:, 1:], atol=1e-3)


def test_grouped_query_attention_equals_multi_head_with_the_key_value_heads_repeated():
    """Each key/value head serves `n_heads / n_kv_heads` query heads in turn: the same as
    multi-head attention whose key and value heads are those repeated."""
    gqa_config = dataclasses.replace(LLAMA_TINY.model, d_model=48, n_heads=6, n_kv_heads=2,
                                     seq_len=33)
    mha_config = dataclasses.replace(gqa_config, n_kv_heads=None)
    layers = model.Layers("stock", jnp.float32)
    gqa = model.CausalSelfAttention(gqa_config, layers, "xla", rngs=nnx.Rngs(0))
    mha = model.CausalSelfAttention(mha_config, layers, "xla", rngs=nnx.Rngs(1))
    nnx.update(gqa, perturbed(params_of(gqa)))
    heads, head_dim, width = 6, 8, 48
    kernel = gqa.qkv.kernel[...]
    q, k, v = jnp.split(kernel, [heads * head_dim, (heads + 2) * head_dim], axis=1)
    repeat = lambda w: jnp.repeat(w.reshape(width, 2, head_dim), 3, axis=1).reshape(width, -1)
    mha.qkv.kernel[...] = jnp.concatenate([q, repeat(k), repeat(v)], axis=1)
    mha.out.kernel[...] = gqa.out.kernel[...]
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 31, width)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(gqa(x), mha(x), rtol=1e-5, atol=1e-5)
        # and the grouping matters: the heads paired the other way round differ
        mha.qkv.kernel[...] = jnp.concatenate([q, jnp.tile(k, (1, 3)), jnp.tile(v, (1, 3))], 1)
        assert not np.allclose(gqa(x), mha(x), atol=1e-3)


def test_swiglu_is_down_of_silu_gate_times_up():
    config = LLAMA_TINY.model
    mlp = model.Layers("stock", jnp.float32).mlp(config.d_model, 129, rngs=nnx.Rngs(0),
                                                  arch="llama")
    nnx.update(mlp, perturbed(params_of(mlp)))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, config.d_model)), jnp.float32)
    w = lambda layer: layer.kernel[...]
    with jax.default_matmul_precision("highest"):
        expected = (jax.nn.silu(x @ w(mlp.gate)) * (x @ w(mlp.up))) @ w(mlp.down)
        np.testing.assert_allclose(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_llama_every_impl_starts_from_the_same_weights_and_epilog_matches_stock():
    config = LLAMA_TINY
    stock = train.build_model(config, "stock")
    weights = perturbed(params_of(stock))
    nnx.update(stock, weights)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 29)))
    logits_and_grads = nnx.jit(lambda m, tokens: (m(tokens), nnx.grad(
        lambda m: jnp.mean(m(tokens) ** 2))(m)))
    with jax.default_matmul_precision("highest"):
        expected, stock_grads = logits_and_grads(stock, tokens)
    for impl, fp8 in [("epilog", False), ("epilog", True), ("flax_fp8", False)]:
        other = train.build_model(config, impl, fp8=fp8)
        initial = params_of(train.build_model(config, "stock"))
        assert jax.tree.structure(params_of(other)) == jax.tree.structure(initial)
        for a, b in zip(jax.tree.leaves(params_of(other)), jax.tree.leaves(initial)):
            np.testing.assert_array_equal(a, b)
        if impl == "epilog" and not fp8:
            nnx.update(other, weights)
            with jax.default_matmul_precision("highest"):
                got, grads = logits_and_grads(other, tokens)
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
            for a, b in zip(jax.tree.leaves(params_of(grads)),
                            jax.tree.leaves(params_of(stock_grads))):
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def test_llama_tiny_trains_with_a_falling_loss(corpus):
    config = configs.get("llama_tiny").replace(steps=24, warmup_steps=4, eval_every=12,
                                               log_every=4)
    summary = train.train(config, "epilog", corpus=corpus, progress=False)
    losses = [loss for _, loss in summary["train_loss"]]
    assert losses[-1] < losses[0] - 1.0, losses
    (_, first), (_, last) = summary["validation_loss"]
    assert last < first < np.log(256)


# --- training ----------------------------------------------------------------------------------

def test_tiny_config_trains_with_a_falling_loss(corpus):
    config = TINY.replace(steps=24, warmup_steps=4, eval_every=12, log_every=4)
    summary = train.train(config, "epilog", corpus=corpus, progress=False)
    losses = [loss for _, loss in summary["train_loss"]]
    assert losses[-1] < losses[0] - 1.0, losses
    (_, first), (_, last) = summary["validation_loss"]
    assert last < first < np.log(256)
    assert summary["steps"] == [0, 24] and summary["tokens_per_s"] > 0
    assert summary["memory"] is None or summary["memory"]["temp_size_in_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("base, impl, fp8, scaling", [
    (TINY, "epilog", True, "per-tensor"), (LLAMA_TINY, "epilog", True, "per-tensor"),
    (TINY.replace(d_model=128), "epilog", True, "block")])
def test_resume_from_a_checkpoint_takes_the_same_steps_bit_for_bit(corpus, tmp_path, base,
                                                                     impl, fp8, scaling,
                                                                     monkeypatch):
    pytest.importorskip("orbax.checkpoint")
    # every projection block-scaled (tiny's are too small for "auto"); no state to checkpoint
    monkeypatch.setattr(train, "FP8_BLOCK_RECIPE", jax_epilog.Fp8(scaling="block", layers="all"))
    config = base.replace(steps=5, warmup_steps=2, eval_every=5, log_every=1)
    run = dict(fp8=fp8, fp8_scaling=scaling, corpus=corpus, progress=False)
    straight = train.train(config, impl, **run)
    stopped = train.train(config, impl, **run, checkpoint_dir=tmp_path, stop_after=3)
    resumed = train.train(config, impl, **run, checkpoint_dir=tmp_path)
    assert stopped["steps"] == [0, 3] and resumed["resumed_from"] == 3
    assert resumed["steps"] == [3, 5]
    assert resumed["train_loss"] == straight["train_loss"][3:]
    assert resumed["validation_loss"] == straight["validation_loss"]
    leaves = jax.tree.leaves(straight["state"])
    assert (len(jax.tree.leaves(straight["state"].fp8)) > 0) == (scaling == "per-tensor")
    assert jax.tree.structure(resumed["state"]) == jax.tree.structure(straight["state"])
    for a, b in zip(jax.tree.leaves(resumed["state"]), leaves):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        train.train(config.replace(learning_rate=1e-3), impl, **run, checkpoint_dir=tmp_path)


@pytest.mark.slow
def test_train_script_writes_its_summary(tmp_path):
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, str(EXAMPLES / "gpt" / "train.py"), "--config", "tiny",
                    "--layers", "1", "--steps", "3", "--warmup-steps", "1", "--eval-every", "3",
                    "--no-progress", "--out", str(out)], check=True, timeout=300)
    summary = json.loads(out.read_text())
    assert summary["steps"] == [0, 3] and summary["impl"] == "stock"
    assert summary["versions"]["jax"] == jax.__version__
    assert len(summary["validation_loss"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "llama_tiny"])
def test_compare_runs_the_four_variants_side_by_side(tmp_path, name):
    subprocess.run([sys.executable, str(EXAMPLES / "gpt" / "compare.py"), "--config", name,
                    "--layers", "1", "--steps", "4", "--eval-every", "2", "--budget-s", "20",
                    "--out", str(tmp_path)], check=True, timeout=300)
    report = json.loads((tmp_path / "gpt_compare.json").read_text())
    variants = report["results"][name]["variants"]
    assert list(variants) == ["stock", "flax_fp8", "epilog", "epilog_fp8"]
    # The learning-rate schedule spans the measured run (it ends decayed).
    assert report["results"][name]["config"]["steps"] == 4
    assert len({v["initial_params_sha256"] for v in variants.values()}) == 1
    for v in variants.values():
        assert len(v["train_loss"]) == report["results"][name]["steps"]
        assert v["careful_harness"]["step_s"] > 0 and v["user_harness"]["step_s"] > 0
        assert v["first_step_s"] > 0
        assert v["time_to_first_step_s"] == v["build_and_compile_s"] + v["first_step_s"]
        assert [step for step, _ in v["validation_loss"]][-1] == \
            report["results"][name]["steps"]
    # bf16 and FP8 start from the same weights on the same batches: the first losses agree
    # to FP8's rounding, the stock and jax-epilog ones closely.
    first = {name: v["train_loss"][0] for name, v in variants.items()}
    assert abs(first["epilog"] - first["stock"]) < 1e-4
    assert abs(first["epilog_fp8"] - first["stock"]) < 0.05
    text = (tmp_path / "gpt_compare.md").read_text()
    assert "| epilog_fp8 |" in text
    # tiny's layers are too small for Fp8()'s rule: no FP8 GEMM runs in epilog_fp8, and its
    # targets say so instead of "yes"
    assert variants["epilog_fp8"]["fp8_in_program"] is False
    assert variants["flax_fp8"]["fp8_in_program"] is True  # Flax's FP8 quantizes every layer
    # and on a CPU no GEMM reads FP8 operands, Flax's FP8 quantizing or not: no FP8 target
    # is met there, each says it does not apply
    assert {v["fp8_gemms"] for v in variants.values()} == {0}
    assert "no FP8 GEMM ran in flax_fp8 (" in text and " nor in epilog_fp8 (" in text
    assert "FP8 emulated" not in text
    for fp8_name in ("epilog_fp8", "flax_fp8"):
        rows = [line for line in text.splitlines() if line.startswith(f"| {name}: {fp8_name}")]
        assert rows and all(line.endswith(f"| not applicable (no FP8 GEMM ran in {fp8_name}) |")
                            for line in rows)


RESULTS = EXAMPLES / "gpt" / "results"


def compare_module():
    from gpt import compare
    return compare


def test_fp8_gemms_counts_the_gemms_that_read_fp8_operands():
    compare = compare_module()
    cpu = """
%fused_computation (param_0: f32[8,16], param_1: f32[16,8]) -> f32[8,8] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,8]{1,0} parameter(1)
  ROOT %dot.0 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}
%fused_computation.1 (param_0.2: f32[8,16]) -> f32[8,16] {
  %param_0.2 = f32[8,16]{1,0} parameter(0)
  %convert.1 = f8e4m3fn[8,16]{1,0} convert(%param_0.2)
  ROOT %convert.0 = f32[8,16]{1,0} convert(%convert.1)
}"""
    assert compare.fp8_gemms(cpu) == 0  # FP8 rounding, then a float32 dot
    gpu = """
%triton_gemm (param_0.7: f8e4m3fn[64,64], param_1.7: f8e4m3fn[64,64]) -> bf16[64,64] {
  %param_0.7 = f8e4m3fn[64,64]{1,0} parameter(0)
  %param_1.7 = f8e4m3fn[64,64]{1,0} parameter(1)
  ROOT %dot.9 = bf16[64,64]{1,0} dot(%param_0.7, %param_1.7), lhs_contracting_dims={1}
}
ENTRY %main (x: f8e4m3fn[64,64], w: f8e5m2[64,64], s: f32[]) -> bf16[64,64] {
  %x = f8e4m3fn[64,64]{1,0} parameter(0)
  %w = f8e5m2[64,64]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %cublas = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(%x, %w, %s, %s), custom_call_target="__cublas$lt$matmul$f8"
  %ours = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[64,64]{1,0} %x, f8e5m2[64,64]{1,0} %w), custom_call_target="jax_epilog_matmul"
  %ours_bf16 = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(%b, %b), custom_call_target="jax_epilog_matmul"
  %not_a_gemm = f8e4m3fn[64,64]{1,0} custom-call(%x), custom_call_target="Sharding"
  %fusion = bf16[64,64]{1,0} fusion(%x, %x), kind=kCustom, calls=%triton_gemm, backend_config={"kind":"__triton_gemm"}
  ROOT %b = bf16[64,64]{1,0} add(%cublas, %fusion)
}"""
    # XLA's FP8 GEMM, ours (operand types inline) and the dot inside a Triton GEMM fusion, once
    assert compare.fp8_gemms(gpu) == 3


def test_on_a_cpu_flax_fp8_rounds_to_fp8_but_runs_no_fp8_gemm(corpus):
    if jax.default_backend() == "gpu":
        pytest.skip("a CPU fact")
    compare = compare_module()
    batch = data.Batches(corpus.train, TINY.batch_size, TINY.model.seq_len, TINY.seed).batch(0)
    variant = compare.build(TINY, "flax_fp8", "flax_fp8", None, jnp.float32, "xla", batch)
    assert variant.record["fp8_in_program"] and variant.record["fp8_gemms"] == 0


def fp8_records(report, **fp8_gemms):
    """`report`'s results with each named variant's FP8 GEMM count (and FP8 values) set."""
    for result in report["results"].values():
        for name, count in fp8_gemms.items():
            result["variants"][name].update(fp8_gemms=count,
                                            fp8_in_program=count > 0 or name == "flax_fp8")
    return report


def test_targets_about_an_fp8_variant_that_ran_no_fp8_gemm_are_not_applicable():
    compare = compare_module()
    # The committed H200 run (before FP8 GEMMs were counted): every target judged, as then.
    h200 = json.loads((RESULTS / "h200" / "gpt_compare.json").read_text())
    judged = compare.targets(h200["results"])
    assert [row["met"] for row in judged] == [row["met"] for row in h200["targets"]]
    assert None not in [row["met"] for row in judged]
    # A CPU run of tiny: Flax's FP8 rounds without FP8 GEMMs, jax-epilog's quantizes no layer.
    cpu = fp8_records(json.loads((RESULTS / "cpu_tiny" / "gpt_compare.json").read_text()),
                      flax_fp8=0, epilog_fp8=0, stock=0, epilog=0)
    cpu["targets"] = compare.targets(cpu["results"])
    assert [(row["met"], row["not_applicable"]) for row in cpu["targets"]] == [
        (None, "no FP8 GEMM ran in epilog_fp8"), (None, "no FP8 GEMM ran in flax_fp8")]
    text = compare.render(cpu)
    assert "tiny: no FP8 GEMM ran in flax_fp8 (its FP8 values are converted back" in text
    assert "nor in epilog_fp8 (no layer is FP8" in text and "FP8 emulated" not in text
    assert re.search(r"^\| tiny: flax_fp8 validation loss within 1% of stock's \| [-+]\d+\.\d\d% "
                     r"\| not applicable \(no FP8 GEMM ran in flax_fp8\) \|$", text, re.M)
    # The peer without FP8 GEMMs: the targets naming it do not apply, the others still do.
    peerless = compare.targets(fp8_records(h200, flax_fp8=0, epilog_fp8=72)["results"])
    for row in peerless:
        assert (row["met"] is None) == ("flax_fp8" in row["target"]), row


def test_the_llama_targets_judge_the_time_to_the_first_step():
    compare = compare_module()
    report = json.loads((RESULTS / "h200" / "gpt_compare.json").read_text())
    result = report["results"].pop("large")  # from before times to the first step: n/a
    assert "| n/a |" in compare.render({**report, "targets": compare.targets(report["results"])})
    result["config"]["model"].update(arch="llama", n_kv_heads=8, mlp_hidden=14336)
    for name, seconds in {"stock": 6.0, "flax_fp8": 200.0, "epilog": 2.0,
                          "epilog_fp8": 41.0}.items():
        result["variants"][name]["time_to_first_step_s"] = seconds
    report["results"] = {"llama_large": result}
    report["targets"] = compare.targets(report["results"])
    first_step = [row for row in report["targets"] if "first step" in row["target"]]
    assert [(row["fraction"], row["met"]) for row in first_step] == [(41.0 / 200.0, False)]
    text = compare.render(report)
    assert "llama: d_model 4096, 4 layers, 32 query / 8 key-value heads, SwiGLU hidden 14336" \
        in text
    assert re.search(r"^\| llama_large: epilog_fp8's time to the first step <= 0.2x flax_fp8's "
                     r"\| 0.205x \| no \|$", text, re.M)
    assert [row["target"] for row in report["targets"] if "tokens/s" in row["target"]] == [
        "llama_large: epilog_fp8 >= 1.5x stock tokens/s",
        "llama_large: epilog_fp8 >= 1.08x flax_fp8 tokens/s"]


def test_a_short_run_clamps_its_warm_up_and_says_why_it_has_no_speed():
    done = subprocess.run([sys.executable, str(EXAMPLES / "gpt" / "train.py"), "--config",
                           "tiny", "--layers", "1", "--steps", "5", "--no-progress"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm-up shortened to 0 steps: the config's 10 are more than --steps 5" in done.stdout
    assert "tokens/s not measured" in done.stdout and "nan" not in done.stdout


@pytest.mark.slow
def test_profile_names_what_each_fusion_computes(tmp_path):
    """profile.py's plumbing on the CPU (no GPU kernels to trace there: the report says so),
    and its reading of optimized HLO: a fusion is described by the operations inside it."""
    from gpt import profile
    subprocess.run([sys.executable, str(EXAMPLES / "gpt" / "profile.py"), "--config", "tiny",
                    "--variants", "epilog_fp8", "--steps", "1", "--out", str(tmp_path)],
                   check=True, timeout=300)
    report = json.loads((tmp_path / "gpt_profile.json").read_text())
    profiled = report["variants"]["epilog_fp8"]
    if jax.default_backend() == "cpu":
        assert profiled["note"].startswith("no GPU kernels")
    else:
        assert profiled["gemm_ms"] > 0 and profiled["top"], profiled
    hlo = jax.jit(lambda x: jnp.maximum(x * 2, 0).T.astype(jnp.float8_e4m3fn)).lower(
        jnp.ones((64, 32))).compile().as_text()
    lines, bodies = profile.hlo_index(hlo)
    described = [profile.describe_op(name, lines, bodies) for name in lines]
    fused = [d for d in described if d.startswith("f8e4m3fn[32,64]") and "convert" in d]
    assert fused and "transpose" in fused[0] and "maximum" in fused[0], described
    assert profile.describe_op("no-such-op", lines, bodies) == ""
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(EXAMPLES / "gpt" / "profile.py"), "--variants",
                        "nope", "--out", str(tmp_path)], check=True, timeout=120,
                       capture_output=True)
