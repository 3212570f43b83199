"""The collectives of compiled training steps: a Megatron MLP block under `jax.jit` in bf16
and in FP8, tensor parallel, sequence parallel and fully sharded (docs/multi_gpu.md, "FP8
collectives").

`collectives(text)` reads compiled HLO text; `block_step` compiles one training step (forward
and backward of a two-layer GELU MLP, `jax_epilog.mlp`) for a layout and a recipe. Used by
`tests/support/sharding_checks.py`; run as a script (with 8 devices, as below) it prints the table the
docs show:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        PYTHONPATH=. python tests/support/collectives.py
"""

from __future__ import annotations

import functools
import math
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_epilog

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_OP = re.compile(r"= (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


#: The most float32 values an amax reduction moves: the layers reduce independent amaxes as
#: one vector (`jax_epilog.op.amaxes`), a few per layer; every other collective of these steps
#: moves hundreds of values or more.
AMAX_VALUES = 64


def _amaxes(dtype: str, dims: tuple) -> bool:
    return dtype == "f32" and math.prod(dims) <= AMAX_VALUES


class Collective(NamedTuple):
    kind: str
    shapes: tuple  # (dtype, dims) of each array it moves (its results)

    @property
    def scalar(self) -> bool:
        """Whether it moves amaxes only: float32 scalars or short vectors (`AMAX_VALUES`)."""
        return all(_amaxes(d, dims) for d, dims in self.shapes)

    @property
    def bytes(self) -> int:
        """The bytes of its other arrays (amaxes riding along are not counted)."""
        return sum(_BYTES[d] * math.prod(dims) for d, dims in self.shapes
                   if not _amaxes(d, dims))


def collectives(text: str) -> list[Collective]:
    """Every collective of compiled HLO text (an asynchronous one counted at its start)."""
    found = []
    for line in text.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        shapes = [(d, tuple(int(n) for n in dims.split(",") if n))
                  for d, dims in _SHAPE.findall(match.group(1))]
        if match.group(3) and match.group(2) in ("all-gather", "collective-permute"):
            shapes = shapes[len(shapes) // 2:]  # (operands, results): the results
        found.append(Collective(match.group(2), tuple(shapes)))
    return found


class Summary(NamedTuple):
    counts: dict          # kind -> number of non-scalar collectives
    bytes: dict           # kind -> their bytes
    scalar_all_reduces: int  # all-reduces of amaxes (`Collective.scalar`)
    other_scalars: int    # amax-sized collectives that are not all-reduces (should be none)


def summarize(found: list[Collective]) -> Summary:
    counts = {k: sum(1 for c in found if c.kind == k and not c.scalar) for k in KINDS}
    sizes = {k: sum(c.bytes for c in found if c.kind == k) for k in KINDS}
    scalars = [c for c in found if c.scalar]
    return Summary(counts, sizes, sum(1 for c in scalars if c.kind == "all-reduce"),
                   sum(1 for c in scalars if c.kind != "all-reduce"))


# --- the block and its layouts ------------------------------------------------------------------

TOKENS, D_MODEL, HIDDEN = 2048, 512, 2048
_MEGATRON = (P(None, "model"), P("model"), P("model", None), P())
#: the spec of the activations (tokens, d_model) outside the block, inside it (the block's
#: input is constrained to it, as MaxText constrains each layer's activations), and of
#: (W1, b1, W2, b2), on a (data=2, model=4) mesh
LAYOUTS = {
    # Megatron: W1 split by columns, W2 by rows, one psum of the row-parallel products
    "tensor parallel": (P("data", None), P("data", None), _MEGATRON),
    # ... with the activations outside the block split along the tokens over "model" too:
    # gathered into the block, the result reduce-scattered out of it
    "sequence parallel": (P(("data", "model"), None), P("data", None), _MEGATRON),
    # every parameter split over "data" (as the batch), gathered for its layer's GEMMs
    "fully sharded": (P("data", None), P("data", None),
                      (P("data", None), P("data"), P("data", None), P("data"))),
}
RECIPES = ("bf16", "current", "delayed")


def mesh_2x4():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def block_data(seed: int = 0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[0]), jnp.bfloat16)
    params = (normal(D_MODEL, HIDDEN), normal(HIDDEN), normal(HIDDEN, D_MODEL), normal(D_MODEL))
    return params, normal(TOKENS, D_MODEL), normal(TOKENS, D_MODEL)


def recipe(name: str):
    return None if name == "bf16" else jax_epilog.Fp8(layers="all", scaling=name,
                                                        amax_history_length=4)


def block_loss(params, state, x, target, *, fp8, in_sharding=None, out_sharding=None):
    w1, b1, w2, b2 = params
    constrain = lambda a, sharding: a if sharding is None else \
        jax.lax.with_sharding_constraint(a, sharding)  # the layout's activations
    y = jax_epilog.mlp(constrain(x, in_sharding), [(w1, b1), (w2, b2)], activation="gelu",
                       fp8=fp8, fp8_state=state)
    return jnp.mean(jnp.square((constrain(y, out_sharding) - target).astype(jnp.float32)))


def block_step(layout: str, recipe_name: str, mesh=None):
    """(the jitted step (loss and gradients w.r.t. the parameters and FP8 state), its
    arguments): `step(*args)` runs it, `step.lower(*args).compile()` compiles it. With
    `layout=None` the step runs on one device."""
    fp8 = recipe(recipe_name)
    state = fp8.init_state(2) if fp8 is not None and fp8.scaling == "delayed" else None
    params, x, target = block_data()
    args = (params, state, x, target)
    if layout is None:
        loss = functools.partial(block_loss, fp8=fp8)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), \
            jax.device_put(args, jax.devices()[0])
    mesh = mesh or mesh_2x4()
    x_spec, inner_spec, param_specs = LAYOUTS[layout]
    named = lambda spec: NamedSharding(mesh, spec)
    loss = functools.partial(block_loss, fp8=fp8, in_sharding=named(inner_spec),
                             out_sharding=named(x_spec))
    shardings = (tuple(map(named, param_specs)), None if state is None else named(P()),
                 named(x_spec), named(x_spec))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), in_shardings=shardings), args


def measure(layout: str, recipe_name: str) -> Summary:
    step, args = block_step(layout, recipe_name)
    return summarize(collectives(step.lower(*args).compile().as_text()))


def table() -> str:
    """The markdown table of every layout and recipe's collectives."""
    rows = ["| layout | recipe | all-gather | all-reduce | reduce-scatter | all-to-all, "
            "collective-permute | amax all-reduces |", "|---" * 7 + "|"]
    cell = lambda s, k: f"{s.counts[k]} ({s.bytes[k] / 1024:,.0f} KiB)" if s.counts[k] else "0"
    for layout in LAYOUTS:
        for name in RECIPES:
            s = measure(layout, name)
            other = s.counts["all-to-all"] + s.counts["collective-permute"]
            rows.append(f"| {layout} | {name} | {cell(s, 'all-gather')} | "
                        f"{cell(s, 'all-reduce')} | {cell(s, 'reduce-scatter')} | {other} | "
                        f"{s.scalar_all_reduces} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    print(table())
