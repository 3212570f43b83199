"""Every public name and import path, so that moving the internals breaks none of them silently."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import jax_epilog

TOP_LEVEL = {"BlockScales", "EXPORT_SAFETY_CHECKS", "Epilog", "Fp8", "Fp8History", "Fp8Weight",
             "KVCache", "calibrate", "decode_attention", "init_kv_cache", "write_kv",
             "dense", "explain", "gelu_aux_columns", "matmul", "mlp", "pack_relu_mask",
             "quantize", "quantize_128x128", "quantize_1x128", "quantize_params", "quantize_rows",
             "reference_matmul", "relu_mask_bytes", "swiglu", "unpack_relu_mask",
             "ServeRule", "serve_fp8"}
MODULES = {"config", "explanation", "linen", "nnx", "tune"}
PATHS = {
    "jax_epilog.config": ["autotune_enabled", "set_autotune", "set_plan_cache_capacity",
                          "autotune", "autotune_cache_path", "workspace_bytes", "SETTINGS"],
    "jax_epilog.tune": ["tune", "problems_of", "stacks_of", "main"],
    "jax_epilog.explanation": ["explain", "explanation", "Explanation", "main"],
    "jax_epilog.nnx": ["Dense", "MLP", "SwiGLU", "AmaxHistory", "update_amax_histories"],
    "jax_epilog.linen": ["Dense", "MLP", "SwiGLU", "FP8_COLLECTION"],
}


def test_top_level_names():
    assert set(jax_epilog.__all__) == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(jax_epilog, name) is not None, name
    assert isinstance(jax_epilog.__version__, str)


def test_dir_shows_only_the_public_names():
    assert set(dir(jax_epilog)) == TOP_LEVEL | MODULES | {"__version__"}


@pytest.mark.parametrize("module", sorted(PATHS))
def test_public_modules(module):
    if module in ("jax_epilog.nnx", "jax_epilog.linen"):
        pytest.importorskip("flax")
    imported = importlib.import_module(module)
    assert getattr(jax_epilog, module.split(".")[1]) is imported
    for name in PATHS[module]:
        assert getattr(imported, name) is not None, f"{module}.{name}"


@pytest.mark.parametrize("module", ["jax_epilog", "jax_epilog.tune", "jax_epilog.explanation"])
def test_command_lines_answer_help(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'plan'"):
        jax_epilog.plan  # noqa: B018  (an internal module of an earlier layout)
