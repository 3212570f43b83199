"""Serve a trained GPT: batched prefill and KV-cache decoding, in 16-bit or FP8.

    python examples/gpt/generate.py --random-init --config tiny --batch 1 4          # CPU smoke
    python examples/gpt/generate.py --checkpoint-dir /tmp/gpt --variant epilog_fp8 --batch 16
    python examples/gpt/generate.py --checkpoint-dir /tmp/gpt --compare --batch 1 16 64 \\
        --prompt-len 128 --new-tokens 256 --out results/generate

The parameters come from a checkpoint written by `train.py --checkpoint-dir` (any impl: the
names are the same), or from the config's seed (`--random-init`). Serving casts them once to
the compute dtype (bfloat16 on a GPU, float32 elsewhere); every variant starts from those:

- `stock`: the model from `nnx.Linear`.
- `epilog_fp8`: the model from jax-epilog's layers, its large kernels stored in FP8 once by
  `jax_epilog.quantize_params` (bias and GELU fused into the FP8 GEMMs, 16-bit results).
- `stock_fp8`: the stock model served in FP8 by one call, `jax_epilog.serve_fp8` (its code
  unchanged): the same projections as `epilog_fp8` stored in FP8 once and run the same served
  ways, each bias in its GEMM's epilog (GELU stays outside: the stock MLP applies it between
  its layers).
- `qwix_fp8`: Qwix's post-training quantization of the stock model, FP8 e4m3 weights
  (per channel) and activations (dynamic), on the same projections (QKV, attention output, MLP).
  Qwix is optional (`pip install qwix`): without it `--compare` skips this variant.
- `epilog_fp8@WAY`, `stock_fp8@WAY` (with `--compare`): the variant with every served layer
  run one way (`JAX_EPILOG_SERVING=WAY` while the variant is built, compiled and timed: `weight_only`,
  `xla_fp8`, `fp8_pallas` or `fp8`), so that two ways are compared in one process. A forced
  way applies to the prefill's rows too.

Prompts are `--prompt-len` bytes of the validation text for each of `--batch` sequences; the
prefill samples the first new token, and each of `--new-tokens` - 1 decode steps the next
(decode.py). Greedy by default, else `--temperature` and `--top-k` with `--seed`. Each
variant and batch size is compiled first (compile time), run once with a progress bar (its
text is printed), then timed (medians): time to first token (the prefill, its token on the
host), prefill and decode tokens/s. `--compare` runs all four (or `--variants`, stock among
them) and adds each one's speed over stock's and its quality against stock, teacher forced
on validation windows (each window one prefill into the variant's KV cache): the validation
loss and the agreement of the next-token argmax; it writes `gpt_generate.json` and
`gpt_generate.md` to `--out`. Off a GPU, FP8 is emulated in plain JAX (FP8 values converted
back to the compute dtype before each GEMM), so the FP8 variants run slower than stock there
and the speed ratios are reported as not applicable; the quality columns still compare.

The KV cache (`--kv-cache`) is the compute dtype, `bf16`, or `fp8` (float8_e4m3fn, a float32
scale per head vector; decode.py); `auto` gives `epilog_fp8` and `stock_fp8` the FP8 cache
and the others the compute dtype.

The experiment switches (timed repeats, the FP8 threshold and scales, the cache's layout and
read, decode steps per call, command buffers, `--profile`) are `generate_bench.py`'s, which
runs this script with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):  # run as a script: make `gpt` (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_epilog
from jax_epilog.float8.weights import MIN_FEATURES, key_names
from jax_epilog.planning import serving_plan

from gpt import compare, configs, data, decode, profile, train
from gpt.decode import CachedGPT, Generator, check_fits, init_cache
from gpt.model import GPT

VARIANTS = ("stock", "epilog_fp8", "stock_fp8", "qwix_fp8")
#: The variants served by jax-epilog's FP8 (which `--kv-cache auto` gives the FP8 cache).
FP8_SERVED = ("epilog_fp8", "stock_fp8")
#: `epilog_fp8@WAY`: `epilog_fp8` served one way (`forced_serving_way`).
FORCED_WAY = "@"
#: `--kv-cache`'s dtypes; "auto" is `cache_dtype`'s choice per variant.
KV_CACHES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
#: The projections Qwix quantizes, by module path under `CachedGPT`: those jax-epilog's FP8
#: would (the embeddings and the tied head stay 16-bit in both).
QWIX_PROJECTIONS = r"model/blocks/\d+/(attention/(qkv|out)|mlp/(layers/\d+|gate|up|down))"
#: What `--compare` prints for `qwix_fp8` where Qwix is not installed (an optional peer).
QWIX_MISSING = "skipped: Qwix is not installed (pip install qwix to add it)"


def qwix_installed() -> bool:
    return importlib.util.find_spec("qwix") is not None


# --- weights -----------------------------------------------------------------------------------

def restore_parameters(directory: Path) -> tuple[configs.TrainConfig, dict, int]:
    """(the training config, the parameters as a nested dict of host arrays, the step) of the
    latest checkpoint `train.py` wrote to `directory`. The whole saved state is read (which
    FP8 state a run saved is not in its metadata), and all but the parameters dropped."""
    import orbax.checkpoint as ocp
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint_dir: {directory} is not a directory")
    manager = train.checkpoint_manager(directory)
    step = manager.latest_step()
    if step is None:
        raise ValueError(f"checkpoint_dir: no checkpoint in {directory} (write one with "
                         "train.py --checkpoint-dir)")
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    saved = dict(meta["config"])
    config = configs.TrainConfig(model=configs.ModelConfig(**saved.pop("model")), **saved)
    state = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_on_the_host(directory / str(step) / "state"))))
    return config, state["state"]["params"], step


def _on_the_host(saved_state: Path):
    """A restore target that puts the saved state on the host's CPU device: restored to the
    GPU, the optimizer's moments would set the device's peak memory before any variant ran.
    None (restored where it was saved) where this orbax does not describe the state: its
    metadata API has changed across versions."""
    import orbax.checkpoint as ocp
    try:
        metadata = ocp.StandardCheckpointer().metadata(saved_state)
        tree = getattr(metadata, "item_metadata", metadata)
        tree = getattr(tree, "tree", tree)
        host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=host), tree)
    except Exception:  # noqa: BLE001 -- any failure: restore as saved, only the peak differs
        return None


def _lookup(tree: dict, names: tuple[str, ...]):
    for name in names:
        tree = tree[name]
    return tree["value"] if isinstance(tree, dict) else tree  # NNX saves a Variable's value


def _in_dtype(value, dtype):
    """`value` in `dtype` if it is a floating-point array (embeddings, kernels, norms)."""
    return value.astype(dtype) if jnp.issubdtype(value.dtype, jnp.floating) else value


def parameters_like(like: nnx.State, saved: dict, dtype) -> nnx.State:
    """`saved` (a checkpoint's nested dict) in the structure of `like` (a model's
    `nnx.State` of parameters), every shape checked, cast to `dtype` before it reaches the
    device."""
    def take(path, leaf):
        names = key_names(path)
        try:
            value = np.asarray(_lookup(saved, names))
        except KeyError:
            raise ValueError(f"checkpoint_dir: the checkpoint has no parameter "
                             f"{'/'.join(names)}") from None
        if value.shape != tuple(leaf.shape):
            raise ValueError(f"checkpoint_dir: parameter {'/'.join(names)} is "
                             f"{value.shape} there, the model's is {tuple(leaf.shape)}")
        return jnp.asarray(_in_dtype(value, dtype))
    return jax.tree_util.tree_map_with_path(take, like)


def serving_weights(config: configs.TrainConfig, saved: Optional[dict], dtype) -> nnx.State:
    """The parameters to serve, cast to the compute `dtype`: `saved`'s, or the config's seed's
    (`train.build_model`) where `saved` is None."""
    build = lambda: train.build_model(config, "stock")
    if saved is None:
        return jax.tree.map(lambda p: _in_dtype(p, dtype), nnx.state(build(), nnx.Param))
    # Only the shapes: initialising a large model would cost its bytes and time.
    return parameters_like(nnx.state(nnx.eval_shape(build), nnx.Param), saved, dtype)


# --- the variants ------------------------------------------------------------------------------

def model_with(config: configs.TrainConfig, impl: str, weights: nnx.State, dtype,
               attention: str = "auto") -> GPT:
    """The model for `impl` holding `weights`, built abstractly (no initialisation drawn)."""
    model = nnx.eval_shape(lambda: GPT(config.model, impl=impl, dtype=dtype,
                                       attention=attention, rngs=nnx.Rngs(0)))
    nnx.update(model, weights)
    abstract = [jax.tree_util.keystr(path) for path, leaf in
                jax.tree_util.tree_leaves_with_path(nnx.state(model))
                if isinstance(leaf, jax.ShapeDtypeStruct)]
    if abstract:
        raise ValueError(f"impl={impl!r}: state the weights do not cover: {abstract[:5]}")
    return model


def fp8_include(min_features: Optional[int]) -> Optional[Callable]:
    """`quantize_params`' rule: None (the package's default, both dims >= 512) or the blocks'
    kernels whose dims are both at least `min_features` (tests quantize `tiny`'s small layers
    so); an untied head stays 16-bit, as in `QWIX_PROJECTIONS`."""
    if min_features is None:
        return None

    def include(path, leaf) -> bool:
        names = key_names(path)
        return names[:1] == ("blocks",) and names[-1:] == ("kernel",) and \
            jnp.ndim(leaf) == 2 and min(jnp.shape(leaf)) >= min_features
    return include


def epilog_fp8(config: configs.TrainConfig, weights: nnx.State, dtype, *, attention: str,
               fp8_min_features: Optional[int] = None, calibration=None,
               weight_scales: str = "tensor") -> CachedGPT:
    """jax-epilog's layers with their kernels stored in FP8 once (`quantize_params`, one
    scale per kernel or per output channel: `weight_scales`), and static input scales from
    `calibration` (batches of tokens) where given."""
    model = model_with(config, "epilog", weights, dtype, attention)
    params = jax_epilog.quantize_params(nnx.state(model, nnx.Param),
                                        include=fp8_include(fp8_min_features),
                                        granularity=weight_scales)
    nnx.update(model, params)
    return CachedGPT(calibrated(model, calibration))


def stock_fp8(config: configs.TrainConfig, weights: nnx.State, dtype, *, attention: str,
              fp8_min_features: Optional[int] = None, calibration=None,
              weight_scales: str = "tensor") -> CachedGPT:
    """The stock model served in FP8 by one call, `jax_epilog.serve_fp8`, its code unchanged:
    the blocks' projections whose K and N are both at least `fp8_min_features` (None: the
    package's default, `MIN_FEATURES`), as `epilog_fp8` chooses them (the head stays
    16-bit); `weight_scales` and `calibration` as `epilog_fp8`'s."""
    rule = jax_epilog.ServeRule(r"blocks/\d+/.*", min_features=fp8_min_features or MIN_FEATURES)
    stock = model_with(config, "stock", weights, dtype, attention)
    served = jax_epilog.serve_fp8(stock, rules=rule, granularity=weight_scales)
    return CachedGPT(calibrated(served, calibration))


