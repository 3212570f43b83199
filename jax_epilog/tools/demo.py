"""`python -m jax_epilog`: train the fused MLP on scikit-learn's digits, then compare it with
the plain-JAX model.

Part 1 trains `jax_epilog.nnx.MLP` on the 8x8 digits that ship with scikit-learn (no download)
on whatever device JAX sees, and reports the test accuracy. Part 2 measures one training step
(`value_and_grad` + Adam) of the fused model and of the same network built from stock
`nnx.Linear` layers: time per step and the compiled step's temporary memory. On a GPU with the
cuBLASLt library that is the fused kernels against XLA; elsewhere both run the same plain JAX,
so their ratio only shows that the reference lowering costs nothing extra, within the spread
of repeated timings that is printed beside it.

Needs the demo extra: `pip install ".[demo]"` in a checkout (`pip install "jax-epilog[demo]"`
from a package index). The command line is `jax_epilog.demo_cli`'s.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.runtime.library import install_hint as _install_hint
from jax_epilog.runtime import targets

try:
    import optax
    from flax import nnx
    from sklearn.datasets import load_digits as sklearn_digits
    # The terminal bar, also in notebooks (tqdm.auto wants ipywidgets there, and warns).
    from tqdm import tqdm
except ImportError as error:
    package = {"sklearn": "scikit-learn"}.get(error.name, error.name)
    raise ImportError(f"the demo needs {package}, which is not installed: "
                      f"{_install_hint('demo')}") from error

from jax_epilog.runtime import library as cuda_library
from jax_epilog.layers import nnx as fused_nnx
from jax_epilog.tools.demo_cli import parse_args


class Digits(NamedTuple):
    """scikit-learn's 8x8 digits, pixels scaled to [0, 1], split into train and test."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> Digits:
    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Digits(x[train], y[train], x[test], y[test])


class PlainMLP(nnx.Module):
    """The plain-JAX model: stock `nnx.Linear` layers and `jax.nn` activations. Its state tree
    is `jax_epilog.nnx.MLP`'s, so the two load each other's parameters."""

    _ACTIVATIONS = {None: lambda x: x, "relu": jax.nn.relu,
                    "gelu": lambda x: jax.nn.gelu(x, approximate=True)}

    def __init__(self, in_features: int, features: Sequence[int], *,
                 activation: Optional[str] = "relu", final_activation: Optional[str] = None,
                 dtype: Optional[Any] = None, rngs: nnx.Rngs):
        sizes = [in_features, *features]
        self.layers = getattr(nnx, "List", list)([
            nnx.Linear(sizes[i], sizes[i + 1], dtype=dtype, rngs=rngs)
            for i in range(len(features))])
        self.activation = activation
        self.final_activation = final_activation

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            x = self._ACTIVATIONS[self.final_activation if last else self.activation](layer(x))
        return x


def make_model(fused: bool, in_features: int, features: Sequence[int], *,
               dtype: Optional[Any] = None, seed: int = 0) -> nnx.Module:
    """The classifier, fused (`jax_epilog.nnx.MLP`) or plain; the same seed gives both the same
    initial weights."""
    cls = fused_nnx.MLP if fused else PlainMLP
    return cls(in_features, features, dtype=dtype, rngs=nnx.Rngs(seed))


def make_train_step(model: nnx.Module, optimizer: optax.GradientTransformation) -> Callable:
    """A pure `step(state, opt_state, x, y) -> (state, opt_state, loss)` for `model`'s
    architecture, `state` being `model_state(model)`: softmax cross-entropy, gradients of every
    parameter, one optimizer update. FP8 amax histories (`jax_epilog.nnx.AmaxHistory`, under
    delayed scaling) take their gradient, which is their next value, as they are."""
    graphdef = nnx.graphdef(model)

    def loss_fn(params, histories, x, y):
        logits = nnx.merge(graphdef, histories, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), y).mean()

    def step(state, opt_state, x, y):
        params, histories = state
        loss, (grads, histories) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            params, histories, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), histories), opt_state, loss

    return step


