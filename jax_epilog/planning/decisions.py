"""Which backend runs one `epilog_matmul` call with ``backend="auto"``: cuBLASLt or XLA.

A fused cuBLASLt epilog is not automatically faster than XLA's own lowering of the same
computation (its dot plus fused elementwise work, i.e. the primitive's reference lowering): XLA's
bf16 GEMMs already run at the chip's ceiling and fuse bias+ReLU themselves, cuBLASLt's
mask-reading epilogs are slower kernels on Hopper, and small calls pay the custom call's host
cost. So the choice is made per problem from measurements, with "never slower than XLA" as the
goal:

- **Tables.** A table is a list of measured problems of one GPU model and cuBLASLt version:
  (epilog, dtype, transposes, rows = batch·M, N, K), each candidate's seconds per call and the
  choice. The user's table (``settings.decisions_path()``, written by ``python -m
  jax_epilog.tune``) is read first, then the table shipped for this GPU
  (``jax_epilog/tables/<gpu slug>.json``, e.g. ``nvidia-h200.json``). Within a file the section
  of this GPU with this cuBLASLt version is used, else this GPU's newest.
- **Nearest measured problem.** Among the entries of the same epilog, dtype and transposes, the
  nearest problem (the largest ratio between the two problems' rows, N or K) decides, if it is
  within a factor of `NEAREST_WITHIN` (2) in every dimension. A nearby user entry decides before
  a shipped one.
- **Margin.** A measurement chooses ``"cublaslt"`` only if it was faster than ``"xla"`` by more
  than `MARGIN` (2%), so that noise never picks the riskier path, and by more than
  `CALL_COST_S`, the custom call's own cost per call that tune's timing amortises.
  Choices are re-derived from the stored times when a table is read.
- **FP8 operands without a nearby entry** (user or shipped): ``"cublaslt"``. SPEC §5: every
  FP8 epilog cuBLASLt runs on the device runs the kernel (what it lacks still takes the
  reference, with a warning, at lowering); a measurement that chose XLA still decides.
- **A GPU with a table but no nearby entry**: ``"xla"``.
- **A GPU without any table** (no section for it in the user table, no shipped file): the
  conservative rule. ``"cublaslt"`` only where the reference GPU's table (`REFERENCE_DEVICE`,
  whose table ships) has at least one nearby entry and every nearby entry chose
  ``"cublaslt"``; everything else ``"xla"``. So a problem class that lost on the reference GPU
  never takes the fused path here, and nothing unmeasured does.
- **Override**: ``JAX_EPILOG_BACKEND=cublaslt|xla`` (``settings.backend_override()``) replaces the
  automatic choice for every call that asked for ``"auto"``.

GEMM choices measured one by one do not add up to the fastest layer (G1's training step: the
fused RELU_AUX_BIAS forward beat XLA computing the same mask, but the plain layer computes no
mask at all and won the step; benchmarks/results/never_slower.md). So a table also holds **stack
entries**: a whole `dense`/`mlp` stack (dtype, rows, widths, activations, biases), as a training
step (forward and backward through `jax.vjp`) or as an inference forward, timed as the plain
expression under XLA (``"plain"``) and as the fused stack (``"fused"``, each GEMM chosen as
above). `stack_decision` finds the nearest entry of the same stack and mode within a factor of
`NEAREST_WITHIN` in rows (user before shipped); ``"fused"`` must win by `MARGIN` (tune times
real calls of the stack, so its custom calls' own cost is in the times). Without an entry, or
under the override, the layers fall back to the per-GEMM rule.

A training-step entry may also hold the time of the same stack trained in FP8 (``"fp8"``:
``Fp8(layers="all")``, measured by ``python -m jax_epilog.tune --fp8``). `fp8_stack_decision`
finds the nearest step entry that has one (user before shipped, rows within `NEAREST_WITHIN`),
and it decides `Fp8(layers="auto")` for the whole stack: FP8 in every layer where it beat the
faster of "fused" and "plain" by `MARGIN` (`decide_fp8_from_times`), no FP8 layer otherwise.
Without such an entry the per-layer rule `stack_plan.fp8_pays` decides.

A table may also hold **serving entries** (``python -m jax_epilog.tune --serving``): the
ways of a layer with a stored FP8 weight timed at one row count. `serving_decision` finds the
entry of the nearest rows within `NEAREST_WITHIN` (user before shipped) for
`serving_plan.serving_way`; without one the plan's constants decide.

`choose` is called at lowering time on a host that sees a CUDA GPU; tables are loaded once and
decisions are cached, so a process reads a table written by another process at its next start
(or after `clear_cache()`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp

from jax_epilog.runtime import settings
from jax_epilog.planning.table_format import (Decision, Entry, NEAREST_WITHIN, REFERENCE_DEVICE,
                                            ServingEntry, StackEntry, StackKey, TABLES_DIR,
                                            Table, dump,
                                            locked, section, decide_fp8_from_times,
                                            decide_stack_from_times, load_tables,
                                            make_stack_entry, read_tables, slug)

from jax_epilog.runtime import library as cuda_library
from jax_epilog.op.epilogs import Epilog, as_epilog, is_fp8





def merge_into(path: Path, device: str, cublaslt_version: Optional[int],
               entries: Iterable[Entry], stacks: Iterable[StackEntry] = (),
               serving: Iterable[ServingEntry] = ()) -> tuple[Table, ...]:
    """Add `entries` (and stack and serving entries) to `path`'s table for (device, cuBLASLt
    version), replacing entries of the same problem (serving entries of the same rows), and
    the times of the candidates measured again in entries of the same stack (a stack's other
    candidates keep theirs), keeping everything else; written atomically (temp file +
    rename), in the current format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(path.parent):
        tables = list(read_tables(path))
        index = next((i for i, t in enumerate(tables)
                      if t.device == device and t.cublaslt_version == cublaslt_version), None)
        old = tables[index] if index is not None else Table(device, cublaslt_version, ())
        merged = {e.key: e for e in (*old.entries, *entries)}
        merged_stacks = {e.key: e for e in old.stacks}
        for e in stacks:  # a candidate this run did not time keeps its earlier time
            earlier = merged_stacks[e.key].seconds if e.key in merged_stacks else {}
            merged_stacks[e.key] = make_stack_entry(e.key, {**earlier, **e.seconds})
        merged_serving = {e.key: e for e in (*old.serving, *serving)}
        table = Table(device, cublaslt_version, tuple(merged.values()),
                      tuple(merged_stacks.values()), tuple(merged_serving.values()))
        if index is None:
            tables.append(table)
        else:
            tables[index] = table
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(dump(tables))
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
    clear_cache()
    return tuple(tables)