def calibrated(model: GPT, calibration) -> GPT:
    """`model` with static input scales from `calibration` (batches of tokens; None: as it
    is) on its `Fp8Weight`s (`jax_epilog.calibrate`)."""
    if calibration is None:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax_epilog.calibrate(
        lambda p, tokens: nnx.merge(graphdef, p, rest)(tokens), params, calibration)
    nnx.update(model, params)
    return model


def qwix_fp8(config: configs.TrainConfig, weights: nnx.State, dtype, *, attention: str,
             sample_tokens) -> CachedGPT:
    """Qwix's post-training quantization (the rule form of its README) of the stock model:
    FP8 e4m3 weights and activations on `QWIX_PROJECTIONS`. Qwix quantizes the weights on a
    first call, with `sample_tokens`."""
    try:
        import qwix
    except ImportError as error:
        raise RuntimeError(f"variant qwix_fp8: needs Qwix ({error}); pip install qwix") from None
    rules = [qwix.QuantizationRule(module_path=QWIX_PROJECTIONS, weight_qtype=jnp.float8_e4m3fn,
                                   act_qtype=jnp.float8_e4m3fn)]
    stock = CachedGPT(model_with(config, "stock", weights, dtype, attention))
    return qwix.quantize_model(stock, qwix.PtqProvider(rules), jnp.asarray(sample_tokens))


