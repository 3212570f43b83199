"""The SwiGLU block and block-scaled FP8 on a mesh, against one device: what a Llama training
script sharded by data (batch) and tensor (Megatron) parallelism runs.

Needs several devices, so `tests/op/test_sharding.py` runs this file in its own pytest process
(on the CPU with 8 host devices, on a GPU machine with every visible GPU), as it does
`sharding_checks.py`, whose meshes and FP8 tolerances these checks share. The layouts: rows
over "data"; Megatron's (gate and up split by columns, down by rows over "model", the partial
results summed by the user under `shard_map`); both on the 2-D mesh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_epilog
from jax_epilog import Fp8
from sharding_checks import FP8_EXACT, FP8_TOL, MESHES, _fp8_error

# mesh, (x and target, gate and up, down) specs
LAYOUTS = {
    "data": ("data", (P("data"), P(), P())),
    "megatron": ("model", (P(), P(None, "model"), P("model", None))),
    "data_megatron": ("data_model", (P("data"), P(None, "model"), P("model", None))),
}
# Widths multiples of 128 (block scaling), and of 128 per "model" shard (8 on one mesh).
M, D, F = 64, 128, 1024
RECIPES = {"bf16": None, "fp8": Fp8(layers="all"),
           "block": Fp8(layers="all", scaling="block")}


def _data(seed):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
    return (normal(M, D), normal(D, F) / np.sqrt(D), normal(D, F) / np.sqrt(D),
            normal(F, D) / np.sqrt(F), normal(M, D))


def _loss(x, gate, up, down, target, state=None, fp8=None, model_axis=None):
    y = jax_epilog.swiglu(x, (gate, up), down, fp8=fp8, fp8_state=state)
    y = jax.lax.psum(y, model_axis) if model_axis else y
    return jnp.sum(jnp.square((y - target).astype(jnp.float32))) / M


def _step(fp8, model_axis=None):
    """(loss, gradients of x, gate, up, down and the state) of one step."""
    return jax.value_and_grad(functools.partial(_loss, fp8=fp8, model_axis=model_axis),
                              argnums=(0, 1, 2, 3, 5))


def _shard_map_step(layout, fp8):
    mesh_name, (x_spec, gate_up_spec, down_spec) = LAYOUTS[layout]
    mesh = MESHES[mesh_name]
    model_axis = "model" if "model" in mesh.axis_names else None

    def local(x, gate, up, down, target, state):
        value, grads = _step(fp8, model_axis)(x, gate, up, down, target, state)
        return (jax.lax.psum(value, "data") if "data" in mesh.axis_names else value), grads

    specs = (x_spec, gate_up_spec, gate_up_spec, down_spec)
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(*specs, x_spec, P()),
                                 out_specs=(P(), (*specs, P()))))


def _fp8(scaling, layout=None):
    axes = MESHES[LAYOUTS[layout][0]].axis_names if layout else None
    return Fp8(layers="all", scaling=scaling, amax_history_length=3, amax_reduction_axes=axes)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_swiglu_under_jit_with_sharded_arguments_is_one_devices(layout, recipe):
    """The way a Flax user shards (`NamedSharding`s, `jax.jit`): XLA partitions the block,
    reducing every amax over the whole tensor, so the step is one device's up to the order
    of its sums; the gradients keep their parameters' layouts."""
    x, gate, up, down, target = _data(30)
    mesh_name, (x_spec, gate_up_spec, down_spec) = LAYOUTS[layout]
    put = lambda a, spec: jax.device_put(a, NamedSharding(MESHES[mesh_name], spec))  # noqa: E731
    args = (put(x, x_spec), put(gate, gate_up_spec), put(up, gate_up_spec),
            put(down, down_spec), put(target, x_spec))
    step = jax.jit(_step(RECIPES[recipe]))
    value, grads = step(*args, None)
    want = jax.jit(_step(RECIPES[recipe]))(x, gate, up, down, target, None)
    assert _fp8_error((value, grads[:4]), (want[0], want[1][:4])) <= FP8_TOL
    for grad, arg in zip(grads[1:4], args[1:4]):
        assert grad.sharding.is_equivalent_to(arg.sharding, 2)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_swiglu_fp8_shard_map_step_matches_one_device(layout, scaling):
    """Inside shard_map, per-tensor FP8 with `amax_reduction_axes` naming the mesh's axes:
    every amax (x's, the kernels', h's, g's and u's, the gradients') is one device's, so the
    step and the next state are (on the CPU, whose FP8 GEMMs are exact, to the order of the
    psums' additions)."""
    x, gate, up, down, target = _data(31)
    state = None
    if scaling == "delayed":  # a state calibrated by one step on one device
        state = _step(_fp8("delayed"))(x, gate, up, down, target, _fp8("delayed").init_state(2))
        state = state[1][4]
    value, grads = _shard_map_step(layout, _fp8(scaling, layout))(x, gate, up, down, target,
                                                                  state)
    want_value, want_grads = jax.jit(_step(_fp8(scaling)))(x, gate, up, down, target, state)
    assert _fp8_error((value, grads[:4]), (want_value, want_grads[:4])) <= FP8_TOL
    if state is not None:
        assert _fp8_error(grads[4], want_grads[4]) <= (2.0**-20 if FP8_EXACT else 2.0**-8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_swiglu_fp8_shard_map_without_amax_reduction_differs(layout):
    """Without `amax_reduction_axes` each device scales with its own shard's amaxes: the
    step is no longer one device's (what the check above would catch)."""
    x, gate, up, down, target = _data(32)
    value, grads = _shard_map_step(layout, _fp8("current"))(x, gate, up, down, target, None)
    want_value, want_grads = jax.jit(_step(_fp8("current")))(x, gate, up, down, target, None)
    assert _fp8_error((value, grads[:4]), (want_value, want_grads[:4])) > 2.0**-5


def _mlp_loss(x, w1, w2, target, fp8=None, model_axis=None):
    y = jax_epilog.mlp(x, [(w1, None), (w2, None)], activation="gelu", fp8=fp8)
    y = jax.lax.psum(y, model_axis) if model_axis else y
    return jnp.sum(jnp.square((y - target).astype(jnp.float32))) / M


@pytest.mark.parametrize("block", ["swiglu", "mlp"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_scaled_fp8_runs_in_shard_map(layout, block):
    """`Fp8(scaling="block")` inside shard_map (its Pallas quantization declares how its
    outputs vary): each device tiles its own rows, so the step is not one device's bit for
    bit, but its error against float32 autodiff is one device's block-scaled error."""
    x, gate, up, down, target = _data(33)
    mesh_name, (x_spec, gate_up_spec, down_spec) = LAYOUTS[layout]
    mesh = MESHES[mesh_name]
    model_axis = "model" if "model" in mesh.axis_names else None
    fp8 = RECIPES["block"]
    if block == "swiglu":
        loss, args, specs = _loss, (x, gate, up, down), (x_spec, gate_up_spec, gate_up_spec,
                                                         down_spec)
    else:
        loss, args, specs = _mlp_loss, (x, gate, down), (x_spec, gate_up_spec, down_spec)
    n = len(args)

    def step(fp8, model_axis=None):
        return jax.value_and_grad(functools.partial(loss, fp8=fp8, model_axis=model_axis),
                                  argnums=tuple(range(n)))

    def local(*args):
        value, grads = step(fp8, model_axis)(*args)
        return (jax.lax.psum(value, "data") if "data" in mesh.axis_names else value), grads

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(*specs, x_spec),
                                    out_specs=(P(), specs)))(*args, target)
    as_f32 = [a.astype(jnp.float32) for a in (*args, target)]
    exact = jax.jit(step(None))(*as_f32)
    one_device = jax.jit(step(fp8))(*args, target)
    assert _fp8_error(sharded, exact) <= 1.25 * _fp8_error(one_device, exact) + 2.0**-7