# --- the decision ----------------------------------------------------------------------------

#: The largest |log ratio| of two sizes for one measurement to decide for the other.
_NEAR = math.log(NEAREST_WITHIN) + 1e-9


def _log_ratio(a: int, b: int) -> float:
    """|log(a / b)| of two sizes (each at least 1)."""
    return abs(math.log(max(a, 1) / max(b, 1)))


def _distance(entry: Entry, m: int, n: int, k: int) -> float:
    """The largest |log ratio| between the two problems' rows, N and K."""
    return max(_log_ratio(a, b) for a, b in ((entry.m, m), (entry.n, n), (entry.k, k)))


def nearby(table: Optional[Table], problem: tuple) -> list[Entry]:
    """Entries of `table` of the problem's kind within `NEAREST_WITHIN`, nearest first."""
    if table is None:
        return []
    kind, (m, n, k) = problem[:4], problem[4:]
    close = [(_distance(e, m, n, k), e) for e in table.entries
             if (e.epilog, e.dtype, e.transpose_a, e.transpose_b) == kind]
    return [e for d, e in sorted(close, key=lambda c: c[0]) if d <= _NEAR]


def nearby_stacks(table: Optional[Table], key: StackKey,
                  decides: Callable[[dict], Optional[str]] = decide_stack_from_times
                  ) -> list[StackEntry]:
    """Stack entries of `table` of the same kind with rows within `NEAREST_WITHIN` whose times
    can decide (`decides(seconds)` is not None), nearest first."""
    if table is None:
        return []
    close = [(_log_ratio(e.key.rows, key.rows), e) for e in table.stacks
             if e.key.kind == key.kind and decides(e.seconds) is not None]
    return [e for d, e in sorted(close, key=lambda c: c[0]) if d <= _NEAR]


@functools.cache
def device_identity() -> tuple[Optional[str], Optional[int]]:
    """(GPU model as JAX names it, cuBLASLt version) of this host's first CUDA device."""
    try:
        device = jax.devices("cuda")[0].device_kind
    except (RuntimeError, IndexError):
        device = None
    return device, cuda_library.cublaslt_version()


def shipped_table_path(device: str) -> Path:
    return TABLES_DIR / f"{slug(device)}.json"


def _sources(user_path: Optional[Path],
             identity: tuple) -> tuple[tuple[str, Optional[Table]], ...]:
    """(source, the GPU's section) in the order they decide: the user's table, the shipped
    one; `identity`: (GPU model, cuBLASLt version)."""
    device, version = identity
    user = section(load_tables(user_path), device, version) if user_path else None
    shipped = section(load_tables(shipped_table_path(device)), device, version) \
        if device else None
    return (("user", user), ("shipped", shipped))