def build_variant(name: str, config: configs.TrainConfig, weights: nnx.State, dtype, *,
                  attention: str = "auto", sample_tokens=None,
                  fp8_min_features: Optional[int] = None, calibration=None,
                  weight_scales: str = "tensor") -> CachedGPT:
    if name == "stock":
        return CachedGPT(model_with(config, "stock", weights, dtype, attention))
    if name == "epilog_fp8":
        return epilog_fp8(config, weights, dtype, attention=attention,
                          fp8_min_features=fp8_min_features, calibration=calibration,
                          weight_scales=weight_scales)
    if name == "stock_fp8":
        return stock_fp8(config, weights, dtype, attention=attention,
                         fp8_min_features=fp8_min_features, calibration=calibration,
                         weight_scales=weight_scales)
    if name == "qwix_fp8":
        return qwix_fp8(config, weights, dtype, attention=attention, sample_tokens=sample_tokens)
    raise ValueError(f"variant: expected one of {VARIANTS}, got {name!r}")


def weight_bytes(cached: CachedGPT) -> int:
    """Bytes of every parameter leaf in memory (an FP8 kernel's data and scales)."""
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(nnx.state(cached)))


def fp8_kernels(cached: CachedGPT) -> int:
    """How many parameter leaves are stored in FP8 (jax-epilog's or Qwix's kernels)."""
    return sum(1 for leaf in jax.tree.leaves(nnx.state(cached))
               if jnp.dtype(leaf.dtype) in (jnp.dtype(jnp.float8_e4m3fn),
                                            jnp.dtype(jnp.float8_e5m2)))


# --- measurements ------------------------------------------------------------------------------

def prompts_from(text: np.ndarray, batch: int, prompt_len: int) -> np.ndarray:
    """`batch` windows of `prompt_len` bytes spread evenly over `text`, int32."""
    starts = np.linspace(0, len(text) - prompt_len - 1, batch).astype(np.int64)
    return data.windows(text, starts, prompt_len)[0]


