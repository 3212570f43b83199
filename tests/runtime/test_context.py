"""The per-trace state is one `runtime.context.Context`: its switches and the planning context
set for a block compose, none writes the environment, and each is this thread's."""

import os
import threading

from jax_epilog import config
from jax_epilog.float8 import scaling
from jax_epilog.planning import context, serving_plan
from jax_epilog.runtime import context as runtime_context


def test_a_bare_context_is_this_processs():
    ctx = context.current()
    assert runtime_context.current() == runtime_context.Context()
    for name in context.PLANNING_FIELDS[:-1]:
        assert callable(getattr(ctx, name)), name
    assert context.filled(ctx) is ctx  # nothing left to fill


def test_planning_sets_the_planning_fields_and_keeps_the_switches():
    mine = context.default_context()._replace(serving_table=lambda rows: None,
                                              observe=lambda plan, kind: None)
    with scaling.uncalibrated(), config.forced_serving_way("xla_fp8"):
        with context.planning(mine):
            now = context.current()
            assert now.serving_table is mine.serving_table and now.observe is mine.observe
            assert not scaling.calibrates() and now.serving_way == "xla_fp8"
        assert not scaling.calibrates() and context.current().observe is None
    assert scaling.calibrates() and runtime_context.current() == runtime_context.Context()


def test_forced_serving_way_writes_no_environment_and_is_this_threads(monkeypatch):
    monkeypatch.delenv("JAX_EPILOG_SERVING", raising=False)
    seen = {}

    def other_thread():
        seen["way"] = serving_plan.serving_way(4096).choice

    with config.forced_serving_way("weight_only"):
        assert "JAX_EPILOG_SERVING" not in os.environ
        assert serving_plan.serving_way(4096).choice == "weight_only"
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["way"] == serving_plan.serving_way(4096).choice != "weight_only"
