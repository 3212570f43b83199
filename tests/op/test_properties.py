"""Property tests: random valid problems on the CPU against the float64 NumPy model.

Every problem is random in structure (epilog, dtype, 0-2 leading dims, shapes 1..40,
transposes, shared or batched b and bias, precision) and in data. Compiling is what costs on a
CPU (~0.1 s per new structure, ~5 ms per call), so hypothesis picks each problem's structure
from a fixed pool of `STRUCTURES` random ones and draws fresh operands for it: 500 problems,
each structure compiled once. Derandomized, so CI runs the same problems every time; a failure
prints the `Problem` that reproduces it.
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_epilog
from random_problems import Problem, draw_problem

EXAMPLES = 500
STRUCTURES = 160
_POOL = [draw_problem(np.random.default_rng(seed)) for seed in range(STRUCTURES)]

# Opt level 0: half the compile time; XLA's numerics do not depend on it.
_matmul = jax.jit(jax_epilog.matmul, static_argnames=(
    "epilog", "transpose_a", "transpose_b", "precision"),
    compiler_options={"xla_backend_optimization_level": 0})


def problems():
    return st.builds(lambda structure, seed: dataclasses.replace(structure, seed=seed),
                     st.sampled_from(_POOL), st.integers(0, 2**31 - 1))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
@given(problems())
def test_matches_numpy_model(problem: Problem):
    a, b, inputs = problem.operands()
    found = problem.mismatches(problem.run(_matmul, a, b, inputs), a, b, inputs)
    assert not found, found


def test_pool_covers_the_space():
    """The pool spans every epilog, dtype, transpose, layout and odd sizes."""
    assert {p.epilog for p in _POOL} == set(jax_epilog.Epilog)
    assert {p.dtype for p in _POOL} == {"float32", "bfloat16", "float16"}
    assert {(p.transpose_a, p.transpose_b) for p in _POOL} == {(x, y) for x in (0, 1)
                                                                for y in (0, 1)}
    assert {len(p.lead) for p in _POOL} == {0, 1, 2}
    assert any(p.b_batched for p in _POOL) and any(p.bias_batched and p.epilog.has_bias
                                                   for p in _POOL)
    assert {1, 40} <= {s for p in _POOL for s in (p.m, p.n, p.k)}
