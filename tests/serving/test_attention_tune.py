"""`python -m jax_epilog.tune --serving`'s decode attention (jax_epilog/tools/attention_tune.py):
the user's attention timed (for real on the CPU at a tiny shape, and with injected times),
each cell's fastest FP8 read and layout merged into the user's decode-attention table, and
`attention_plan.decode_plan` (so `init_kv_cache` and `decode_attention`) following that table
near its cells before the shipped one; the command line's options and errors."""

import functools
import json

import jax.numpy as jnp
import pytest

import jax_epilog
from jax_epilog.planning import attention_plan, decisions
from jax_epilog.tools import attention_tune, serving_tune, tune

FAKE = "Fake GPU"
SHAPE = (4, 2, 16)  # a grouped-query attention, tiny
name = attention_plan.variant_name


@pytest.fixture
def user(monkeypatch, tmp_path):
    """The user's decision table in tmp_path (so the attention table beside it), the CPU
    posing as `FAKE` for the rule."""
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.setattr(attention_plan, "cuda_device", lambda: FAKE)
    attention_plan.read_table.cache_clear()
    yield tmp_path / "user_attention.json"
    attention_plan.read_table.cache_clear()


def injected(times: dict):
    """A `measure` giving each cell `times` (variant: seconds), the batch scaling them."""
    def measure(shape, batch, context, *, steps, rounds, limit):
        return {"query_heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                "batch": batch, "context": context,
                "variants": {v: {"seconds": None if s is None else s * batch}
                             for v, s in times.items()}}
    return measure


def test_the_real_measurement_on_the_cpu_writes_the_fastest_read_the_rule_then_takes(user):
    variants = (name("reduce", "positions_major"),)  # one compile: the choice is tested below
    [entry] = attention_tune.tune_attention(
        SHAPE, [3], [33], device=FAKE, steps=2, rounds=1,
        measure=functools.partial(attention_tune.time_cell, variants=variants))
    assert set(entry["seconds"]) == set(variants) and min(entry["seconds"].values()) > 0
    assert (entry["read"], entry["layout"]) == attention_plan.best_fp8(entry["seconds"])
    [section] = json.loads(user.read_text())["sections"]
    assert section["device"] == FAKE and section["entries"] == [entry]
    plan = attention_plan.decode_plan(4, 2, 3, 33)
    assert plan[:2] == (entry["read"], entry["layout"]) and "your measured cell" in plan.why


def test_the_users_cells_decide_near_them_and_the_shipped_table_elsewhere(user, capsys):
    fastest = {name(read, layout): 2.0 for read in attention_plan.READS
               for layout in attention_plan.LAYOUTS} | {name("reduce", "positions_major"): 1.0}
    fastest[name("dots", "heads_major_rows")] = None  # failed: never chosen
    entries = attention_tune.tune_attention(SHAPE, [1, 16], [512], device=FAKE,
                                            measure=injected(fastest))
    assert [(e["batch"], e["read"], e["layout"]) for e in entries] == \
        [(1, "reduce", "positions_major"), (16, "reduce", "positions_major")]
    assert "batch 16, context 512: " in capsys.readouterr().out
    shipped = lambda *cell, **k: attention_plan.decode_plan(*cell, user_path=None, **k)
    ours = ("reduce", "positions_major")
    assert attention_plan.decode_plan(4, 2, 8, 1000)[:2] == ours  # batch 8 of 16, context 1000
    assert attention_plan.decode_plan(8, 4, 32, 256)[:2] == ours  # the same group size
    assert jax_epilog.init_kv_cache(16, 512, 2, 16, jnp.float8_e4m3fn,
                                    query_heads=4).layout == "positions_major"
    for cell in ((4, 2, 64, 512), (4, 2, 16, 2048), (4, 4, 16, 512), (4, 1, 16, 512)):
        assert attention_plan.decode_plan(*cell) == shipped(*cell)  # not near: the shipped
    # the cells are of head_dim 16: they decide for it (or where head_dim is not said)
    assert attention_plan.decode_plan(4, 2, 16, 512, head_dim=16)[:2] == ours
    assert attention_plan.decode_plan(4, 2, 16, 512, head_dim=128) == \
        shipped(4, 2, 16, 512, head_dim=128)
    assert jax_epilog.init_kv_cache(16, 512, 2, 128, jnp.float8_e4m3fn, query_heads=4).layout \
        == shipped(4, 2, 16, 512).layout
    # Measured again: the cell replaced, the others kept.
    slower = fastest | {name("reduce", "positions_major"): 3.0}
    attention_tune.tune_attention(SHAPE, [16], [512], device=FAKE, measure=injected(slower))
    [section] = json.loads(user.read_text())["sections"]
    cells = {e["batch"]: (e["read"], e["layout"]) for e in section["entries"]}
    assert cells[1] == ours and cells[16] != ours and len(cells) == 2
    assert attention_plan.decode_plan(4, 2, 16, 512, device="Another GPU")[:2] == \
        shipped(4, 2, 16, 512, device="Another GPU")[:2]  # another GPU's table is not ours


