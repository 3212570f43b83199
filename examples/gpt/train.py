"""Train the GPT of `model.py` on the standard library's sources, bytes as tokens.

    python examples/gpt/train.py --config tiny                       # CPU, a minute
    python examples/gpt/train.py --config small --impl epilog --fp8  # one H200
    python examples/gpt/train.py --config large --impl epilog --fp8 --fp8-scaling block
    python examples/gpt/train.py --config large --impl stock --checkpoint-dir /tmp/gpt --out run.json
    python examples/gpt/train.py --config large --impl stock --fp8   # the stock code, FP8 by one call
    python examples/gpt/train.py --distributed ...   # one copy per process (README.md)

AdamW with linear warm-up and cosine decay, global-norm clipping, a tqdm bar with the loss and
tokens/s, the validation loss every `eval_every` steps, orbax checkpoints (parameters, optimizer
state, FP8 scaling state, data position and step) that resume bit for bit: a run stopped and
resumed from `--checkpoint-dir` takes exactly the steps an uninterrupted run takes. `--out`
writes a JSON summary: tokens/s, median step time, the compiled step's memory, the loss
histories and the versions. Compute is bfloat16 on a GPU (float32 parameters), float32
elsewhere.

Data parallel over every device JAX sees (`data_mesh`): with several devices the state is
replicated and each global batch split along its rows over a "data" axis. `--distributed`
first joins the processes of a multi-process run (`jax.distributed.initialize`, JAX's own
runtime), whose devices then make up the one mesh: every process runs this script with the
same arguments, builds the same global batch (the loader is a function of seed and position)
and feeds its devices their rows; checkpoints are written once for all (orbax), and process 0
alone shows progress and writes `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, Optional

if __package__ in (None, ""):  # run as a script: make `gpt` (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import jax_epilog
from gpt import configs, data
from gpt.model import GPT, IMPLS, split

#: jax-epilog's FP8 recipe here: the defaults (`fp8=True`). The modules keep amax histories, so
#: scaling is delayed, calibrating itself on the first step; each projection runs FP8 where
#: its GEMM reaches `fp8_pays`'s measured crossover (2·rows·K·N >= 2**36: every projection of
#: `small` and `large` at 16384 tokens a step).
FP8_RECIPE = jax_epilog.Fp8()
#: `--fp8-scaling block`: DeepSeek-V3's block scaling (`Fp8(scaling="block")`: one scale per
#: 1×128 tile of activations and gradients, per 128×128 block of weights, e4m3 throughout, no
#: state); a projection whose widths are not multiples of 128, or too small to pay, stays 16-bit.
FP8_BLOCK_RECIPE = jax_epilog.Fp8(scaling="block")
FP8_SCALINGS = ("per-tensor", "block")


def fp8_recipe(scaling: str = "per-tensor") -> jax_epilog.Fp8:
    """The recipe `--fp8-scaling` names: `FP8_RECIPE` ("per-tensor") or `FP8_BLOCK_RECIPE`."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_scaling: expected one of {FP8_SCALINGS}, got {scaling!r}")
    return FP8_RECIPE if scaling == "per-tensor" else FP8_BLOCK_RECIPE


DTYPES = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str = "auto"):
    """bfloat16 on a GPU, float32 elsewhere ("auto"), or the dtype named."""
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {name!r}")
    if name == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    return DTYPES[name]


def build_model(config: configs.TrainConfig, impl: str, *, fp8: bool = False,
                dtype=jnp.float32, attention: str = "auto",
                fp8_scaling: str = "per-tensor") -> GPT:
    """The model for `impl` (with jax-epilog's FP8 where `fp8`, the recipe `fp8_scaling`
    names: `fp8_recipe`), initialised from the config's seed: the same weights for every
    impl. FP8 on impl "stock" leaves the model's code as it is: the stock model is switched
    by one call, `jax_epilog.nnx.fp8_training` (docs/stock_models.md), which gives every
    `nnx.Linear` this package's FP8 GEMMs (its bias in the GEMM's epilog) and keeps Flax's
    FP8 state, which `Trainer` carries as it carries `flax_fp8`'s."""
    if fp8 and impl not in ("epilog", "stock"):
        raise ValueError(f"fp8: jax-epilog's FP8 is for impl 'epilog' (its layers) or 'stock' "
                         f"(by one call), got impl={impl!r} (Flax's own FP8 is "
                         "impl='flax_fp8')")
    recipe = fp8_recipe(fp8_scaling) if fp8 else None
    if impl == "stock" and recipe is not None and recipe.block:
        raise ValueError("fp8_scaling: the stock model's one call (fp8_training) takes "
                         "per-tensor scaling; block scaling is for impl='epilog'")
    model = GPT(config.model, impl=impl, dtype=dtype,
                fp8=recipe if impl == "epilog" else None,
                attention=attention, rngs=nnx.Rngs(config.seed))
    if impl == "stock" and recipe is not None:
        model = jax_epilog.nnx.fp8_training(model, fp8=recipe)
    return model