def memory_in_use() -> dict[str, Optional[int]]:
    """The device's bytes in use and its peak so far (process-wide), where it reports them."""
    stats = jax.devices()[0].memory_stats() or {}
    return {"bytes_in_use": stats.get("bytes_in_use"),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def longest_decode_call(compiled: dict):
    """The compiled decode call of the most steps in `Generator.compile`'s programs (the one
    a generation mostly runs), or None where there is none (one new token)."""
    calls = compiled["decode"]
    return calls[max(calls)] if calls else None


def measure(generator: Generator, prompts: np.ndarray, new_tokens: int, key, *,
            repeats: int, progress: bool) -> dict[str, Any]:
    """Compile, one run with a progress bar (its tokens kept), then `repeats` timed runs."""
    batch, prompt_len = prompts.shape
    start = time.perf_counter()
    compiled = generator.compile(batch, prompt_len, new_tokens, key)
    compile_s = time.perf_counter() - start
    first = generator.generate(prompts, new_tokens, key, compiled=compiled, progress=progress)
    runs = [generator.generate(prompts, new_tokens, key, compiled=compiled)
            for _ in range(repeats)]
    prefill_s = statistics.median(r.prefill_s for r in runs)
    decode_s = statistics.median(r.decode_s for r in runs)
    decode_steps = new_tokens - 1
    full_call = longest_decode_call(compiled)
    cache = jax.eval_shape(lambda: generator.new_cache(batch, prompt_len + new_tokens))
    return {
        "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "compile_s": compile_s, "repeats": repeats, "kv_cache_bytes": cache.nbytes,
        "time_to_first_token_s": prefill_s,
        "prefill_tokens_per_s": batch * prompt_len / prefill_s,
        "decode_step_s": decode_s / decode_steps if decode_steps else None,
        "decode_tokens_per_s": batch * decode_steps / decode_s if decode_steps else None,
        "fp8_gemms_decode": None if full_call is None else
        compare.fp8_gemms(full_call.as_text() or ""),
        # This variant's own: the compiled decode step's arguments (weights, cache), outputs
        # and temporaries, less the donated cache. The device's figures are process-wide.
        "decode_step_memory": compare.timing.memory_analysis(full_call),
        "memory": memory_in_use(), "tokens": first.tokens,
    }


#: How many sequences of each batch a record keeps as text (`samples`).
SAMPLES = 4
#: Decode steps `--profile` traces per variant and batch size (after one untraced).
PROFILE_STEPS = 5
#: How many of the longest kernels of each kind a decode step's profile lists.
DECODE_TOP_KERNELS = {"gemm": 6, "attention": 4, "cache": 4, "quantize": 4, "other": 8}


def decode_kind(kernel, line: str) -> str:
    """A decode step's kinds: by the named scope of the launching HLO instruction (the
    library's "kv_cache" writes, "cached_attention", whose dots are GEMM kernels, and
    "fp8_input", a served GEMM's input quantized), then GEMMs by kernel name, then the rest
    (norms, activations, sampling)."""
    scope = re.search(r'op_name="([^"]*)"', line)
    scope = scope.group(1) if scope else ""
    if "/kv_cache/" in scope:
        return "cache"
    if "/cached_attention/" in scope:
        return "attention"
    if "/fp8_input/" in scope:
        return "quantize"
    return "gemm" if profile.gpu_trace.GEMM_KERNEL.search(kernel.name) else "other"


def profile_decode(generator: Generator, prompts: np.ndarray, new_tokens: int,
                   key, folder: Path) -> dict[str, Any]:
    """The GPU kernels of up to `PROFILE_STEPS` decode steps traced into `folder`, per step
    by kind (`decode_kind`), after a prefill and one untraced decode step; then, under
    "prefill", those of `PROFILE_STEPS` prefills (each into a fresh cache), per prefill. On
    a GPU both programs are compiled again without command buffers for it."""
    steps = min(PROFILE_STEPS, new_tokens - 1)
    if steps < 1:
        return {"note": "no decode step to trace (--new-tokens 1)"}
    batch, prompt_len = prompts.shape
    # the traced calls' step counts, and one step first
    counts = sorted({1, *generator.decode_counts(steps + 1)})
    calls, command_buffers = None, "on"
    if jax.default_backend() == "gpu":
        # Compiled without XLA's command buffers (CUDA graphs), which would name every kernel
        # after the graph: the trace then tells which op launched each.
        try:
            calls = generator.compile(batch, prompt_len, new_tokens, key, counts=counts,
                                      options=decode.NO_COMMAND_BUFFERS)
            command_buffers = "off"
        except Exception as error:  # noqa: BLE001 -- profiled as timed, and said so
            print(f"  profile: command buffers stay on ({type(error).__name__}: {error})")
    if calls is None:
        calls = generator.compile(batch, prompt_len, new_tokens, key, counts=counts)
    cache = generator.new_cache(batch, prompt_len + new_tokens)
    token, cache = generator.prefill(cache, prompts, key, calls["prefill"])
    out, cache = generator.decode(cache, token, prompt_len, 1, key, calls["decode"])
    token = jax.block_until_ready(out[0])
    with jax.profiler.trace(str(folder / "decode")):
        for position in range(prompt_len + 1, prompt_len + 1 + steps, generator.steps_per_call):
            count = min(generator.steps_per_call, prompt_len + 1 + steps - position)
            out, cache = generator.decode(cache, token, position, count, key, calls["decode"])
            token = out[count - 1]
        jax.block_until_ready(token)
    del cache
    caches = [jax.block_until_ready(generator.new_cache(batch, prompt_len + new_tokens))
              for _ in range(PROFILE_STEPS)]
    prompts = jax.block_until_ready(jnp.asarray(prompts, jnp.int32))
    host = prefill_host_times(generator, caches, prompts, key, calls["prefill"])
    caches = [jax.block_until_ready(generator.new_cache(batch, prompt_len + new_tokens))
              for _ in range(PROFILE_STEPS)]
    with jax.profiler.trace(str(folder / "prefill")):
        while caches:  # each prefill donates its cache
            token, _ = generator.prefill(caches.pop(), prompts, key, calls["prefill"])
        jax.block_until_ready(token)
    traced = {}
    programs = {"prefill": calls["prefill"], "decode": longest_decode_call(calls)}
    for name, count in (("decode", steps), ("prefill", PROFILE_STEPS)):
        trace = profile.gpu_trace.latest_trace(folder / name)
        kernels = next(iter(profile.gpu_trace.gpu_kernels(trace).values()), []) if trace else []
        traced[name] = {"trace": str(trace) if trace else None,
                        **profile.breakdown(kernels, count, programs[name].as_text() or "",
                                            decode_kind, DECODE_TOP_KERNELS)}
    events = profile.gpu_trace.host_events(Path(traced["prefill"]["trace"]), PREFILL_HOST_EVENTS) \
        if traced["prefill"]["trace"] else []
    host["events"] = [{"name": e["name"], "calls": e["count"] / PROFILE_STEPS,
                       "ms": e["total_ns"] / PROFILE_STEPS / 1e6} for e in events]
    return {"steps": steps, "command_buffers": command_buffers, **traced["decode"],
            "prefill": {"prefills": PROFILE_STEPS, **traced["prefill"], "host": host}}


#: How many of the host's longest events a prefill's profile lists.
PREFILL_HOST_EVENTS = 25


def prefill_host_times(generator: Generator, caches: list, prompts, key, call) -> dict:
    """Untraced prefills (one per cache in `caches`, each donated), per prefill in ms: how
    long the call takes to return (the host's dispatch: flattening the weights, launching the
    program) and how long until its tokens are ready; medians. A prefill whose dispatch takes
    about as long as the whole is host-bound."""
    dispatch, whole = [], []
    while caches:
        start = time.perf_counter()
        token, _ = generator.prefill(caches.pop(), prompts, key, call)
        dispatch.append(time.perf_counter() - start)
        jax.block_until_ready(token)
        whole.append(time.perf_counter() - start)
    return {"dispatch_ms": statistics.median(dispatch) * 1e3,
            "whole_ms": statistics.median(whole) * 1e3}


def teacher_forced(cached: CachedGPT, batches, cache_dtype) -> tuple[float, list[np.ndarray]]:
    """(the mean validation loss, each batch's next-token argmax) of the served path: each
    batch one prefill into an empty KV cache in `cache_dtype`. A prefill attends to the
    cache as a decode step does, so an FP8 cache's rounding is in the figures."""
    graphdef, state = nnx.split(cached)
    config = cached.model.config
    logits_of = jax.jit(lambda s, tokens: nnx.merge(graphdef, s)(
        tokens, init_cache(config, *tokens.shape, cache_dtype), 0)[0])
    losses, predictions = [], []
    for inputs, targets in batches:
        logits = logits_of(state, jnp.asarray(inputs))
        losses.append(float(train.cross_entropy(logits, jnp.asarray(targets))))
        predictions.append(np.asarray(jnp.argmax(logits, axis=-1)))
    return float(np.mean(losses)), predictions


def text_of(tokens: np.ndarray) -> str:
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode("utf-8", errors="replace")


# --- the run -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Settings:
    """What to generate and how to measure it: the command line's options, and the
    experiment switches (`EXPERIMENT_SETTINGS`), which only generate_bench.py's command
    line sets."""

    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int
    temperature: float = 0.0
    top_k: Optional[int] = None
    seed: int = 0
    repeats: int = 3
    eval_batches: int = 4
    attention: str = "auto"
    fp8_min_features: Optional[int] = None
    static_scales: bool = False
    progress: bool = True
    kv_cache: str = "auto"
    profile: Optional[str] = None  # a folder for the decode steps' traces
    steps_per_call: int = 16
    fp8_attention: str = "auto"  # Generator's fp8_read ("auto": the library's rule)
    fp8_cache_layout: str = "auto"  # Generator's cache_layout
    prefill_command_buffers: bool = False  # decode.Generator's
    weight_scales: str = "tensor"  # epilog_fp8's: quantize_params' granularity


#: The `Settings` fields generate.py's own command line leaves at their defaults: the
#: experiment switches, which generate_bench.py's parser adds under these names.
EXPERIMENT_SETTINGS = ("repeats", "eval_batches", "attention", "fp8_min_features",
                       "static_scales", "profile", "steps_per_call", "fp8_attention",
                       "fp8_cache_layout", "prefill_command_buffers", "weight_scales")


def variant_parts(name: str) -> tuple[str, Optional[str]]:
    """("epilog_fp8", "xla_fp8") for "epilog_fp8@xla_fp8"; (name, None) without a way."""
    base, _, way = name.partition(FORCED_WAY)
    return base, (way or None)


#: `JAX_EPILOG_SERVING=way` while a variant is built, traced and timed (None: the default ways).
forced_serving_way = jax_epilog.config.forced_serving_way


def fp8_cache_overrides(settings: Settings) -> dict[str, Optional[str]]:
    """The Generator's `fp8_read` and `cache_layout` from the settings ("auto": None)."""
    auto = lambda choice: None if choice == "auto" else choice
    return {"fp8_read": auto(settings.fp8_attention),
            "cache_layout": auto(settings.fp8_cache_layout)}


def _rule(choice: str) -> str:
    return "as jax_epilog's rule chose" if choice == "auto" else choice


def cache_dtype(name: str, choice: str, dtype):
    """The KV cache's dtype for variant `name` under `--kv-cache` `choice`: "auto" is FP8 for
    `FP8_SERVED` (FP8 serving end to end) and the compute `dtype` for the others."""
    if choice == "auto":
        return KV_CACHES["fp8"] if name in FP8_SERVED else dtype
    if choice not in KV_CACHES:
        raise ValueError(f"kv_cache: expected 'auto' or one of {tuple(KV_CACHES)}, got "
                         f"{choice!r}")
    return KV_CACHES[choice]


def serve_variant(name: str, config: configs.TrainConfig, weights: nnx.State, dtype,
                  corpus: data.Corpus, settings: Settings, validation) -> dict[str, Any]:
    """(the record of one variant: built, generating and timed at every batch size, its
    validation loss; each validation batch's next-token argmax)."""
    base, way = variant_parts(name)
    with forced_serving_way(way):
        return _serve_variant(name, base, config, weights, dtype, corpus, settings, validation)


def _serve_variant(name: str, base: str, config: configs.TrainConfig, weights: nnx.State,
                   dtype, corpus: data.Corpus, settings: Settings, validation):
    start = time.perf_counter()
    # Qwix quantizes the weights on a first call: a validation window, or a prompt's bytes.
    sample_tokens = validation[0][0][:1] if validation else \
        prompts_from(corpus.validation, 1, settings.prompt_len)
    calibration = [jnp.asarray(inputs) for inputs, _ in validation] \
        if settings.static_scales and base in FP8_SERVED else None
    cached = build_variant(base, config, weights, dtype, attention=settings.attention,
                           sample_tokens=sample_tokens,
                           fp8_min_features=settings.fp8_min_features, calibration=calibration,
                           weight_scales=settings.weight_scales)
    record = {"build_s": time.perf_counter() - start, "weight_bytes": weight_bytes(cached),
              "fp8_kernels": fp8_kernels(cached), "by_batch": {}}
    print(f"{name}: built in {record['build_s']:.1f} s, weights "
          f"{record['weight_bytes'] / 2**20:,.1f} MiB, {record['fp8_kernels']} kernels in FP8",
          flush=True)
    if name != "stock" and not record["fp8_kernels"]:
        print(f"{name}: no kernel is stored in FP8 (quantize_params' default rule wants both "
              "dims >= 512; generate_bench.py --fp8-min-features lowers it)", flush=True)
    generator = Generator(cached, temperature=settings.temperature, top_k=settings.top_k,
                          cache_dtype=cache_dtype(base, settings.kv_cache, dtype),
                          steps_per_call=settings.steps_per_call,
                          prefill_command_buffers=settings.prefill_command_buffers,
                          **fp8_cache_overrides(settings))
    record["kv_cache"] = generator.cache_dtype.name
    key = jax.random.key(settings.seed)
    for batch in settings.batches:
        prompts = prompts_from(corpus.validation, batch, settings.prompt_len)
        measured = measure(generator, prompts, settings.new_tokens, key,
                           repeats=settings.repeats, progress=settings.progress)
        tokens = measured.pop("tokens")
        if settings.profile is not None:
            measured["profile"] = profile_decode(
                generator, prompts, settings.new_tokens, key,
                Path(settings.profile) / f"{name}_batch{batch}")
        measured["sample"] = {"prompt": text_of(prompts[0]), "generated": text_of(tokens[0])}
        measured["samples"] = [{"prompt": text_of(p), "generated": text_of(t)}
                               for p, t in zip(prompts[:SAMPLES], tokens[:SAMPLES])]
        record["by_batch"][str(batch)] = measured
        print_measurement(name, measured)
    record["validation_loss"], predictions = teacher_forced(
        cached, validation, generator.cache_dtype) if validation else (None, None)
    return record, predictions


def print_measurement(name: str, m: dict) -> None:
    memory = m["memory"]
    peak = (f"{memory['peak_bytes_in_use'] / 2**20:,.0f} MiB peak so far"
            if memory["peak_bytes_in_use"] is not None else "peak memory not reported")
    decoded = (f"decode {m['decode_tokens_per_s']:,.0f} tokens/s" if m["decode_tokens_per_s"]
               else "no decode step")
    print(f"{name} batch {m['batch']}: prefill {m['prefill_tokens_per_s']:,.0f} tokens/s, "
          f"{decoded}, time to first token {m['time_to_first_token_s'] * 1e3:.1f} ms, "
          f"compile {m['compile_s']:.1f} s, KV cache {_mib(m['kv_cache_bytes'])} MiB, {peak}",
          flush=True)
    if "profile" in m:
        print(f"  decode step profile: {_profile_cells(m['profile'])}", flush=True)
        if "prefill" in m["profile"]:
            print(f"  prefill profile: {_profile_cells(m['profile']['prefill'])}", flush=True)
    print(f"  {m['sample']['prompt'][-60:]!r} -> {m['sample']['generated'][:120]!r}", flush=True)


def add_quality(records: dict[str, dict], predictions: dict[str, list]) -> None:
    """Each variant's validation loss relative to stock's and the share of positions where
    its next-token argmax is stock's (teacher forced, the same windows)."""
    if "stock" not in records or records["stock"]["validation_loss"] is None:
        return  # no quality pass (--eval-batches 0)
    for name, record in records.items():
        record["validation_loss_vs_stock"] = \
            record["validation_loss"] / records["stock"]["validation_loss"] - 1
        record["top1_agreement_with_stock"] = float(np.mean([
            np.mean(ours == theirs)
            for ours, theirs in zip(predictions[name], predictions["stock"])]))


def compare_variants(names, config, weights, dtype, corpus, settings) -> dict[str, Any]:
    """Every variant in `names`, one after another in this process (one failing is recorded
    and the others go on, as in compare.py)."""
    validation = data.validation_batches(corpus.validation, config.batch_size,
                                         config.model.seq_len, settings.eval_batches)
    records, predictions, failed, skipped = {}, {}, {}, {}
    for name in names:
        if variant_parts(name)[0] == "qwix_fp8" and not qwix_installed():
            skipped[name] = QWIX_MISSING
            print(f"{name}: {QWIX_MISSING}", flush=True)
            continue
        try:
            records[name], predictions[name] = serve_variant(
                name, config, weights, dtype, corpus, settings, validation)
        except Exception as error:  # noqa: BLE001 -- recorded; the other variants still run
            failed[name] = compare._failure("generate", name, "serving", error)
    add_quality(records, predictions)
    note = speed_ratio_note(jax.default_backend())
    add_speed_ratios(records, note)
    print_speed_ratios(records, note)
    return {"variants": records, "failed": failed, "skipped": skipped,
            "speed_ratio_note": note}


def speed_ratio_note(platform: str) -> Optional[str]:
    """None on a GPU; elsewhere why a variant's speed over stock's is not reported: FP8 is
    emulated there (FP8 weights and KV cache converted back to the compute dtype before each
    GEMM), so the FP8 variants' ratios would measure the emulation, not FP8."""
    return None if platform == "gpu" else f"n/a ({platform.upper()}: FP8 emulated)"


def fp8_emulated_warning(platform: str) -> Optional[str]:
    """The line a run off a GPU prints first (None on a GPU)."""
    if platform == "gpu":
        return None
    return (f"Not a GPU ({platform}): FP8 is emulated in plain JAX here (FP8 weights and "
            "the FP8 KV cache are converted back to the compute dtype before each GEMM), so "
            "the FP8 variants' speeds measure the emulation (slower than stock), not FP8: "
            "their speed ratios are reported as n/a, and the quality columns compare.")


def add_speed_ratios(records: dict[str, dict], note: Optional[str]) -> None:
    """Each variant's prefill and decode tokens/s over stock's at the same batch size
    (`prefill_vs_stock`, `decode_vs_stock`), or None where `note` says they do not apply."""
    stock = records.get("stock", {"by_batch": {}})["by_batch"]
    for record in records.values():
        for batch, m in record["by_batch"].items():
            for what in ("prefill", "decode"):
                ours = m[f"{what}_tokens_per_s"]
                theirs = stock.get(batch, {}).get(f"{what}_tokens_per_s")
                m[f"{what}_vs_stock"] = ours / theirs if ours and theirs and note is None \
                    else None


def _ratio_cell(value: Optional[float], note: Optional[str]) -> str:
    return note if note is not None else _number(value, ".2f") + ("x" if value else "")


def print_speed_ratios(records: dict[str, dict], note: Optional[str]) -> None:
    for name, record in records.items():
        if name == "stock":
            continue
        for batch, m in record["by_batch"].items():
            print(f"{name} batch {batch} vs stock: prefill "
                  f"{_ratio_cell(m['prefill_vs_stock'], note)}, decode "
                  f"{_ratio_cell(m['decode_vs_stock'], note)}", flush=True)


def _sampling(settings: dict) -> str:
    if not settings["temperature"]:
        return "greedy"
    top_k = f", top-k {settings['top_k']}" if settings["top_k"] else ""
    return f"sampled at temperature {settings['temperature']}{top_k}, seed {settings['seed']}"


def _row(*cells) -> str:
    """A Markdown table row."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def _mib(value: Optional[int]) -> str:
    return f"{value / 2**20:,.1f}" if value is not None else "n/a"


def _number(value: Optional[float], spec: str = ",.0f") -> str:
    return format(value, spec) if value is not None else "n/a"


def render(report: dict) -> str:
    meta, result = report["metadata"], report["result"]
    model = report["config"]["model"]
    s = report["settings"]
    lines = ["# GPT serving: stock, jax-epilog FP8 and Qwix FP8", "",
             f"{meta['date']}, {meta['device']} ({meta['platform']}), jax {meta['jax']}, "
             f"flax {report['versions']['flax']}, qwix {report['versions'].get('qwix')}. "
             f"Weights: {report['weights']}; compute dtype {report['dtype']}. "
             f"d_model {model['d_model']}, {model['n_layers']} layers, {model['n_heads']} "
             f"heads. Prompts of {s['prompt_len']} validation bytes, {s['new_tokens']} new "
             f"tokens ({_sampling(s)}), {s.get('steps_per_call', 1)} decode steps per call; "
             f"an FP8 KV cache {_rule(s.get('fp8_cache_layout', 'positions_major'))}, read by "
             f"{_rule(s.get('fp8_attention', 'reduce'))}; the prefill compiled "
             f"{'with' if s.get('prefill_command_buffers', True) else 'without'} command "
             f"buffers; epilog_fp8's weights scaled per "
             f"{'output channel' if s.get('weight_scales') == 'channel' else 'tensor'}, its "
             f"input scales "
             f"{'static (calibrated)' if s['static_scales'] else 'from each call (current)'}; "
             f"medians of {s['repeats']} runs after a warm-up. Method: "
             "examples/gpt/generate.py's docstring.", ""]
    warning = fp8_emulated_warning(meta["platform"])
    if warning and set(result["variants"]) - {"stock"}:
        lines += [warning + " No GEMM reads FP8 operands (the FP8 GEMMs column).", ""]
    note = result.get("speed_ratio_note")
    lines += [_row("variant", "batch", "prefill tokens/s", "decode tokens/s",
                   "prefill vs stock", "decode vs stock",
                   "time to first token ms", "compile s", "FP8 GEMMs (decode step)",
                   "KV cache, MiB", "decode step MiB", "device peak MiB so far"),
              _row(*["---"] * 12)]
    for name, r in result["variants"].items():
        lines += [_row(name, batch, _number(m["prefill_tokens_per_s"]),
                       _number(m["decode_tokens_per_s"]),
                       _ratio_cell(m.get("prefill_vs_stock"), note),
                       _ratio_cell(m.get("decode_vs_stock"), note),
                       f"{m['time_to_first_token_s'] * 1e3:.1f}", f"{m['compile_s']:.1f}",
                       _number(m["fp8_gemms_decode"], "d"),
                       f"{r['kv_cache']}, {_mib(m['kv_cache_bytes'])}",
                       _mib((m["decode_step_memory"] or {}).get("peak_bytes")),
                       _mib(m["memory"]["peak_bytes_in_use"]))
                  for batch, m in r["by_batch"].items()]
    lines += [_row(name, f"failed: {error}", *[""] * 10)
              for name, error in result["failed"].items()]
    lines += [_row(name, why, *[""] * 10) for name, why in result.get("skipped", {}).items()]
    lines += ["", _row("variant", "weights MiB", "validation loss", "vs stock",
                       "top-1 agreement with stock"), _row(*["---"] * 5)]
    lines += [_row(name, _mib(r["weight_bytes"]), _number(r["validation_loss"], ".4f"),
                   _number(r.get("validation_loss_vs_stock"), "+.2%"),
                   _number(r.get("top1_agreement_with_stock"), ".2%"))
              for name, r in result["variants"].items()]
    lines += _profile_section(result["variants"], s["profile"])
    lines += ["", "Samples (the first sequence of the first `--batch`: the prompt's last 80 "
              "bytes, then the generated ones):", ""]
    for name, r in result["variants"].items():
        sample = next(iter(r["by_batch"].values()))["sample"]
        lines += [f"- {name}: `{sample['prompt'][-80:]!r}` → `{sample['generated']!r}`"]
    return "\n".join(lines) + "\n"


def _profile_cells(p: dict) -> str:
    """A decode step's (or a prefill's) kernel time by kind, ms, or why there is none."""
    if "kernel_ms" not in p:
        return p["note"]
    return (f"{p['kernel_ms']:.3f} ms of kernels: GEMM {p['gemm_ms']:.3f}, attention "
            f"{p['attention_ms']:.3f}, cache writes {p['cache_ms']:.3f}, input quantization "
            f"{p['quantize_ms']:.3f}, other "
            f"{p['other_ms']:.3f}, {p['kernels_per_step']:.0f} kernels")


def _profile_section(variants: dict, folder: Optional[str]) -> list[str]:
    """`--profile`'s tables (a decode step's and a prefill's GPU kernel time by kind) and, per
    variant at its largest batch, the longest kernels of each."""
    if folder is None:
        return []
    lines = []
    for what, count in (("decode step", f"up to {PROFILE_STEPS} traced steps"),
                        ("prefill", f"{PROFILE_STEPS} traced prefills")):
        lines += ["", f"Where a {what}'s time goes: GPU kernel time per {what} of {count} "
                  f"(`--profile`, traces in `{folder}`), by kind (`decode_kind` in "
                  "generate.py); on a GPU the traced programs are compiled without XLA's "
                  "command buffers, so each kernel is named after its op.", "",
                  _row("variant", "batch", "KV cache", "kernels ms", "GEMM ms", "attention ms",
                       "cache writes ms", "input quantization ms", "other ms", "kernels"),
                  _row(*["---"] * 10)]
        for name, r in variants.items():
            for batch, m in r["by_batch"].items():
                p = _profiled(m["profile"], what)
                cells = [p["note"], *[""] * 6] if "kernel_ms" not in p else [
                    f"{p[key]:.3f}" for key in ("kernel_ms", "gemm_ms", "attention_ms",
                                                "cache_ms", "quantize_ms", "other_ms")] + \
                    [f"{p['kernels_per_step']:.0f}"]
                lines.append(_row(name, batch, r["kv_cache"], *cells))
        for name, r in variants.items():
            batch, m = list(r["by_batch"].items())[-1]
            p = _profiled(m["profile"], what)
            if p.get("top"):
                lines += ["", f"{name}, batch {batch}: the longest kernels of a {what}", "",
                          _row("kind", "op", "calls", f"ms per {what}", "what"),
                          _row(*["---"] * 5)]
                lines += [_row(t["kind"], f"`{t['op']}`", f"{t['calls_per_step']:.0f}",
                               f"{t['ms_per_step']:.3f}", t["what"]) for t in p["top"]]
    return lines + _prefill_host_section(variants)


def _prefill_host_section(variants: dict) -> list[str]:
    """The prefill's host side (`prefill_host_times`), per variant and batch, and the host's
    longest events of each variant's traced prefills at its first batch."""
    rows = [(name, batch, m["profile"]["prefill"]["host"]) for name, r in variants.items()
            for batch, m in r["by_batch"].items()
            if "host" in m["profile"].get("prefill", {})]
    if not rows:
        return []
    lines = ["", "A prefill's host side (untraced, medians of "
             f"{PROFILE_STEPS}): the time until the call returns (dispatch) and until its "
             "tokens are ready.", "", _row("variant", "batch", "dispatch ms", "whole ms"),
             _row(*["---"] * 4)]
    lines += [_row(name, batch, f"{h['dispatch_ms']:.3f}", f"{h['whole_ms']:.3f}")
              for name, batch, h in rows]
    for name, r in variants.items():
        batch, m = next(iter(r["by_batch"].items()))
        events = m["profile"].get("prefill", {}).get("host", {}).get("events")
        if events:
            lines += ["", f"{name}, batch {batch}: the host's longest events of a traced "
                      "prefill (off the Python line)", "", _row("event", "calls", "ms"),
                      _row(*["---"] * 3)]
            lines += [_row(f"`{e['name']}`", f"{e['calls']:.1f}", f"{e['ms']:.3f}")
                      for e in events]
    return lines


