"""The automatic backend choice (`jax_epilog.planning.decisions`): table lookup, nearest measured problem,
margin, the conservative rule for a GPU without a table, user table over shipped table, the
environment override, and the atomic merge-write of a table. CPU only: the GPU is faked."""

import functools
import json
import os
import threading

import jax
import jax.numpy as jnp
import pytest

from jax_epilog.planning import call_plan
from jax_epilog.planning import context
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.op.epilogs import Epilog

H200, VERSION = "NVIDIA H200", 130100


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """Shipped tables in a temporary folder, the user table beside them, GPU = H200."""
    shipped = tmp_path / "tables"
    shipped.mkdir()
    monkeypatch.setattr(decisions, "TABLES_DIR", shipped)
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    on_gpu(monkeypatch, H200)
    decisions.clear_cache()
    yield tmp_path
    decisions.clear_cache()


def on_gpu(monkeypatch, device, version=VERSION):
    monkeypatch.setattr(decisions, "device_identity", lambda: (device, version))
    decisions.clear_cache()


def entry(m, n, k, fused, xla=1.0, epilog=Epilog.DRELU_BGRAD, dtype="bfloat16", ta=False,
          tb=True):
    return table_format.make_entry(epilog, dtype, ta, tb, m, n, k, {"cublaslt": fused, "xla": xla})


def write(path, entries, device=H200, version=VERSION):
    decisions.merge_into(path, device, version, entries)


def choose(m, n, k, epilog=Epilog.DRELU_BGRAD, dtype="bfloat16", ta=False, tb=True, batch=1):
    return decisions.choose(epilog, dtype, batch, m, n, k, ta, tb)


def shipped(tables, device=H200):
    return tables / "tables" / f"{table_format.slug(device)}.json"


def test_slug_names_the_shipped_file():
    assert table_format.slug("NVIDIA H200") == "nvidia-h200"
    assert table_format.slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
    assert decisions.shipped_table_path("NVIDIA H200").name == "nvidia-h200.json"


@pytest.mark.parametrize("fused, xla, expected", [
    (0.97, 1.0, "cublaslt"),  # 3% faster: wins
    (0.99, 1.0, "xla"),  # 1% faster: within the margin, XLA keeps it
    (1.20, 1.0, "xla"),
    (None, 1.0, "xla"),  # cuBLASLt failed
    (0.5, None, "cublaslt"),  # XLA failed
])
def test_cublaslt_wins_only_by_the_margin(fused, xla, expected):
    assert table_format.decide_from_times({"cublaslt": fused, "xla": xla}) == expected


def test_nearest_measured_problem_decides(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5), entry(65536, 4096, 4096, 2.0)])
    assert choose(4096, 1024, 1024) == "cublaslt"
    assert choose(6000, 1500, 700) == "cublaslt"  # within 2x of the small one
    assert choose(60000, 4000, 4100) == "xla"  # nearest is the large one
    decision = decisions.decision(Epilog.DRELU_BGRAD, "bfloat16", 1, 6000, 1500, 700, False, True)
    assert decision.source == "shipped" and decision.entry.m == 4096