def learning_rate_schedule(config: configs.TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.learning_rate * config.min_learning_rate_ratio)


def make_optimizer(config: configs.TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW; weight decay on matrices only (not biases or norms)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                    weight_decay=config.weight_decay, mask=decay_mask))


_global_norm = optax.tree.norm if hasattr(getattr(optax, "tree", None), "norm") \
    else optax.global_norm  # optax < 0.2.5


class TrainState(NamedTuple):
    """Everything a step changes (and a checkpoint holds, with the data position)."""

    step: Any       # int32 scalar
    params: Any     # nnx.State of nnx.Param
    fp8: Any        # nnx.State of the FP8 scaling variables (empty without FP8)
    opt_state: Any


def cross_entropy(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()


def data_mesh() -> Optional[jax.sharding.Mesh]:
    """Every device of every process along one "data" axis; None with a single device."""
    devices = jax.devices()
    return jax.sharding.Mesh(np.array(devices), ("data",)) if len(devices) > 1 else None


def state_shardings(mesh: jax.sharding.Mesh, state, fully_sharded: bool = False):
    """The state's shardings: replicated, or `fully_sharded` (FSDP, ZeRO-3): every matrix
    (parameters and their optimizer moments) split along its first axis over "data" where it
    divides evenly; XLA gathers each where a layer uses it (the FP8 layers gather their
    weights in FP8, docs/multi_gpu.md) and reduce-scatters the gradients."""
    def sharding(leaf):
        shape = getattr(leaf, "shape", ())
        split = fully_sharded and len(shape) >= 2 and shape[0] % mesh.size == 0
        return NamedSharding(mesh, P("data") if split else P())
    return jax.tree.map(sharding, state)


class Trainer:
    """The jitted train and eval steps of one model, functional over `TrainState`; data
    parallel over `mesh`'s "data" axis where given (`data_mesh`), the state replicated or
    `fully_sharded` (`state_shardings`)."""

    def __init__(self, model: GPT, optimizer: optax.GradientTransformation,
                 mesh: Optional[jax.sharding.Mesh] = None, fully_sharded: bool = False):
        self.graphdef, params, fp8, self.rest = split(model)
        self.optimizer = optimizer
        self.mesh = mesh
        self.initial = TrainState(jnp.zeros((), jnp.int32), params, fp8,
                                  optimizer.init(params))
        if mesh is None:
            self.step = jax.jit(self._step, donate_argnums=0)
            self.eval_loss = jax.jit(self._eval_loss)
            return
        replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        states = state_shardings(mesh, self.initial, fully_sharded)
        # Every process holds the same initial state (the same seed) and keeps its shards.
        self.initial = jax.device_put(self.initial, states)
        self.step = jax.jit(self._step, donate_argnums=0, in_shardings=(states, rows, rows),
                            out_shardings=(states, replicated))
        self.eval_loss = jax.jit(self._eval_loss, in_shardings=(states, rows, rows),
                                 out_shardings=replicated)

    def batch(self, arrays):
        """A host batch (the same global batch on every process) as the step takes it: split
        along its rows over the mesh, each process giving its own devices' rows."""
        if self.mesh is None:
            return arrays
        rows = NamedSharding(self.mesh, P("data"))
        if arrays[0].shape[0] % self.mesh.size:
            raise ValueError(f"batch_size: {arrays[0].shape[0]} rows do not split evenly over "
                             f"the {self.mesh.size} devices of the data-parallel mesh; use a "
                             f"multiple of {self.mesh.size}")
        return tuple(jax.make_array_from_callback(a.shape, rows, lambda index, a=a: a[index])
                     for a in arrays)

    def _loss(self, params, fp8, inputs, targets):
        model = nnx.merge(self.graphdef, params, fp8, self.rest)
        return cross_entropy(model(inputs), targets)

    def _step(self, state: TrainState, inputs, targets):
        # The FP8 state's gradient is its next value ("overwrite with gradient"): it replaces
        # the state and never reaches the optimizer.
        loss, (grads, fp8) = jax.value_and_grad(self._loss, argnums=(0, 1))(
            state.params, state.fp8, inputs, targets)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, fp8, opt_state), \
            {"loss": loss, "grad_norm": _global_norm(grads)}

    def _eval_loss(self, state: TrainState, inputs, targets):
        return self._loss(state.params, state.fp8, inputs, targets)

    def compile(self, state: TrainState, batch) -> tuple[Any, Optional[dict]]:
        """(the compiled train step, its `memory_analysis()` in bytes, or None where the
        backend gives none)."""
        compiled = self.step.lower(state, *self.batch(batch)).compile()
        return compiled, memory_stats(compiled)

    def validation_loss(self, state: TrainState, batches) -> float:
        return float(np.mean([self.eval_loss(state, *self.batch(batch)) for batch in batches]))


