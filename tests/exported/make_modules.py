"""Exports the modules `tests/op/test_exported.py` runs: what a user of a given version of
jax-epilog shipped with `jax.export`, kept so that every later version is checked against it.

    python tests/exported/make_modules.py --platform cuda --out tests/exported/<commit>/cuda
    python tests/exported/make_modules.py --platform cpu --out tests/exported/<commit>/cpu

Run it with the jax_epilog to export on the path (any version since the public API of 97e9b38:
`matmul`, `mlp`, `dense`, `Fp8`, `EXPORT_SAFETY_CHECKS`). For CUDA, run it on a GPU machine with
the library built: there every case reaches the cuBLASLt custom call (`backend="cublaslt"`,
fused layers, FP8 on every layer), where a host without the library would export XLA's way for
FP8. Each case is written as `<name>.bin` (the serialized module) and `<name>.npz` (its inputs
`in0`, `in1`, ... and the outputs `out0`, ..., a 16- or 8-bit float stored as its bits
with its dtype's name beside it (`in0_dtype`), the plain-JAX reference computes on the CPU from
the same function), listed in `manifest.json` with the version, commit and jax that made them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog
from jax_epilog import Epilog

M, K, N = 129, 96, 127  # M and N odd; K and N padded on CUDA (N unaligned)


def _rng(name: str):
    return np.random.default_rng(zlib.crc32(name.encode()))


def _normal(rng, shape, scale=1.0, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _matmul_case(epilog: Epilog):
    """A call of one fused-epilog family, its mask unpacked to N columns (bits past N are
    unspecified)."""
    def make(rng):
        a, b = _normal(rng, (M, K)), _normal(rng, (K, N), 0.1)
        if epilog == Epilog.BGRADB:  # the weight-gradient form: a read transposed
            a = _normal(rng, (K, M))
        inputs = []
        if epilog.has_bias:
            inputs = [_normal(rng, (N,))]
        elif epilog == Epilog.DRELU_BGRAD:
            inputs = [jax_epilog.pack_relu_mask(jnp.asarray(rng.standard_normal((M, N)) > 0))]
        elif epilog == Epilog.DGELU_BGRAD:  # the pre-activation, N padded to 8 columns
            inputs = [_normal(rng, (M, jax_epilog.gelu_aux_columns(N)))]
        return (a, b, *inputs)

    def fn(a, b, *inputs):
        names = {Epilog.DRELU_BGRAD: "relu_aux", Epilog.DGELU_BGRAD: "gelu_aux"}
        given = {names.get(epilog, "bias"): inputs[0]} if inputs else None
        out = jax_epilog.matmul(a, b, epilog=epilog, epilog_inputs=given, backend="cublaslt",
                                transpose_a=epilog == Epilog.BGRADB)
        if not isinstance(out, tuple):
            return (out,)
        y, aux = out
        extra = [jax_epilog.unpack_relu_mask(v, N).astype(jnp.float32) if k == "relu_aux"
                 else v for k, v in sorted(aux.items())]
        return (y, *extra)

    return fn, make


def _with_c():
    def make(rng):
        return _normal(rng, (M, K)), _normal(rng, (K, N), 0.1), _normal(rng, (M, N))

    def fn(a, b, c):
        return (jax_epilog.matmul(a, b, c, beta=0.5, epilog="relu", backend="cublaslt"),)

    return fn, make


def _mlp_gradient():
    def make(rng):
        return (_normal(rng, (M, K)), _normal(rng, (K, 64), 0.1), _normal(rng, (64,)),
                _normal(rng, (64, N), 0.1), _normal(rng, (N,)))

    def fn(x, w1, b1, w2, b2):
        def loss(layers):
            y = jax_epilog.mlp(x, layers, forward="fused", backward="fused")
            return jnp.mean(jnp.square(y.astype(jnp.float32)))
        value, grads = jax.value_and_grad(loss)([(w1, b1), (w2, b2)])
        return (value, *jax.tree.leaves(grads))

    return fn, make


def _fp8_dense_step():
    def make(rng):
        return _normal(rng, (256, 128)), _normal(rng, (128, 64), 0.1), _normal(rng, (64,))

    def fn(x, w, b):
        def loss(w, b):
            y = jax_epilog.dense(x, w, b, activation="relu",
                                 fp8=jax_epilog.Fp8(layers="all", scaling="current"))
            return jnp.mean(jnp.square(y.astype(jnp.float32)))
        value, (dw, db) = jax.value_and_grad(loss, argnums=(0, 1))(w, b)
        return value, dw, db

    return fn, make


CASES = {
    **{f"matmul_{e.name.lower()}": _matmul_case(e) for e in (
        Epilog.BIAS, Epilog.RELU_BIAS, Epilog.RELU_AUX_BIAS, Epilog.GELU_BIAS,
        Epilog.GELU_AUX_BIAS, Epilog.DRELU_BGRAD, Epilog.DGELU_BGRAD, Epilog.BGRADB)},
    "matmul_c": _with_c(),
    "mlp_gradient": _mlp_gradient(),
    "fp8_dense_step": _fp8_dense_step(),
}


def _stored(key: str, x):
    """`x` as NumPy's own dtype (npz has no bfloat16): its bits, and its dtype's name."""
    x = np.asarray(x)
    if x.dtype.kind == "V" or x.dtype.name in ("bfloat16",) or "float8" in x.dtype.name:
        yield key, x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))
        yield f"{key}_dtype", np.array(x.dtype.name)
    else:
        yield key, x


def _commit() -> str:
    package = Path(jax_epilog.__file__).resolve().parent
    done = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None, help="the commit to record (default: git's)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = jax.devices("cpu")[0]
    manifest = {"jax_epilog": getattr(jax_epilog, "__version__", "?"),
                "commit": args.commit or _commit(), "jax": jax.__version__,
                "platform": args.platform, "cases": {}}
    for name, (fn, make) in CASES.items():
        inputs = make(_rng(name))
        exported = jax.export.export(
            jax.jit(fn), platforms=[args.platform],
            disabled_checks=list(jax_epilog.EXPORT_SAFETY_CHECKS))(*inputs)
        with jax.default_device(cpu):  # the reference, on the CPU
            expected = jax.jit(fn)(*(jax.device_put(x, cpu) for x in inputs))
        (args.out / f"{name}.bin").write_bytes(exported.serialize())
        np.savez(args.out / f"{name}.npz",
                 **{k: v for i, x in enumerate(inputs) for k, v in _stored(f"in{i}", x)},
                 **{k: v for i, y in enumerate(expected) for k, v in _stored(f"out{i}", y)})
        targets = sorted(set(__import__("re").findall(r"custom_call @(\w+)",
                                                      exported.mlir_module())))
        manifest["cases"][name] = {"inputs": len(inputs), "outputs": len(expected),
                                   "custom_calls": targets}
        print(f"{name}: {len(inputs)} inputs, {len(expected)} outputs, custom calls {targets}")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