def _profiled(p: dict, what: str) -> dict:
    """The decode step's profile `p`, or its prefill's (a note where there is none)."""
    if what == "decode step":
        return p
    return p.get("prefill", {"note": p.get("note", "not traced")})


def versions() -> dict[str, Any]:
    found = train.versions()
    try:
        found["qwix"] = metadata.version("qwix")
    except metadata.PackageNotFoundError:
        found["qwix"] = None
    return found


#: The hint `generate.py` adds to an option it does not know.
BENCH_HINT = ("the experiment switches, e.g. --repeats, --fp8-min-features or --profile, are "
              "examples/gpt/generate_bench.py's: see its --help")


def build_parser() -> argparse.ArgumentParser:
    """The user's options: the weights, the variants, the batch sizes, the prompt and the
    sampling, the KV cache's dtype, the report. generate_bench.py adds the experiment
    switches to it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Experiment switches (repeats, FP8 thresholds "
                                            "and scales, cache layouts, --profile): "
                                            "examples/gpt/generate_bench.py --help.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint-dir", type=Path,
                        help="a directory train.py --checkpoint-dir wrote (its latest step)")
    source.add_argument("--random-init", action="store_true",
                        help="no checkpoint: the config's seed's weights (smoke tests)")
    parser.add_argument("--config", default="tiny", choices=tuple(configs.CONFIGS),
                        help="with --random-init (a checkpoint carries its own)")
    parser.add_argument("--variant", default="stock", choices=VARIANTS)
    parser.add_argument("--compare", action="store_true",
                        help="every variant in one process, with speed and quality against "
                             "stock")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="with --compare: comma-separated, stock among them; "
                             "epilog_fp8@WAY serves epilog_fp8 one way (xla_fp8, ...), "
                             "stock_fp8@WAY likewise")
    parser.add_argument("--batch", type=int, nargs="+", default=[1],
                        help="batch sizes (each compiled and timed)")
    parser.add_argument("--prompt-len", type=int,
                        help="prompt bytes (default: half the model's seq_len, at most 128)")
    parser.add_argument("--new-tokens", type=int,
                        help="tokens to generate (default: what fits, at most 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument("--kv-cache", default="auto", choices=("auto", *KV_CACHES),
                        help="the KV cache's dtype: auto is fp8 for epilog_fp8 and "
                             "stock_fp8, the compute dtype for the others")
    parser.add_argument("--out", type=Path, help="folder for gpt_generate.json and .md")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv=None, parser: Optional[argparse.ArgumentParser] = None
               ) -> argparse.Namespace:
    """`argv` by `parser` (default `build_parser()`'s); an unknown option is the parser's
    error, naming generate_bench.py where the experiment switches are."""
    parser = parser or build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} ({BENCH_HINT})")
    for name, least in (("batch", 1), ("repeats", 1), ("eval_batches", 0),
                        ("steps_per_call", 1)):
        values = getattr(args, name, [1])
        if any(value < least for value in (values if isinstance(values, list) else [values])):
            parser.error(f"--{name.replace('_', '-')}: expected values >= {least}, got {values}")
    if getattr(args, "static_scales", False) and args.eval_batches == 0:
        parser.error("--static-scales calibrates on the validation batches: give "
                     "--eval-batches 1 or more")
    args.parser = parser
    return args


def settings_for(args: argparse.Namespace, config: configs.TrainConfig) -> Settings:
    """`args` as `Settings`, the defaults fitted to the model's `seq_len`; a prompt and new
    tokens that do not fit are the parser's error. The experiment switches are `args`' where
    its parser has them (generate_bench.py's), else `Settings`' defaults."""
    seq_len = config.model.seq_len
    prompt_len = args.prompt_len if args.prompt_len is not None else min(128, seq_len // 2)
    new_tokens = args.new_tokens if args.new_tokens is not None else \
        min(256, seq_len - prompt_len)
    try:
        check_fits(config.model, prompt_len, new_tokens)
    except ValueError as error:
        args.parser.error(f"--prompt-len/--new-tokens: {error}")
    experiments = {name: getattr(args, name) for name in EXPERIMENT_SETTINGS
                   if hasattr(args, name)}
    return Settings(tuple(args.batch), prompt_len, new_tokens, args.temperature, args.top_k,
                    args.seed, progress=not args.no_progress, kv_cache=args.kv_cache,
                    **experiments)


def main(argv=None, parser: Optional[argparse.ArgumentParser] = None) -> dict[str, Any]:
    """Run the command line `argv` (`parser`: generate_bench.py passes its own)."""
    args = parse_args(argv, parser)
    if args.checkpoint_dir is not None:
        try:
            config, saved, step = restore_parameters(args.checkpoint_dir)
        except ValueError as error:
            args.parser.error(f"--{error}".replace("checkpoint_dir", "checkpoint-dir", 1))
        weights_from = f"{args.checkpoint_dir} step {step}"
    else:
        config, saved, weights_from = configs.get(args.config), None, \
            f"random ({args.config}, seed {configs.get(args.config).seed})"
    settings = settings_for(args, config)
    names = compared_variants(args) if args.compare else (args.variant,)
    if not args.compare and args.variant == "qwix_fp8" and not qwix_installed():
        args.parser.error(f"--variant qwix_fp8: {QWIX_MISSING}")
    warning = fp8_emulated_warning(jax.default_backend())
    if warning and set(names) != {"stock"}:
        print(warning, flush=True)
    dtype = train.compute_dtype(getattr(args, "dtype", "auto"))
    corpus = data.load_corpus()
    weights = serving_weights(config, saved, dtype)
    del saved  # the checkpoint's float32 copy: not held while the variants run
    result = compare_variants(names, config, weights, dtype, corpus, settings) \
        if args.compare else single_variant(args.variant, config, weights, dtype, corpus,
                                            settings)
    report = {"benchmark": "gpt_generate", "metadata": compare.timing.run_metadata(),
              "versions": versions(), "dtype": jnp.dtype(dtype).name, "weights": weights_from,
              "config": dataclasses.asdict(config), "settings": dataclasses.asdict(settings),
              "result": result}
    if args.out is not None:
        compare.timing.write_report(report, args.out, "gpt_generate", render)
    return report


def compared_variants(args: argparse.Namespace) -> tuple[str, ...]:
    """`--variants` as names (stock first: the quality columns compare against it)."""
    names = tuple(name.strip() for name in args.variants.split(",") if name.strip())
    ways = serving_plan.WAYS
    known = set(VARIANTS) | {f"{base}{FORCED_WAY}{way}" for base in FP8_SERVED for way in ways}
    if not set(names) <= known or "stock" not in names:
        args.parser.error(f"--variants: expected names among {', '.join(VARIANTS)} (or "
                          f"epilog_fp8{FORCED_WAY}WAY or stock_fp8{FORCED_WAY}WAY, WAY one of "
                          f"{', '.join(ways)}) with "
                          f"stock among them, got {args.variants!r}")
    return ("stock",) + tuple(dict.fromkeys(name for name in names if name != "stock"))


def single_variant(name, config, weights, dtype, corpus, settings) -> dict[str, Any]:
    """One variant, its errors raised (no quality against stock)."""
    validation = data.validation_batches(corpus.validation, config.batch_size,
                                         config.model.seq_len, settings.eval_batches)
    record, _ = serve_variant(name, config, weights, dtype, corpus, settings, validation)
    print(f"{name}: validation loss {_number(record['validation_loss'], '.4f')}")
    return {"variants": {name: record}, "failed": {}, "skipped": {},
            "speed_ratio_note": speed_ratio_note(jax.default_backend())}


if __name__ == "__main__":
    main()