def _decide(problem: tuple, user_path: Optional[Path], identity: tuple,
            measuring: bool) -> Decision:
    sources = _sources(user_path, identity)
    if measuring:  # tune's own table (searched first, by `decision`) has no nearby entry
        sources = (("measuring", Table("", None, (), ())), *sources)
    for source, table in sources:
        close = nearby(table, problem)
        if close:
            return Decision(close[0].choice, source, close[0])
    if is_fp8(problem[1]):
        return Decision("cublaslt", "fp8")
    if any(table is not None for _, table in sources):
        return Decision("xla", "none")
    reference = section(load_tables(shipped_table_path(REFERENCE_DEVICE)), REFERENCE_DEVICE,
                         None)
    close = nearby(reference, problem)
    if close and all(e.choice == "cublaslt" for e in close):
        return Decision("cublaslt", "reference-gpu", close[0])
    return Decision("xla", "reference-gpu" if close else "none", close[0] if close else None)


@functools.lru_cache(maxsize=4096)
def _cached_decision(problem: tuple, user_path: Optional[Path], identity: tuple,
                     measuring: bool) -> Decision:
    return _decide(problem, user_path, identity, measuring)


def decision(epilog, dtype, batch: int, m: int, n: int, k: int, transpose_a: bool,
             transpose_b: bool, identity: Optional[tuple] = None,
             measuring: Optional[Table] = None) -> Decision:
    """`choose`'s answer with where it came from (for reports and debugging); `identity`:
    (GPU model, cuBLASLt version) whose tables decide, this host's first GPU by default;
    `measuring`: the GEMM entries a tune run has just measured, which decide first (as they
    will once written)."""
    override = settings.backend_override()
    if override is not None:
        return Decision(override, "override")
    problem = (as_epilog(epilog).name, jnp.dtype(dtype).name, bool(transpose_a),
               bool(transpose_b), int(batch) * int(m), int(n), int(k))
    close = nearby(measuring, problem)
    if close:
        return Decision(close[0].choice, "measuring", close[0])
    return _cached_decision(problem, settings.decisions_path(), identity or device_identity(),
                            measuring is not None)


def choose(epilog: Epilog, dtype, batch: int, m: int, n: int, k: int, transpose_a: bool,
           transpose_b: bool) -> str:
    """"cublaslt" or "xla" for one normalised problem (batch, M, N, K as in
    `call.problem_of`) called with ``backend="auto"``; the rules are in the module doc."""
    return decision(epilog, dtype, batch, m, n, k, transpose_a, transpose_b).choice


@functools.lru_cache(maxsize=4096)
def _cached_stack_decision(key: StackKey, user_path: Optional[Path], identity: tuple,
                           decides: Callable[[dict], Optional[str]]) -> Optional[Decision]:
    for source, table in _sources(user_path, identity):
        close = nearby_stacks(table, key, decides)
        if close:
            return Decision(decides(close[0].seconds), source, close[0])
    return None


def stack_decision(key: StackKey, identity: Optional[tuple] = None) -> Optional[Decision]:
    """"fused" or "plain" for a whole `dense`/`mlp` stack left to "auto", from the nearest
    measured stack entry; None where there is none nearby or under the override
    (``JAX_EPILOG_BACKEND``): the layers then fall back to the per-GEMM rule. (While tune
    measures stacks, its planning context asks no stack entry: `context.measuring`.)"""
    if settings.backend_override() is not None:
        return None
    return _cached_stack_decision(key, settings.decisions_path(), identity or device_identity(),
                                  decide_stack_from_times)


def fp8_stack_decision(key: StackKey, identity: Optional[tuple] = None) -> Optional[Decision]:
    """"fp8" or "bf16" for `Fp8(layers="auto")` on a training-step stack (`key.mode` "step"),
    from the nearest step entry with an FP8 time (`decide_fp8_from_times`; user before
    shipped); None where there is none nearby."""
    return _cached_stack_decision(key, settings.decisions_path(), identity or device_identity(),
                                  decide_fp8_from_times)


@functools.lru_cache(maxsize=256)
def _cached_serving_decision(rows: int, user_path: Optional[Path],
                             identity: tuple) -> Optional[Decision]:
    for source, table in _sources(user_path, identity):
        close = sorted(((_log_ratio(e.rows, rows), e)
                        for e in (table.serving if table is not None else ())
                        if e.choice is not None), key=lambda c: c[0])
        if close and close[0][0] <= _NEAR:
            return Decision(close[0][1].choice, source, close[0][1])
    return None


def serving_decision(rows: int, identity: Optional[tuple] = None) -> Optional[Decision]:
    """The way `python -m jax_epilog.tune --serving` measured fastest on this GPU for a served
    layer over `rows` rows: the serving entry of the nearest rows within `NEAREST_WITHIN`
    (user before shipped); None where there is none, or no CUDA GPU (`serving_plan` then
    decides by its constants)."""
    identity = identity or device_identity()
    if identity[0] is None:
        return None
    return _cached_serving_decision(int(rows), settings.decisions_path(), identity)


def clear_cache() -> None:
    """Forget loaded tables and decisions (after a table was written, or in tests)."""
    load_tables.cache_clear()
    _cached_decision.cache_clear()
    _cached_stack_decision.cache_clear()
    _cached_serving_decision.cache_clear()