def test_a_cell_where_nothing_ran_is_said_and_not_written(user, capsys):
    failed = {name("dots", "heads_major"): None}
    assert attention_tune.tune_attention(SHAPE, [1], [64], device=FAKE,
                                         measure=injected(failed)) == []
    assert "nothing ran" in capsys.readouterr().out and not user.exists()


def test_a_broken_user_table_is_named(user):
    user.write_text("{not json")
    with pytest.raises(ValueError, match="user_attention.json: not a decode-attention table"):
        attention_plan.decode_plan(4, 2, 3, 33)


def test_bad_shapes_and_sizes_name_the_argument(user, monkeypatch):
    for bad in ((4, 3, 16), (4, 2), (0, 1, 16), "4/2/16"):
        with pytest.raises(ValueError, match="shape: expected"):
            attention_tune.tune_attention(bad, device=FAKE)
    with pytest.raises(ValueError, match="batches: expected positive"):
        attention_tune.tune_attention(SHAPE, [0], device=FAKE)
    monkeypatch.setattr(attention_plan, "cuda_device", lambda: None)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        attention_tune.tune_attention(SHAPE)


def test_tune_serving_times_the_attention_it_is_given(user, monkeypatch, capsys):
    monkeypatch.setattr(decisions, "device_identity", lambda: (FAKE, 1))
    monkeypatch.setattr(serving_tune, "tune_serving", lambda *a, **k: ())
    calls = []
    monkeypatch.setattr(attention_tune, "tune_attention",
                        lambda *a, **k: calls.append((a, k)))
    argv = ["--serving", "--attention", "32/8/128", "--attention-batches", "1,64",
            "--attention-contexts", "2048,8192"]
    assert tune.main(argv) == 0
    assert calls == [(((32, 8, 128), (1, 64), (2048, 8192)), {"device": FAKE, "output": None})]
    assert tune.main([*argv, "--output", str(user.parent / "mine.json")]) == 0
    assert calls[-1][1]["output"] == user.parent / "mine_attention.json"
    assert tune.main(["--serving"]) == 0  # by default Llama 3 8B's attention
    assert calls[-1][0] == (attention_tune.SHAPE, attention_tune.BATCHES,
                            attention_tune.CONTEXTS)
    assert tune.main(["--serving", "--attention", "none"]) == 0 and len(calls) == 3
    assert tune.main([*argv, "--dry-run"]) == 0 and len(calls) == 3
    assert "32 query / 8 key-value heads of 128: FP8 cache reads and layouts at batches " \
        "1, 64 and contexts 2048, 8192" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--serving", "--attention", "32/5/128"], "--attention: expected"),
    (["--serving", "--attention", "32x8"], "--attention: expected"),
    (["--serving", "--attention-batches", "1,0"], "--attention-batches: expected"),
    (["--serving", "--attention-contexts", "a"], "--attention-contexts: expected"),
    (["--serving", "--attention", "none", "--attention-batches", "4"], "need an attention"),
    (["--grid", "--attention", "32/8/128"], "go with --serving"),
])
def test_bad_attention_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        tune.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
def test_tune_attention_on_the_gpu(tmp_path, monkeypatch):
    """Every FP8 read and layout compiles and runs on the GPU at Llama 3 8B's attention, and
    the cell decides this GPU's read and layout there."""
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    attention_plan.read_table.cache_clear()
    try:
        [entry] = attention_tune.tune_attention((32, 8, 128), [16], [2048], rounds=2)
        assert set(entry["seconds"]) == set(attention_tune.FP8_VARIANTS), entry["seconds"]
        plan = attention_plan.decode_plan(32, 8, 16, 2048)
        assert plan[:2] == (entry["read"], entry["layout"]) and "your" in plan.why
    finally:
        attention_plan.read_table.cache_clear()
