"""The benchmark grid (rows G1-G7: one dense layer; networks M1-M3) as functions to tune and to
time: `python -m jax_epilog.tune --grid` and `benchmarks/never_slower.py` use the same
workloads, inference forwards and training steps, and the same loss. Two transformer MLPs
(T1, T2) are there too, taken only where named (`--rows T1,T2`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jax_epilog.layers.functional import mlp

# The benchmark grid of benchmarks/README.md: id -> (B, K, N) for act(x[B, K] @ W[K, N] + b[N]) ...
GRID = {
    "G1": (65536, 4096, 4096),
    "G2": (8192, 8192, 8192),
    "G3": (8192, 1024, 4096),
    "G4": (16384, 4096, 16384),
    "G5": (16384, 16384, 4096),
    "G6": (4096, 1024, 1024),
    "G7": (256, 784, 100),
}
GELU_ROWS = ("G4", "G5")  # the transformer rows run GELU too
# ... and its networks: id -> (batch, widths), ReLU between layers, none after the last.
NETWORKS = {
    "M1": (65536, (4096,) * 5),
    "M2": (16384, (1024,) * 9),
    "M3": (256, (784, 100, 100, 10)),
}
# Transformer MLPs (GELU between the two layers, none after), named only: id -> (batch, widths).
TRANSFORMER_MLPS = {
    "T1": (8192, (4096, 16384, 4096)),
    "T2": (16384, (1024, 4096, 1024)),
}

class Workload(NamedTuple):
    """A stack of dense layers run as inference (forward) or as a training step
    (`jax.value_and_grad` of a squared error; a grid row also differentiates its input, as a
    layer inside a network must)."""

    name: str
    batch: int
    widths: tuple[int, ...]
    activation: Optional[str]  # between layers
    final_activation: Optional[str]
    grad_x: bool

    def shapes(self, dtype=jnp.bfloat16):
        """(params, x, target) as `jax.ShapeDtypeStruct`s."""
        params = tuple((jax.ShapeDtypeStruct((k, n), dtype), jax.ShapeDtypeStruct((n,), dtype))
                       for k, n in zip(self.widths, self.widths[1:]))
        return (params, jax.ShapeDtypeStruct((self.batch, self.widths[0]), dtype),
                jax.ShapeDtypeStruct((self.batch, self.widths[-1]), jnp.float32))

    def flops(self, mode: str) -> int:
        """1 GEMM per layer forward, 3 per layer for a step (2 for a network's first layer)."""
        per_layer = [2 * self.batch * k * n for k, n in zip(self.widths, self.widths[1:])]
        if mode == "forward":
            return sum(per_layer)
        return 3 * sum(per_layer) - (0 if self.grad_x else per_layer[0])


def grid_workloads(rows: Optional[Sequence[str]] = None) -> list[Workload]:
    """The grid rows (a dense layer, ReLU; GELU too on G4/G5) and networks, as `Workload`s;
    `rows` filters by id (G1..G7, M1..M3, and T1, T2, the transformer MLPs, only named)."""
    wanted = set(GRID) | set(NETWORKS) if rows is None else set(rows)
    unknown = wanted - set(GRID) - set(NETWORKS) - set(TRANSFORMER_MLPS)
    if unknown:
        raise ValueError(f"rows: unknown ids {sorted(unknown)}; expected some of "
                         f"{', '.join([*GRID, *NETWORKS, *TRANSFORMER_MLPS])}")
    workloads = []
    for row, (batch, k, n) in GRID.items():
        if row in wanted:
            for act in ("relu", "gelu") if row in GELU_ROWS else ("relu",):
                name = row if act == "relu" else f"{row} gelu"
                workloads.append(Workload(name, batch, (k, n), None, act, True))
    for name, (batch, widths) in NETWORKS.items():
        if name in wanted:
            workloads.append(Workload(name, batch, widths, "relu", None, False))
    for name, (batch, widths) in TRANSFORMER_MLPS.items():
        if name in wanted:
            workloads.append(Workload(name, batch, widths, "gelu", None, False))
    return workloads


def forward_fn(w: Workload, stack: Callable) -> Callable:
    """Inference: (params, x, target) -> y, with `stack(x, params, activation, final)`."""
    return lambda params, x, target: stack(x, params, w.activation, w.final_activation)


def squared_error(y, target):
    """The training loss of every measured step: 0.5 · mean((y - target)²) in float32. The grid's
    steps (`step_fn`, which `benchmarks/never_slower.py` times) and tune's stack steps
    (`stack_fn`) both use this one definition, so tune decides on the step that is checked."""
    error = y.astype(jnp.float32) - target
    return 0.5 * jnp.mean(error * error)


def step_fn(w: Workload, stack: Callable) -> Callable:
    """A training step: (params, x, target) -> (loss, grads) by `jax.value_and_grad` of
    `squared_error`."""
    def loss(params, x, target):
        return squared_error(stack(x, params, w.activation, w.final_activation), target)
    return jax.value_and_grad(loss, argnums=(0, 1) if w.grad_x else 0)


def epilog_stack(x, params, activation, final_activation):
    """The stack as `jax_epilog.mlp` runs it (every backend choice left to "auto")."""
    return mlp(x, params, activation=activation, final_activation=final_activation)


def grid_functions(rows: Optional[Sequence[str]] = None) -> list[tuple[str, Callable, tuple]]:
    """(name, function, example args) for the inference forward and the training step of every
    grid row and network."""
    return [(f"{w.name} {mode}", make(w, epilog_stack), w.shapes())
            for w in grid_workloads(rows)
            for mode, make in (("forward", forward_fn), ("step", step_fn))]