def model_state(model: nnx.Module) -> tuple:
    """(parameters, amax histories): the state `make_train_step`'s step trains."""
    _, histories, params = nnx.split(model, fused_nnx.AmaxHistory, ...)
    return params, histories


def train(model: nnx.Module, data: Digits, *, epochs: int = 20, batch_size: int = 64,
          learning_rate: float = 3e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Train `model` in place with Adam; returns the mean training loss of every epoch.

    An epoch is one compiled `lax.scan` over its shuffled batches (the last partial batch is
    dropped), so the host dispatches once per epoch.
    """
    optimizer = optax.adam(learning_rate)
    step = make_train_step(model, optimizer)
    state = model_state(model)
    opt_state = optimizer.init(state[0])

    @jax.jit
    def run_epoch(state, opt_state, x_batches, y_batches):
        def body(carry, batch):
            state, opt_state, loss = step(*carry, *batch)
            return (state, opt_state), loss
        (state, opt_state), losses = jax.lax.scan(body, (state, opt_state),
                                                  (x_batches, y_batches))
        return state, opt_state, losses.mean()

    n_batches = len(data.x_train) // batch_size
    if n_batches < 1:
        raise ValueError(f"batch_size: expected at most {len(data.x_train)} (the training set), "
                         f"got {batch_size}")
    rng = np.random.default_rng(seed)
    losses = []
    bar = tqdm(range(epochs), desc="training", unit="epoch", disable=not progress)
    for _ in bar:
        order = rng.permutation(len(data.x_train))[:n_batches * batch_size]
        x = data.x_train[order].reshape(n_batches, batch_size, -1)
        y = data.y_train[order].reshape(n_batches, batch_size)
        state, opt_state, loss = run_epoch(state, opt_state, x, y)
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    nnx.update(model, *state)
    return losses


def accuracy(model: nnx.Module, x, y) -> float:
    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(params, x)
    return float(jnp.mean(jnp.argmax(logits, axis=-1) == y))


class StepCost(NamedTuple):
    seconds: float  # the median of `rounds`
    rounds: list[float]  # seconds per step in each timing round
    temp_bytes: Optional[int]  # None where the backend does not report memory
    custom_call: bool  # whether the compiled step runs jax-epilog's cuBLASLt custom call


def compare_steps(models: dict[str, nnx.Module], x, y, *, rounds: int = 7,
                  steps: int = 10) -> dict[str, StepCost]:
    """Time one training step of each model on (x, y).

    Each round runs `steps` back-to-back steps with one synchronisation, after a warm-up step;
    the rounds alternate between the models, so a machine that speeds up or slows down during
    the measurement affects all of them alike.
    """
    optimizer = optax.adam(1e-3)
    compiled, states, costs = {}, {}, {}
    for name, model in models.items():
        step = jax.jit(make_train_step(model, optimizer))
        state = model_state(model)
        states[name] = (state, optimizer.init(state[0]))
        lowered = step.lower(*states[name], x, y)
        compiled[name] = lowered.compile()
        try:
            temp_bytes = int(compiled[name].memory_analysis().temp_size_in_bytes)
        except (AttributeError, NotImplementedError, RuntimeError):
            temp_bytes = None
        costs[name] = (temp_bytes, targets.MATMUL.name in lowered.as_text())
        jax.block_until_ready(compiled[name](*states[name], x, y))
    per_step = {name: [] for name in models}
    for _, name in itertools.product(range(rounds), models):
        state = states[name]
        start = time.perf_counter()
        for _ in range(steps):
            *state, loss = compiled[name](*state, x, y)
        loss.block_until_ready()
        per_step[name].append((time.perf_counter() - start) / steps)
    return {name: StepCost(statistics.median(per_step[name]), per_step[name], *costs[name])
            for name in models}


def _mib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def backend_description() -> str:
    device = jax.devices()[0]
    if device.platform == "gpu" and cuda_library.available():
        return f"cuBLASLt custom call (cuBLASLt {cuda_library.cublaslt_version()})"
    reason = cuda_library.unavailable_reason() if device.platform == "gpu" \
        else f"JAX backend is {jax.default_backend()}"
    return f"plain-JAX reference lowering ({reason})"


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the demonstration with `python -m jax_epilog`'s arguments (for tests and notebooks);
    returns what it printed as numbers."""
    return run(parse_args(argv))


def reference_verdict(ratios) -> str:
    """What the round-by-round ratios (fused through the reference / plain) say, in words."""
    low, high = min(ratios), max(ratios)
    if low <= 1.0 <= high:
        return (f"The reference cost what plain JAX does, within this machine's round-to-round "
                f"spread ({low:.3f}-{high:.3f} spans 1).")
    if low > 1.0:
        return (f"The reference was slower than plain JAX in every round ({low:.3f}-"
                f"{high:.3f}): the masks it packs are work plain JAX does not do.")
    return (f"The reference was faster than plain JAX in every round ({low:.3f}-{high:.3f}), "
            f"more than this machine's round-to-round spread.")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The demonstration for parsed arguments; returns what it printed as numbers."""
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    print(f"jax {jax.__version__}, device: {device.device_kind} ({device.platform}), "
          f"backend: {backend_description()}")

    data = load_digits(seed=args.seed)
    layers = [*args.hidden, 10]
    model = make_model(True, data.x_train.shape[1], layers, seed=args.seed)
    print(f"\n1. Training jax_epilog.nnx.MLP {data.x_train.shape[1]} -> "
          f"{' -> '.join(map(str, layers))} on {len(data.x_train)} digits "
          f"({args.epochs} epochs, batch {args.batch_size}, Adam)")
    losses = train(model, data, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed)
    test_accuracy = accuracy(model, data.x_test, data.y_test)
    print(f"   final training loss {losses[-1]:.4f}, test accuracy {test_accuracy:.2%} "
          f"on {len(data.x_test)} held-out digits")
    result = {"device": device.device_kind, "platform": device.platform,
              "losses": losses, "test_accuracy": test_accuracy}
    if args.no_compare:
        return result

    batch = args.compare_batch or (16384 if on_gpu else 1024)
    width = args.compare_width or (2048 if on_gpu else 256)
    # bf16 compute on a GPU, where the fused epilogs matter; float32 on a CPU, where bf16 GEMMs
    # are emulated and slow.
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    features = [width, width, width, 10]
    rng = np.random.default_rng(args.seed)
    rows = rng.integers(0, len(data.x_train), batch)
    x, y = jnp.asarray(data.x_train[rows]), jnp.asarray(data.y_train[rows])
    print(f"\n2. One training step (value_and_grad + Adam), batch {batch}, "
          f"64 -> {' -> '.join(map(str, features))}, compute dtype {jnp.dtype(dtype).name}")
    models = {name: make_model(fused, x.shape[1], features, dtype=dtype, seed=args.seed)
              for name, fused in (("plain JAX (nnx.Linear + relu)", False),
                                  ("jax-epilog (fused MLP)", True))}
    costs = compare_steps(models, x, y, rounds=args.rounds, steps=args.steps)
    print(f"   {'model':<32}{'step time: median (min-max)':>30}{'temp memory':>14}  "
          "cuBLASLt custom call")
    for name, cost in costs.items():
        spread = f"({min(cost.rounds) * 1e3:.3f}-{max(cost.rounds) * 1e3:.3f})"
        print(f"   {name:<32}{cost.seconds * 1e3:>11.3f} ms {spread:>16}"
              f"{_mib(cost.temp_bytes):>14}  {'yes' if cost.custom_call else 'no'}")
    plain, fused = costs.values()
    ratios = [f / p for f, p in zip(fused.rounds, plain.rounds)]
    print(f"   fused / plain step time: {fused.seconds / plain.seconds:.3f} (round by round "
          f"{min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} alternating rounds)")
    if not fused.custom_call:
        print("   No cuBLASLt here: both models ran plain JAX, the fused one through "
              "jax-epilog's reference\n   lowering (the same GEMMs, plus packing the ReLU "
              f"masks). {reference_verdict(ratios)}\n   This does not measure the fused "
              "kernels, which run on a CUDA GPU.")
    result["comparison"] = {"batch": batch, "features": features,
                            "dtype": jnp.dtype(dtype).name,
                            **{name: cost._asdict() for name, cost in costs.items()}}
    return result