def memory_stats(compiled) -> Optional[dict]:
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError):
        return None
    if stats is None:
        return None
    return {name: int(getattr(stats, name)) for name in (
        "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
        "alias_size_in_bytes", "generated_code_size_in_bytes")}


# --- checkpoints -------------------------------------------------------------------------------

def checkpoint_manager(directory: Path, max_to_keep: int = 2):
    import orbax.checkpoint as ocp
    # Saved synchronously: the step donates the state's buffers as soon as the next step runs.
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).resolve(), options=options)


def save_checkpoint(manager, state: TrainState, batches: data.Batches,
                    config: configs.TrainConfig) -> None:
    import orbax.checkpoint as ocp
    meta = {"data_position": batches.position, "data_seed": batches.seed,
            "config": json.loads(json.dumps(dataclasses.asdict(config)))}
    manager.save(int(state.step), args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))


def restore_checkpoint(manager, like: TrainState, batches: data.Batches,
                       config: configs.TrainConfig) -> Optional[TrainState]:
    """The latest checkpoint's state (shaped as `like`), with `batches` moved to its data
    position; None where the directory has none."""
    import orbax.checkpoint as ocp
    step = manager.latest_step()
    if step is None:
        return None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    meta = restored["meta"]
    saved_config = meta["config"]
    if saved_config != json.loads(json.dumps(dataclasses.asdict(config))):
        raise ValueError(f"checkpoint_dir: step {step} there was trained with another "
                         f"configuration ({saved_config}); use another directory")
    batches.position, batches.seed = meta["data_position"], meta["data_seed"]
    return restored["state"]


# --- the run -------------------------------------------------------------------------------------

def versions() -> dict[str, Any]:
    found = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "jax-epilog"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    device = jax.devices()[0]
    found.update(platform=device.platform, device=device.device_kind)
    return found


