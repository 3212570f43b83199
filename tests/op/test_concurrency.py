"""Concurrency: threads sharing jitted jax-epilog functions, and several GPUs at once.

On CUDA the library keeps one cuBLASLt handle and one plan cache per device, shared by every
thread that calls into XLA; here 8 Python threads hammer different problems at once and every
result must equal, bit for bit, the same call made serially. On a CPU (CI) this runs the
reference; on the H200 the same test runs the custom call (the default device is the GPU).
With two or more GPUs, the same function runs per device, under `pmap` and under sharding.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import jax_epilog
from numpy_reference import unpack_bits
from conftest import cuda_devices
from jax_epilog import Epilog
from random_problems import Problem

THREADS = 8
ROUNDS = 80  # each thread runs every problem ROUNDS times: 8 * 8 * 80 = 5120 calls

PROBLEMS = [  # one per thread, all different shapes; every thread also runs the others
    Problem(Epilog.RELU_AUX_BIAS, "bfloat16", (), 127, 129, 33, False, False, False, False, True, 1),
    Problem(Epilog.DRELU_BGRAD, "float16", (3,), 17, 65, 8, False, True, False, False, True, 2),
    Problem(Epilog.GELU_AUX_BIAS, "float32", (2,), 31, 40, 7, True, False, True, True, True, 3),
    Problem(Epilog.DGELU_BGRAD, "bfloat16", (), 64, 7, 129, True, True, False, False, True, 4),
    Problem(Epilog.BGRADB, "float32", (), 9, 300, 5, True, False, False, False, True, 5),
    Problem(Epilog.BGRADA, "float16", (2,), 1, 33, 16, False, False, True, False, True, 6),
    Problem(Epilog.BIAS, "float32", (), 200, 1, 3, False, True, False, False, False, 7),
    Problem(Epilog.DRELU, "bfloat16", (4,), 5, 256, 11, True, True, True, False, True, 8),
]


def _jitted(p: Problem):
    precision = jax.lax.Precision.HIGHEST if p.full_float32 else None
    return jax.jit(lambda a, b, inputs: jax_epilog.matmul(
        a, b, epilog=p.epilog, epilog_inputs=inputs or None, transpose_a=p.transpose_a,
        transpose_b=p.transpose_b, precision=precision))


def _as_numpy(out, n: int):
    """The outputs as NumPy arrays; mask bits past N are unspecified, so only N bits count."""
    y, aux = out if isinstance(out, tuple) else (out, {})
    arrays = [np.asarray(y)]
    for name in sorted(aux):
        x = np.asarray(aux[name])
        arrays.append(unpack_bits(x, n) if name == "relu_aux" else x)
    return arrays


def test_threads_match_serial_runs():
    fns = [_jitted(p) for p in PROBLEMS]
    args = [jax.device_put(p.operands()) for p in PROBLEMS]
    serial = [_as_numpy(f(*x), p.n) for p, f, x in zip(PROBLEMS, fns, args)]
    for p, f, x in zip(PROBLEMS, fns, args):  # the serial answers are right to begin with
        assert not p.mismatches(f(*x), *x), p
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def worker(t: int):
        start.wait()
        for r in range(ROUNDS):
            for i in ((t + j) % len(PROBLEMS) for j in range(len(PROBLEMS))):
                got = _as_numpy(fns[i](*args[i]), PROBLEMS[i].n)
                if not all(np.array_equal(g, w, equal_nan=True) for g, w in zip(got, serial[i])):
                    errors.append(f"thread {t} round {r}: {PROBLEMS[i]} differs from serial")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]


# --- several GPUs ----------------------------------------------------------------------------

def _two_gpus():
    devices = cuda_devices()
    if len(devices) < 2:
        pytest.skip("needs at least 2 CUDA devices")
    return devices


@pytest.mark.gpu
@pytest.mark.parametrize("p", PROBLEMS[:4], ids=lambda p: p.epilog.name)
def test_each_gpu_gives_the_right_answer(p):
    """The same jitted function on every device (a handle and plans per device)."""
    f = _jitted(p)
    args = p.operands()
    for device in _two_gpus():
        out = f(*jax.device_put(args, device))
        assert all(x.devices() == {device} for x in jax.tree.leaves(out))
        assert not p.mismatches(out, *args), (device, p)


@pytest.mark.gpu
def test_pmap_and_sharding_over_gpus():
    devices = _two_gpus()
    # Per device: different data, the same problem (RELU_AUX_BIAS, bf16, odd sizes).
    problems = [Problem(Epilog.RELU_AUX_BIAS, "bfloat16", (), 65, 129, 33, False, False, False,
                        False, True, seed) for seed in range(len(devices))]
    stacked = jax.tree.map(lambda *x: np.stack(x), *(p.operands() for p in problems))
    y, aux = jax.pmap(lambda a, b, x: jax_epilog.matmul(a, b, epilog=Epilog.RELU_AUX_BIAS,
                                                        epilog_inputs=x), devices=devices)(
        *stacked)
    for i, p in enumerate(problems):
        assert not p.mismatches((y[i], {"relu_aux": aux["relu_aux"][i]}), *p.operands())

    # Sharding: leading dim split across the devices, b and bias replicated.
    p = Problem(Epilog.GELU_AUX_BIAS, "float32", (2 * len(devices),), 31, 127, 17, False, True,
                False, False, True, 11)
    a, b, inputs = p.operands()
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    out = _jitted(p)(jax.device_put(a, split), b, inputs)
    assert not p.mismatches(out, a, b, inputs)
