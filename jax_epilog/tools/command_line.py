"""What the command lines (`python -m jax_epilog.tune`, `python -m jax_epilog.explanation`)
share: a function named as "module:callable" and example inputs written "bf16[256,784]"."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp

DTYPE_NAMES = {"bf16": "bfloat16", "f16": "float16", "fp16": "float16", "f32": "float32",
               "fp32": "float32", "f64": "float64", "i32": "int32", "u8": "uint8"}


def parse_arg_spec(spec: str) -> jax.ShapeDtypeStruct:
    """"bf16[256,784]" (or "bfloat16[256, 784]", "f32[]") -> a `jax.ShapeDtypeStruct`."""
    match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*\[([\d,\s]*)\]\s*", spec)
    if not match:
        raise ValueError(f"--args: expected DTYPE[D0,D1,...] such as bf16[256,784], got {spec!r}")
    name, dims = match.groups()
    try:
        dtype = jnp.dtype(DTYPE_NAMES.get(name.lower(), name.lower()))
    except TypeError:
        raise ValueError(f"--args: unknown dtype {name!r} in {spec!r}") from None
    shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
    return jax.ShapeDtypeStruct(shape, dtype)


def load_callable(target: str) -> Callable:
    """"package.module:attribute" -> the callable."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--fn: expected module:callable, got {target!r}")
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"--fn: {target} is a {type(obj).__name__}, not callable")
    return obj


def gemm_size(batch: int, m: int, k: int, n: int) -> str:
    """A GEMM's sizes in the one order every output of the package uses (the README's):
    M×K×N, the letters named, a batch first where there is one."""
    return f"{f'batch {batch}, ' if batch > 1 else ''}M×K×N {m}×{k}×{n}"