def train(config: configs.TrainConfig, impl: str = "stock", *, fp8: bool = False,
          dtype_name: str = "auto", attention: str = "auto",
          checkpoint_dir: Optional[Path] = None, corpus: Optional[data.Corpus] = None,
          progress: bool = True, stop_after: Optional[int] = None,
          fully_sharded: bool = False, fp8_scaling: str = "per-tensor",
          time_limit_s: Optional[float] = None) -> dict[str, Any]:
    """Trains (or resumes from `checkpoint_dir`) to `config.steps`, or stops after step
    `stop_after`, or at the first logged step past `time_limit_s` seconds of training (compile
    excluded), checkpointing there as an interrupted run would have; returns the summary."""
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s: expected a positive number of seconds, got "
                         f"{time_limit_s!r}")
    dtype = compute_dtype(dtype_name)
    corpus = corpus if corpus is not None else data.load_corpus()
    model = build_model(config, impl, fp8=fp8, dtype=dtype, attention=attention,
                        fp8_scaling=fp8_scaling)
    mesh = data_mesh()
    if fully_sharded and mesh is None:
        raise ValueError("fully_sharded: shards the state over several devices; JAX sees one")
    trainer = Trainer(model, make_optimizer(config), mesh, fully_sharded)
    batches = data.Batches(corpus.train, config.batch_size, config.model.seq_len, config.seed)
    validation = data.validation_batches(corpus.validation, config.batch_size,
                                         config.model.seq_len, config.eval_batches)
    state = trainer.initial
    manager = checkpoint_manager(checkpoint_dir) if checkpoint_dir is not None else None
    resumed_from = None
    if manager is not None:
        restored = restore_checkpoint(manager, state, batches, config)
        if restored is not None:
            state, resumed_from = restored, int(restored.step)
    if jax.process_count() > 1:
        print(f"process {jax.process_index()} of {jax.process_count()}: "
              f"{jax.local_device_count()} of {jax.device_count()} devices, "
              f"resumed from step {resumed_from}", flush=True)

    compile_start = time.perf_counter()
    step_fn, memory = trainer.compile(state, batches.batch(batches.position))
    compile_seconds = time.perf_counter() - compile_start
    start, end = int(state.step), min(config.steps, stop_after or config.steps)
    train_losses, val_losses, interval_step_times = [], [], []
    label = f" fp8{' block' if fp8_scaling == 'block' else ''}" if fp8 else ""
    bar = tqdm(range(start, end), desc=f"{impl}{label}", unit="step",
               disable=not progress or jax.process_index() != 0, initial=start,
               total=config.steps)
    interval_start, interval_steps = time.perf_counter(), 0
    loop_start, stopped_by_time = interval_start, False
    for step in bar:
        state, metrics = step_fn(state, *trainer.batch(next(batches)))
        interval_steps += 1
        done = step + 1
        if done % config.log_every == 0 or done == end:
            loss = float(metrics["loss"])  # waits for the step
            elapsed = time.perf_counter() - interval_start
            if step + 1 - interval_steps > start:  # the first interval includes warm-up
                interval_step_times.append(elapsed / interval_steps)
            train_losses.append((done, loss))
            bar.set_postfix(loss=f"{loss:.4f}", grad_norm=f"{float(metrics['grad_norm']):.3f}",
                            tok_s=f"{interval_steps * config.tokens_per_step / elapsed:,.0f}")
            interval_start, interval_steps = time.perf_counter(), 0
            # Checked where the loss is read, so that the check waits for no extra step.
            stopped_by_time = time_limit_s is not None and done < end and \
                interval_start - loop_start > time_limit_s
        if done % config.eval_every == 0 or done == config.steps or stopped_by_time:
            val_losses.append((done, trainer.validation_loss(state, validation)))
            if jax.process_index() == 0:
                bar.write(f"step {done}: validation loss {val_losses[-1][1]:.4f}")
            interval_start, interval_steps = time.perf_counter(), 0
        if manager is not None and (done == end or stopped_by_time or (
                config.checkpoint_every and done % config.checkpoint_every == 0)):
            save_checkpoint(manager, state, batches, config)
        if stopped_by_time:
            end = done
            bar.write(f"stopped after step {done}: past the time limit of {time_limit_s} s")
            break
    bar.close()
    step_time = statistics.median(interval_step_times) if interval_step_times else None
    return {
        "config": dataclasses.asdict(config), "impl": impl, "fp8": fp8,
        "fp8_recipe": repr(fp8_recipe(fp8_scaling)) if fp8 else None,
        "dtype": jnp.dtype(dtype).name,
        "attention": model.blocks[0].attention.implementation,
        "steps": [start, end], "resumed_from": resumed_from,
        "stopped_by_time_limit": stopped_by_time, "train_s": time.perf_counter() - loop_start,
        "tokens_per_step": config.tokens_per_step,
        "processes": jax.process_count(), "devices": jax.device_count(),
        "fully_sharded": fully_sharded,
        "step_time_median_s": step_time,
        "tokens_per_s": config.tokens_per_step / step_time if step_time else None,
        "compile_s": compile_seconds, "memory": memory,
        "train_loss": train_losses, "validation_loss": val_losses,
        "versions": versions(), "state": state,
    }


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny", choices=tuple(configs.CONFIGS))
    parser.add_argument("--impl", default="stock", choices=IMPLS,
                        help="stock nnx.Linear, jax-epilog's layers, or Flax's own FP8")
    parser.add_argument("--fp8", action="store_true",
                        help="jax-epilog's FP8 on every projection: its layers' (--impl "
                             "epilog) or, the model's code unchanged, by one call (--impl "
                             "stock: jax_epilog.nnx.fp8_training)")
    parser.add_argument("--fp8-scaling", default="per-tensor", choices=FP8_SCALINGS,
                        help="with --fp8: per-tensor (the default, Fp8()) or block "
                             "(Fp8(scaling=\"block\"), DeepSeek-V3's 1x128/128x128 tiles)")
    parser.add_argument("--dtype", default="auto", choices=tuple(DTYPES),
                        help="compute dtype (auto: bfloat16 on a GPU, else float32)")
    parser.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"))
    parser.add_argument("--steps", type=int, help="override the config's step count")
    parser.add_argument("--warmup-steps", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--layers", type=int, help="override the config's n_layers")
    parser.add_argument("--eval-every", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="save here (and resume from the latest checkpoint here)")
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--log-every", type=int, help="record the training loss every N steps")
    parser.add_argument("--stop-after", type=int,
                        help="stop (and checkpoint) after this step, as an interrupted run")
    parser.add_argument("--time-limit-s", type=float,
                        help="stop (and checkpoint) at the first logged step past this many "
                             "seconds of training, compile excluded")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the parameters and optimizer state over the devices "
                             "(gathered per layer) instead of replicating them")
    parser.add_argument("--distributed", action="store_true",
                        help="one of several processes: jax.distributed.initialize first")
    parser.add_argument("--coordinator-address", default=None,
                        help="with --distributed: host:port of process 0's coordinator "
                             "(default: JAX_COORDINATOR_ADDRESS, or the cluster's, e.g. SLURM)")
    parser.add_argument("--num-processes", type=int, default=_env_int("JAX_NUM_PROCESSES"),
                        help="with --distributed (default: JAX_NUM_PROCESSES, or the cluster's)")
    parser.add_argument("--process-id", type=int, default=_env_int("JAX_PROCESS_ID"),
                        help="with --distributed (default: JAX_PROCESS_ID, or the cluster's)")
    parser.add_argument("--out", type=Path, help="write the JSON summary here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.distributed:
        # JAX's multi-controller runtime: None lets it read JAX_COORDINATOR_ADDRESS or detect
        # the cluster (SLURM, Open MPI, Kubernetes, TPU pods).
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id)
    elif (args.coordinator_address, args.num_processes, args.process_id) != (None,) * 3:
        parser.error("--coordinator-address, --num-processes and --process-id (or their "
                     "environment variables) take effect with --distributed")
    overrides = {"steps": args.steps, "warmup_steps": args.warmup_steps, "batch_size": args.batch_size, "n_layers": args.layers,
                 "eval_every": args.eval_every, "seed": args.seed,
                 "checkpoint_every": args.checkpoint_every, "log_every": args.log_every}
    config = configs.get(args.config)
    steps = args.steps if args.steps is not None else config.steps
    if args.warmup_steps is None and config.warmup_steps > steps:
        overrides["warmup_steps"] = steps // 10  # the configs' own proportion
        print(f"warm-up shortened to {steps // 10} steps: the config's {config.warmup_steps} "
              f"are more than --steps {steps}")
    config = config.replace(**{k: v for k, v in overrides.items() if v is not None})
    if args.fp8 and args.impl != "epilog":
        parser.error(f"--fp8 is jax-epilog's FP8 and needs --impl epilog (got --impl "
                     f"{args.impl}); Flax's own FP8 is --impl flax_fp8")
    if args.fp8_scaling != "per-tensor" and not args.fp8:
        parser.error(f"--fp8-scaling {args.fp8_scaling} chooses the recipe of --fp8; add --fp8")
    summary = train(config, args.impl, fp8=args.fp8, fp8_scaling=args.fp8_scaling,
                    dtype_name=args.dtype,
                    attention=args.attention, checkpoint_dir=args.checkpoint_dir,
                    progress=not args.no_progress, stop_after=args.stop_after,
                    fully_sharded=args.fsdp, time_limit_s=args.time_limit_s)
    summary.pop("state")
    speed = (f"tokens/s {summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else
             f"tokens/s not measured (the first {config.log_every} steps include compilation; "
             f"run more than {config.log_every} steps)")
    print(f"{speed}, validation loss "
          f"{summary['validation_loss'][-1][1] if summary['validation_loss'] else 'n/a'}")
    if args.out is not None and jax.process_index() == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
