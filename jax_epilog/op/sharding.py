"""Which mesh axes split each dimension of a call under `jax.jit` with sharded operands
(`mesh_layout`). The outer primitive's partitioning rule and its results' shardings under
Explicit axes (`primitive.py`) lay a call out with it: a dimension that does not
divide evenly over its mesh axes, or a mesh axis already used by another dimension, is
replicated instead; which axes each array has comes from `epilogs.ARRAYS`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jax.sharding import NamedSharding, PartitionSpec

from jax_epilog.op.epilogs import ARRAYS, AUX_DIM_COLUMNS
from jax_epilog.op.call import Params, problem_of


def _arrays(params: Params) -> tuple[str, ...]:
    epilog = params.epilog
    return epilog.input_names + epilog.output_names


def n_block(params: Params) -> int:
    """Columns a shard of N must hold whole, for the epilog's aux arrays to split with N."""
    return max([1] + [AUX_DIM_COLUMNS.get(d, 1) for name in _arrays(params)
                      for d in ARRAYS[name].dims])


# --- the layout: which mesh axes split each of the GEMM's dimensions ---------------------------

class MeshLayout(NamedTuple):
    batch: tuple[str, ...]
    m: tuple[str, ...]
    n: tuple[str, ...]
    k: tuple[str, ...]
    b_batch: tuple[str, ...]
    bias_batch: tuple[str, ...]

    def spec(self, dims) -> PartitionSpec:
        axes = {"mask_bytes": self.n, "gelu_cols": self.n}
        return PartitionSpec(*(getattr(self, d, None) or axes.get(d) or None for d in dims))


def _axes(sharding, dim: int) -> tuple[str, ...]:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_layout(params: Params, mesh, arg_shapes) -> MeshLayout:
    a, b = arg_shapes[0], arg_shapes[1]
    p = problem_of(a.shape, b.shape, params.transpose_a, params.transpose_b)
    m_dim, k_dim = (2, 1) if params.transpose_a else (1, 2)
    bk_dim, n_dim = (2, 1) if params.transpose_b else (1, 2)
    bias = arg_shapes[2] if params.epilog.has_bias else None
    n_axes = _axes(b.sharding, n_dim) or (_axes(bias.sharding, 1) if bias is not None else ())
    # A sharded copy wins over a replicated one: slicing a replicated operand is free,
    # gathering a sharded one is not.
    wanted = [("batch", _axes(a.sharding, 0), p.batch, 1), ("m", _axes(a.sharding, m_dim), p.m, 1),
              ("n", n_axes, p.n, n_block(params)),
              ("k", _axes(a.sharding, k_dim) or _axes(b.sharding, bk_dim), p.k, 1)]
    used: set[str] = set()
    chosen = {}
    for name, axes, size, block in wanted:
        axes = tuple(ax for ax in axes if ax not in used)
        shards = math.prod(mesh.shape[ax] for ax in axes)
        if size % (shards * block):  # uneven shards or split blocks: keep this dim whole
            axes = ()
        used.update(axes)
        chosen[name] = axes
    b_batch = chosen["batch"] if b.shape[0] == p.batch else ()
    bias_batch = chosen["batch"] if bias is not None and bias.shape[0] == p.batch else ()
    return MeshLayout(b_batch=b_batch, bias_batch=bias_batch, **chosen)
