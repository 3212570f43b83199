"""Prints the CUDA lowering (StableHLO text, locations left out) of three calls, planned as on a
CUDA GPU whose tables send every GEMM to cuBLASLt, on a host without a GPU: a bf16 epilog
`matmul`, an FP8 `dense` step under `jax.grad`, and a `dense` over weights stored in FP8.
Run it on two trees and diff the outputs to check that a refactor changed no custom call:

    PYTHONPATH=$PWD python scripts/cuda_lowerings.py > after.txt
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp

import jax_epilog
from jax_epilog.runtime import library
from jax_epilog.planning import context, table_format


@contextlib.contextmanager
def gpu_plan():
    ctx = context.default_context()._replace(
        override=lambda: None, tables_decide=lambda: True, cuda_devices=lambda: True,
        library=lambda: True,
        gemm_table=lambda *problem: table_format.Decision("cublaslt", "script"),
        stack_table=lambda key: None, fp8_table=lambda key: None,
        serving_table=lambda rows: None)
    with mock.patch.object(library, "query_support", lambda *a, **k: (True, "")), \
            mock.patch.object(library, "supports_fp8", lambda: True), context.planning(ctx):
        yield


def lowered(fn, *args) -> str:
    jax.clear_caches()
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def cases():
    bf16 = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 1024), (1024, 4096), (4096,))]
    yield "bf16 matmul relu_bias", lambda x, w, b: jax_epilog.matmul(
        x, w, epilog="relu_bias", epilog_inputs={"bias": b}), bf16
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((8192, 4096), (4096, 4096), (4096,))]

    def loss(x, w, b):
        return jax_epilog.dense(x, w, b, activation="relu", fp8=True).astype(jnp.float32).sum()
    yield "fp8 dense step under jax.grad", jax.grad(loss, argnums=(0, 1, 2)), big
    keys = jax.random.split(jax.random.key(0), 2)
    stored = jax_epilog.quantize_params(
        {"kernel": jax.random.normal(keys[0], (512, 512), jnp.bfloat16),
         "bias": jax.random.normal(keys[1], (512,), jnp.bfloat16)})
    yield "served dense (weights stored in FP8)", lambda x, p: jax_epilog.dense(
        x, p["kernel"], p["bias"], activation="relu"), [
        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), stored]


if __name__ == "__main__":
    with gpu_plan():
        for title, fn, args in cases():
            print(f"===== {title}")
            print(lowered(fn, *args))