def test_batch_times_m_is_the_row_count(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    assert choose(1024, 1024, 1024, batch=4) == "cublaslt"


def test_no_entry_within_a_factor_of_two_gives_xla(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    assert choose(4096, 1024, 2049) == "xla"  # K just over 2x
    assert choose(4096, 1024, 2048) == "cublaslt"  # exactly 2x is still near
    assert decisions.decision(Epilog.DRELU_BGRAD, "bfloat16", 1, 4096, 1024, 4096, False,
                             True).source == "none"


def test_only_the_same_epilog_dtype_and_transposes_count(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    assert choose(4096, 1024, 1024, epilog=Epilog.DGELU_BGRAD) == "xla"
    assert choose(4096, 1024, 1024, dtype="float16") == "xla"
    assert choose(4096, 1024, 1024, tb=False) == "xla"
    assert choose(4096, 1024, 1024, ta=True) == "xla"


def test_user_table_decides_before_the_shipped_one(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5), entry(256, 100, 784, 0.5)])
    write(tables / "user.json", [entry(4096, 1024, 1024, fused=1.5)])
    decisions.clear_cache()
    assert choose(4096, 1024, 1024) == "xla"
    assert decisions.decision(Epilog.DRELU_BGRAD, "bfloat16", 1, 4096, 1024, 1024, False,
                             True).source == "user"
    assert choose(256, 100, 784) == "cublaslt"  # not measured by the user: shipped decides


def test_user_table_of_another_gpu_is_not_read(tables):
    write(tables / "user.json", [entry(4096, 1024, 1024, fused=0.5)], device="Other GPU")
    assert choose(4096, 1024, 1024) == "xla"


def test_section_with_this_cublaslt_version_first_else_the_newest(tables, monkeypatch):
    path = shipped(tables)
    write(path, [entry(4096, 1024, 1024, fused=2.0)], version=120000)
    write(path, [entry(4096, 1024, 1024, fused=0.5)], version=VERSION)
    write(path, [entry(4096, 1024, 1024, fused=2.0)], version=110000)
    assert choose(4096, 1024, 1024) == "cublaslt"
    on_gpu(monkeypatch, H200, version=120000)
    assert choose(4096, 1024, 1024) == "xla"
    on_gpu(monkeypatch, H200, version=999999)
    assert choose(4096, 1024, 1024) == "cublaslt"  # the newest: 130100


def test_gpu_without_table_takes_cublaslt_only_where_the_h200_won(tables, monkeypatch):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5),  # won
                            entry(65536, 4096, 4096, fused=2.0),  # lost
                            entry(16384, 1024, 1024, fused=0.5),  # won ...
                            entry(20000, 1024, 1024, fused=2.0)])  # ... and lost nearby
    on_gpu(monkeypatch, "NVIDIA B200")
    assert choose(4096, 1024, 1024) == "cublaslt"
    assert decisions.decision(Epilog.DRELU_BGRAD, "bfloat16", 1, 4096, 1024, 1024, False,
                             True).source == "reference-gpu"
    assert choose(65536, 4096, 4096) == "xla"  # lost on the H200
    assert choose(18000, 1024, 1024) == "xla"  # a nearby H200 loss vetoes the win
    assert choose(512, 64, 64) == "xla"  # nothing measured nearby
    assert choose(4096, 1024, 1024, epilog=Epilog.RELU_BIAS) == "xla"


def test_gpu_with_a_user_table_does_not_use_the_h200_rule(tables, monkeypatch):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    write(tables / "user.json", [entry(64, 64, 64, fused=0.5)], device="NVIDIA B200")
    on_gpu(monkeypatch, "NVIDIA B200")
    assert choose(64, 64, 64) == "cublaslt"
    assert choose(4096, 1024, 1024) == "xla"  # this GPU has a table, nothing nearby in it


def test_no_tables_at_all_gives_xla(tables):
    assert choose(4096, 1024, 1024) == "xla"


@pytest.mark.parametrize("value, expected", [("cublaslt", "cublaslt"), ("xla", "xla"),
                                             ("XLA", "xla"), ("auto", "cublaslt"),
                                             ("", "cublaslt")])
def test_environment_overrides_auto(tables, monkeypatch, value, expected):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    monkeypatch.setenv("JAX_EPILOG_BACKEND", value)
    assert choose(4096, 1024, 1024) == expected


def test_override_applies_to_unmeasured_problems_too(tables, monkeypatch):
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "cublaslt")
    assert choose(3, 5, 7) == "cublaslt"
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "fast")
    with pytest.raises(ValueError, match="JAX_EPILOG_BACKEND"):
        choose(3, 5, 7)


def test_empty_decisions_variable_means_no_user_table(tables, monkeypatch):
    write(tables / "user.json", [entry(4096, 1024, 1024, fused=0.5)])
    monkeypatch.setenv("JAX_EPILOG_DECISIONS", "")
    decisions.clear_cache()
    assert choose(4096, 1024, 1024) == "xla"


