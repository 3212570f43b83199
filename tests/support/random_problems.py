"""Random valid `jax_epilog.matmul` problems: one description, drawn two ways.

The property tests (CPU) draw `Problem`s with hypothesis; `gpu_fuzz.py` (the H200) draws them
with a seeded NumPy generator. Both judge results the same way, against the float64 NumPy model
with `problems.TOLERANCE`, so the CPU and the GPU are held to the same contract.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog import Epilog, gelu_aux_columns, relu_mask_bytes
from problems import TOLERANCE, model_mismatches

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Problem:
    epilog: Epilog
    dtype: str
    lead: tuple[int, ...]
    m: int
    n: int
    k: int
    transpose_a: bool
    transpose_b: bool
    b_batched: bool  # b carries a's leading dims (else it is 2-D, shared)
    bias_batched: bool  # bias is (..., N) rather than (N,)
    full_float32: bool  # precision HIGHEST, else DEFAULT (float32 may use TF32 on the GPU)
    seed: int  # of the operands

    @property
    def tolerance(self) -> float:
        tf32 = self.dtype == "float32" and not self.full_float32
        return TOLERANCE["float32_tf32" if tf32 else self.dtype]

    def operands(self):
        """(a, b, epilog_inputs) as NumPy arrays of the problem's dtype (random, never 0).

        Made and converted on the host: a JAX conversion per shape would compile a program
        for every one of hundreds of shapes.
        """
        rng = np.random.default_rng(self.seed)
        dtype = jnp.dtype(self.dtype)

        def normal(*shape, scale=1.0):
            return (rng.standard_normal(shape) * scale).astype(dtype)

        a = normal(*self.lead, *((self.k, self.m) if self.transpose_a else (self.m, self.k)))
        b_lead = self.lead if self.b_batched else ()
        b = normal(*b_lead, *((self.n, self.k) if self.transpose_b else (self.k, self.n)),
                   scale=max(self.k, 1) ** -0.5)
        inputs = {}
        if self.epilog.has_bias:
            inputs["bias"] = normal(*(self.lead if self.bias_batched else ()), self.n)
        if self.epilog.aux_input == "relu_aux":  # random bits, also past N: must be ignored
            inputs["relu_aux"] = rng.integers(0, 256, (*self.lead, self.m,
                                                       relu_mask_bytes(self.n)), dtype=np.uint8)
        if self.epilog.aux_input == "gelu_aux":
            inputs["gelu_aux"] = normal(*self.lead, self.m, gelu_aux_columns(self.n))
        return a, b, inputs

    def run(self, fn, a, b, inputs):
        """`fn` (jax_epilog.matmul or a wrapper with its signature) on this problem."""
        precision = jax.lax.Precision.HIGHEST if self.full_float32 else None
        return fn(a, b, epilog=self.epilog, epilog_inputs=inputs or None,
                  transpose_a=self.transpose_a, transpose_b=self.transpose_b,
                  precision=precision)

    def mismatches(self, got, a, b, inputs) -> list[str]:
        """How `got` = y or (y, aux) differs from the float64 NumPy model (empty: it matches),
        within this problem's tolerance, the bias-gradient sums and the mask margin included."""
        return model_mismatches(self.epilog, got, a, b, inputs, tol=self.tolerance, n=self.n,
                                transpose_a=self.transpose_a, transpose_b=self.transpose_b,
                                mask_margin=self.tolerance)


def draw_problem(rng: np.random.Generator, max_size: int = 40) -> Problem:
    """One random valid problem from a NumPy generator."""
    lead = tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(0, 3)))
    m, n, k = (int(x) for x in rng.integers(1, max_size + 1, size=3))
    return Problem(epilog=Epilog(int(rng.choice([int(e) for e in Epilog]))),
                   dtype=str(rng.choice(DTYPES)), lead=lead, m=m, n=n, k=k,
                   transpose_a=bool(rng.integers(2)), transpose_b=bool(rng.integers(2)),
                   b_batched=bool(lead) and bool(rng.integers(2)),
                   bias_batched=bool(lead) and bool(rng.integers(2)),
                   full_float32=bool(rng.integers(2)), seed=int(rng.integers(2**31)))