def test_merge_keeps_other_entries_and_replaces_the_same_problem(tables):
    path = tables / "user.json"
    write(path, [entry(1, 2, 3, fused=0.5), entry(4, 5, 6, fused=0.5)])
    write(path, [entry(4, 5, 6, fused=2.0)], device="Other GPU")
    write(path, [entry(4, 5, 6, fused=1.5), entry(7, 8, 9, fused=0.5)])
    data = json.loads(path.read_text())
    assert data["format"] == table_format.FORMAT
    by_device = {t["device"]: t for t in data["tables"]}
    mine = {(e["m"], e["n"], e["k"]): e["choice"] for e in by_device[H200]["entries"]}
    assert mine == {(1, 2, 3): "cublaslt", (4, 5, 6): "xla", (7, 8, 9): "cublaslt"}
    assert len(by_device["Other GPU"]["entries"]) == 1
    assert [p.name for p in tables.iterdir() if p.name.startswith("user.json")] == [
        "user.json"]  # no temporary or lock file left behind


def test_concurrent_merges_lose_nothing(tables):
    path = tables / "user.json"
    threads = [threading.Thread(target=write, args=(path, [entry(i + 1, 2, 3, fused=0.5)]))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    decisions.clear_cache()
    assert sorted(e.m for e in table_format.load_tables(path)[0].entries) == list(range(1, 9))


def test_a_failed_write_leaves_the_old_table_whole(tables, monkeypatch):
    path = tables / "user.json"
    write(path, [entry(1, 2, 3, fused=0.5)])
    before = path.read_text()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write(path, [entry(4, 5, 6, fused=0.5)])
    assert path.read_text() == before
    assert not [p for p in tables.iterdir() if p.name.endswith(".tmp")]


def test_merge_creates_the_folder(tmp_path):
    path = tmp_path / "a" / "b" / "decisions.json"
    tables = decisions.merge_into(path, H200, VERSION, [entry(1, 2, 3, fused=0.5)])
    assert path.exists() and tables[0].entries[0].choice == "cublaslt"


def test_unreadable_table_is_ignored_with_a_warning(tables):
    (tables / "user.json").write_text("{not json")
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    with pytest.warns(RuntimeWarning, match="ignoring the decisions table"):
        assert choose(4096, 1024, 1024) == "cublaslt"


def test_decisions_are_cached_until_cleared(tables):
    write(shipped(tables), [entry(4096, 1024, 1024, fused=0.5)])
    assert choose(4096, 1024, 1024) == "cublaslt"
    shipped(tables).write_text(shipped(tables).read_text().replace('"cublaslt"', '"xla"'))
    assert choose(4096, 1024, 1024) == "cublaslt"
    decisions.clear_cache()
    assert choose(4096, 1024, 1024) == "xla"


def test_shipped_tables_parse():
    for path in table_format.TABLES_DIR.glob("*.json"):
        tables = table_format.load_tables(path)
        assert tables, path
        for table in tables:
            assert table_format.slug(table.device) == path.stem
            for e in table.entries:
                assert e.choice in table_format.CANDIDATES
                assert e.choice == table_format.decide_from_times(e.seconds)


@pytest.mark.gpu
@pytest.mark.parametrize("fused_seconds, kernel", [(0.5, True), (2.0, False)])
def test_auto_lowering_follows_the_table_on_the_gpu(tmp_path, monkeypatch, fused_seconds,
                                                    kernel):
    import jax
    import jax.numpy as jnp

    import jax_epilog

    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    device, version = decisions.device_identity()
    write(tmp_path / "user.json", [entry(512, 128, 256, fused=fused_seconds, epilog=Epilog.RELU,
                                         tb=False)], device=device, version=version)
    decisions.clear_cache()
    x, w = jnp.ones((512, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
    text = jax.jit(lambda x, w: jax_epilog.matmul(x, w, epilog="relu")).lower(x, w) \
        .compile().as_text()
    decisions.clear_cache()
    assert ('custom_call_target="jax_epilog_matmul"' in text) == kernel


# --- stack entries: a whole dense/mlp stack, plain expression against the fused stack ----------

M3 = ((784, 100, 100, 10), ("relu", "relu", None), (True, True, True))


def stack_key(rows=256, shape=M3, mode="step", dtype="bfloat16"):
    return table_format.make_stack_key(dtype, rows, *shape, mode)


def stack_entry(fused, plain=1.0, **key):
    return table_format.make_stack_entry(stack_key(**key), {"fused": fused, "plain": plain})


def write_stacks(path, stacks, device=H200, version=VERSION):
    decisions.merge_into(path, device, version, [], stacks)


def stack_choice(**key):
    decision = decisions.stack_decision(stack_key(**key))
    return decision and decision.choice


@pytest.mark.parametrize("fused, plain, expected", [
    (0.97, 1.0, "fused"), (0.99, 1.0, "plain"), (1.5, 1.0, "plain"), (None, 1.0, "plain"),
    (0.5, None, "fused")])
def test_fused_stack_wins_only_by_the_margin(fused, plain, expected):
    assert table_format.decide_stack_from_times({"fused": fused, "plain": plain}) == expected


def test_a_fused_stack_that_ran_no_cublaslt_gemm_is_never_chosen():
    seconds = {"fused": 0.5, "plain": 1.0}
    assert table_format.decide_stack_from_times({**seconds, table_format.FUSED_CUBLASLT_GEMMS: 1}) == \
        "fused"
    assert table_format.decide_stack_from_times({**seconds, table_format.FUSED_CUBLASLT_GEMMS: 0}) == \
        "plain"
    entry = table_format.StackEntry.from_dict({**stack_key()._asdict(), "choice": "fused",
                                           "seconds": {**seconds, "fused_cublaslt_gemms": 0}})
    assert entry.choice == "plain"  # as stored by tune, re-derived when read


def test_stack_keys_are_checked():
    with pytest.raises(ValueError, match="mode"):
        stack_key(mode="train")
    with pytest.raises(ValueError, match="widths, activations, biases"):
        table_format.make_stack_key("bfloat16", 8, (4, 4), ("relu", None), (True,), "step")
    assert stack_key(dtype="bfloat16") == stack_key(dtype=jnp.bfloat16)


def test_version_1_files_without_stacks_still_load(tables):
    entry_1 = entry(4096, 1024, 1024, fused=0.5).as_dict()
    shipped(tables).write_text(json.dumps({"format": "jax_epilog.decisions/1", "tables": [
        {"device": H200, "cublaslt_version": VERSION, "entries": [entry_1]}]}))
    assert choose(4096, 1024, 1024) == "cublaslt"
    assert table_format.load_tables(shipped(tables))[0].stacks == ()
    assert stack_choice() is None  # no stack entry: the layers use the per-GEMM rule
    shipped(tables).write_text(json.dumps({"format": "jax_epilog.decisions/9", "tables": []}))
    decisions.clear_cache()
    with pytest.warns(RuntimeWarning, match="decisions/9"):
        assert choose(4096, 1024, 1024) == "xla"


def test_stack_entries_are_written_read_and_merged(tables):
    path = tables / "user.json"
    write(path, [entry(4096, 1024, 1024, fused=0.5)])
    write_stacks(path, [stack_entry(0.5), stack_entry(2.0, mode="forward")])
    write_stacks(path, [stack_entry(1.5)])  # the same stack again: replaced
    data = json.loads(path.read_text())
    assert data["format"] == table_format.FORMAT == "jax_epilog.decisions/2"
    section = data["tables"][0]
    assert len(section["entries"]) == 1
    assert sorted((s["mode"], s["choice"]) for s in section["stacks"]) == [
        ("forward", "plain"), ("step", "plain")]
    assert section["stacks"][0]["activations"] == ["relu", "relu", None]
    table = table_format.load_tables(path)[0]
    assert {s.key for s in table.stacks} == {stack_key(), stack_key(mode="forward")}


def test_stack_lookup_exact_then_nearest_within_twice_the_rows(tables):
    write_stacks(shipped(tables), [stack_entry(0.5, rows=256), stack_entry(2.0, rows=4096)])
    assert stack_choice(rows=256) == "fused"
    assert stack_choice(rows=512) == "fused"  # exactly 2x is still near
    assert stack_choice(rows=3000) == "plain"  # nearer the large one
    assert stack_choice(rows=127) is None  # just over 2x from every entry
    decision = decisions.stack_decision(stack_key(rows=300))
    assert decision.source == "shipped" and decision.entry.key.rows == 256


def test_stack_lookup_needs_the_same_stack_and_mode(tables):
    write_stacks(shipped(tables), [stack_entry(0.5)])
    widths, activations, biases = M3
    assert stack_choice(mode="forward") is None
    assert stack_choice(dtype="float16") is None
    assert stack_choice(shape=((784, 100, 100, 20), activations, biases)) is None
    assert stack_choice(shape=(widths, ("gelu", "relu", None), biases)) is None
    assert stack_choice(shape=(widths, activations, (True, False, True))) is None


def test_user_stack_entry_decides_before_the_shipped_one(tables):
    write_stacks(shipped(tables), [stack_entry(0.5), stack_entry(0.5, rows=8192)])
    write_stacks(tables / "user.json", [stack_entry(2.0)])
    decisions.clear_cache()
    assert stack_choice() == "plain" and decisions.stack_decision(stack_key()).source == "user"
    assert stack_choice(rows=8192) == "fused"


def test_override_and_measuring_leave_stacks_to_the_per_gemm_rule(tables, monkeypatch):
    write_stacks(shipped(tables), [stack_entry(0.5)])
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "xla")
    assert stack_choice() is None
    monkeypatch.delenv("JAX_EPILOG_BACKEND")
    assert stack_choice() == "fused"
    measured = table_format.Table(H200, VERSION, (entry(4096, 1024, 1024, fused=0.5),))
    ctx = context.measuring(measured)
    assert ctx.stack_table(stack_key()) is None  # each candidate is timed as itself
    got = ctx.gemm_table(Epilog.DRELU_BGRAD, "bfloat16", 1, 4096, 1024, 1024, False, True)
    assert (got.choice, got.source) == ("cublaslt", "measuring")  # what tune has just measured
    assert choose(4096, 1024, 1024) == "xla" and stack_choice() == "fused"


# --- the layers follow the stack entries (on a faked CUDA GPU: only what is traced) -------------

@pytest.fixture
def layer_gpu(tables, monkeypatch):
    from jax_epilog.planning import context
    monkeypatch.setattr(context, "on_cuda_gpu", lambda: True)
    # The layers' choices are under test, not matmul's own for a call whose step runs XLA.
    monkeypatch.setattr(call_plan, "plan_matmul_step", lambda *args: context.Choice("fused", "test"))
    return tables


def epilog_gemms(fn, *args):
    from jax_epilog.tools import measurement
    return len(list(measurement.epilog_eqns(jax.make_jaxpr(fn)(*args).jaxpr)))


def m3_paths(**kwargs):
    """(GEMMs of the inference forward, GEMMs of the training step) as the layer is traced:
    0 where it took the plain expression."""
    import jax_epilog
    widths = M3[0]
    params = [(jnp.ones((k, n), jnp.bfloat16), jnp.ones((n,), jnp.bfloat16))
              for k, n in zip(widths, widths[1:])]
    x = jnp.ones((2, 128, widths[0]), jnp.bfloat16)  # leading dims: 256 rows

    def forward(x, params):
        return jax_epilog.mlp(x, params, **kwargs)

    def step(x, params):
        return jax.grad(lambda p: forward(x, p).astype(jnp.float32).sum())(params)
    return epilog_gemms(forward, x, params), epilog_gemms(step, x, params)


@pytest.mark.parametrize("step, forward, expected", [
    ("plain", "plain", (0, 0)),
    ("fused", "fused", (3, 9)),
    ("plain", "fused", (3, 0)),  # inference fused, the training step the plain expression's
    ("fused", "plain", (0, 9)),
])
def test_layers_take_each_mode_as_its_stack_entry_chose(layer_gpu, step, forward, expected):
    seconds = {"fused": 0.5, "plain": 1.0}, {"fused": 2.0, "plain": 1.0}
    write_stacks(shipped(layer_gpu), [
        table_format.make_stack_entry(stack_key(mode="step"), seconds[step == "plain"]),
        table_format.make_stack_entry(stack_key(mode="forward"), seconds[forward == "plain"])])
    assert m3_paths() == expected


def test_without_a_stack_entry_the_per_gemm_rule_decides(layer_gpu):
    # No tables: every GEMM chooses XLA, so the step is the plain expression; the inference
    # forward follows the training step.
    assert m3_paths() == (0, 0)
    write(shipped(layer_gpu), [entry(256, 100, 784, fused=0.5, epilog=Epilog.RELU_AUX_BIAS,
                                     tb=False)])
    decisions.clear_cache()
    assert m3_paths() == (3, 9)


def test_forced_backends_and_the_override_ignore_stack_entries(layer_gpu, monkeypatch):
    write_stacks(shipped(layer_gpu), [stack_entry(2.0), stack_entry(2.0, mode="forward")])
    assert m3_paths() == (0, 0)
    assert m3_paths(forward="fused") == (3, 9)
    assert m3_paths(backward="fused") == (3, 9)
    monkeypatch.setenv("JAX_EPILOG_BACKEND", "cublaslt")
    assert m3_paths() == (3, 9)


def test_mixed_path_gives_the_plain_expressions_gradients(layer_gpu):
    import jax_epilog
    write_stacks(shipped(layer_gpu), [
        table_format.make_stack_entry(stack_key(rows=8, shape=((6, 5), ("relu",), (True,))),
                                  {"fused": 2.0, "plain": 1.0}),
        table_format.make_stack_entry(stack_key(rows=8, shape=((6, 5), ("relu",), (True,)),
                                            mode="forward"), {"fused": 0.5, "plain": 1.0})])
    keys = jax.random.split(jax.random.key(0), 3)
    x, w, b = (jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
               for k, s in zip(keys, ((8, 6), (6, 5), (5,))))

    def loss(layer, x, w, b):
        return layer(x, w, b).astype(jnp.float32).sum()

    ours = jax.grad(functools.partial(loss, lambda x, w, b: jax_epilog.dense(
        x, w, b, activation="relu")), argnums=(0, 1, 2))(x, w, b)
    plain = jax.grad(functools.partial(loss, lambda x, w, b: jax.nn.relu(x @ w + b)),
                     argnums=(0, 1, 2))(x, w, b)
    for a, e in zip(ours, plain):
        assert jnp.array_equal(a, e)
    assert epilog_gemms(lambda x: jax_epilog.dense(x, w, b, activation="relu"), x) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("step, forward", [("plain", "fused"), ("fused", "plain")])
def test_layers_follow_the_stack_entries_on_the_gpu(tmp_path, monkeypatch, step, forward):
    import jax_epilog

    monkeypatch.setenv("JAX_EPILOG_DECISIONS", str(tmp_path / "user.json"))
    monkeypatch.delenv("JAX_EPILOG_BACKEND", raising=False)
    device, version = decisions.device_identity()
    shape = ((256, 128), ("relu",), (True,))
    times = {"fused": {"fused": 0.5, "plain": 1.0}, "plain": {"fused": 2.0, "plain": 1.0}}
    # every GEMM wins on cuBLASLt, so the fused stack issues custom calls
    gemms = [table_format.make_entry(e, "bfloat16", ta, tb, m, n, k, {"cublaslt": 0.5, "xla": 1.0})
             for e, ta, tb, m, n, k in (("RELU_BIAS", False, False, 512, 128, 256),
                                        ("RELU_AUX_BIAS", False, False, 512, 128, 256),
                                        ("BGRADB", True, False, 256, 128, 512),
                                        ("DEFAULT", False, True, 512, 256, 128))]
    decisions.merge_into(tmp_path / "user.json", device, version, gemms, [
        table_format.make_stack_entry(stack_key(512, shape, "step"), times[step]),
        table_format.make_stack_entry(stack_key(512, shape, "forward"), times[forward])])
    decisions.clear_cache()
    x, w, b = (jnp.ones(s, jnp.bfloat16) for s in ((512, 256), (256, 128), (128,)))

    def layer(x, w, b):
        return jax_epilog.dense(x, w, b, activation="relu")

    def train(x, w, b):
        return jax.grad(lambda *a: layer(*a).astype(jnp.float32).sum(), (0, 1, 2))(x, w, b)

    def kernel_calls(fn):
        return jax.jit(fn).lower(x, w, b).compile().as_text().count(
            'custom_call_target="jax_epilog_matmul"')
    try:
        assert (kernel_calls(layer) > 0) == (forward == "fused")
        assert (kernel_calls(train) > 0) == (step == "fused")
    finally:
        decisions.clear_cache()
