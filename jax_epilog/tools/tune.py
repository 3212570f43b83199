"""`python -m jax_epilog.tune`: measure cuBLASLt against XLA for your own shapes, on your GPU.

The automatic backend choice (`jax_epilog.planning.decisions`) reads a table of measured problems. This
command fills the user's table (``settings.decisions_path()``: ``$JAX_EPILOG_DECISIONS``, else
``~/.cache/jax_epilog/decisions.json``, beside the autotune cache) for the problems a program
actually runs:

1. It traces functions (`jax.make_jaxpr`, walking nested jaxprs: jit, custom_vjp/custom_jvp,
   scan, cond, remat, custom_partitioning) and collects every `epilog_matmul` call left to
   ``backend="auto"``: epilog, dtype, transposes and the normalised problem (batch, M, N, K);
   and every `dense`/`mlp` stack left to "auto" (the planning context's observer, `context.Context`:
   dtype, rows, widths, activations, biases; a training step where its custom VJP's forward was
   traced, an inference forward where its primal was).
2. It times each distinct problem with ``backend="cublaslt"`` and ``backend="xla"``:
   `jax_epilog.matmul` jitted on random operands of those shapes (a random bit mask for the
   DRELU epilogs), wall-clock rounds of back-to-back calls with one `block_until_ready` each,
   median over rounds after a warm-up, about `SECONDS_PER_CANDIDATE` of GPU time per candidate.
   Small problems run several independent copies per call so that host dispatch does not hide
   the kernels (as inside a real network). Then each distinct stack, as the layer is used
   (inference: the forward; training step: forward and backward of a loss), as the
   plain expression under XLA ("plain") and as the fused stack ("fused", each GEMM choosing by
   the GEMM entries just measured): one real call after another, rotating inputs through
   enough copies to leave L2, so the custom calls' own cost is in the times. A training step
   is `jax.value_and_grad` of `squared_error` (the loss `benchmarks/never_slower.py` times)
   w.r.t. x and the parameters. "fused" must win by `table_format.MARGIN`, and it is recorded
   only where at least one of its GEMMs runs cuBLASLt: with every GEMM on XLA it is our own
   backward around XLA's GEMMs, while "plain" is exactly the program XLA makes of the user's
   expression, so "plain" is recorded (never slower than XLA by construction).
   With ``--fp8`` (``tune(fp8=True)``) each training step whose widths are all multiples of 16
   is also timed in FP8 (``"fp8"``: the same stack with ``fp8=Fp8(layers="all")``,
   `FP8_CANDIDATE`; on a warm amax state where its scaling keeps one, after one untimed step,
   as a training loop carries it). That time decides `Fp8(layers="auto")` for the stack (FP8
   in every layer where it beat the faster bf16 step by `table_format.MARGIN`, else none;
   `stack_plan.measured_fp8`). ``--fp8-only`` times only that candidate, keeping the table's other
   times of the stack.
3. It merges the decisions into the table (atomic write; other entries are kept): the GEMM
   entries once they are timed, then each stack entry as it is timed, so a run stopped by
   ``--max-seconds`` (no new problem or stack is started after it), an interrupt or a kill
   keeps what it measured.

    python -m jax_epilog.tune --grid                       # the benchmark grid G1-G7, M1-M3
    python -m jax_epilog.tune --grid --rows G7,M3 --dry-run
    python -m jax_epilog.tune --fn mypkg.model:train_step --args "bf16[256,784]" "bf16[784,100]"
    python -m jax_epilog.tune --grid --output jax_epilog/tables/nvidia-h200.json
    python -m jax_epilog.tune --grid --rows M1,T1 --fp8-only --max-seconds 600
    python -m jax_epilog.tune --serving                    # stored FP8 weights: which way
    python -m jax_epilog.tune --serving --serving-shapes 4096x12288,4096x4096 --serving-rows 1,16,64
    python -m jax_epilog.tune --serving --attention 32/8/128 --attention-batches 1,16,64 \
        --attention-contexts 2048,8192      # and your model's decode attention

``--serving`` times the ways of a layer with a stored FP8 weight instead (weight-only, XLA's
FP8 dot, the Pallas kernel of few rows, our FP8 GEMM) at decode and prefill row counts and
stores one serving entry per row count, which the served layers then follow on this GPU
(`jax_epilog.tools.serving_tune`); then the reads and layouts of an FP8 KV cache for the
decode attention of ``--attention`` (query heads / key-value heads / head_dim) at each batch
and context, each cell's fastest stored in the user's decode-attention table
(`jax_epilog.tools.attention_tune`), which `jax_epilog.decode_attention` and
`init_kv_cache` then follow (``--attention none``: the GEMMs only).

From Python: ``jax_epilog.tune.tune([(train_step, (params, batch)), ...])`` (any pytrees of
arrays or `jax.ShapeDtypeStruct`s), or `tune` on `Problem`s from `problems_of`. The grid's
workloads are `jax_epilog.grid`'s, the timing loop `jax_epilog.timing`'s (the benchmarks'),
the command line's argument parsing `jax_epilog.command_line`'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Optional


from jax_epilog.runtime import settings

from jax_epilog.planning import attention_plan
from jax_epilog.planning import context
from jax_epilog.planning import decisions
from jax_epilog.planning import table_format
from jax_epilog.tools.command_line import load_callable, parse_arg_spec
from jax_epilog.tools import measurement
from jax_epilog.tools.measurement import (DRY_RUN_HEADER, FP8_CHOICES, Problem,
                                       SECONDS_PER_CANDIDATE, _operand_sets,
                                       _stack_operand_sets, distinct, distinct_stacks,
                                       fp8_keeps_state, fp8_measurable, fused_gemm_backends,
                                       time_problem, time_stack, traced)
from jax_epilog.tools.grid import grid_functions
from jax_epilog.tools import attention_tune, serving_tune


# --- 3. the run ---------------------------------------------------------------------------------

class _Progress:
    """tqdm's bar where tqdm is installed (the `demo` extra), plain lines otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.bar = total, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc="jax_epilog.tune", unit="problem")
            except ImportError:
                pass

    def report(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def has_cuda_gpu() -> bool:
    return decisions.device_identity()[0] is not None


def _collect(items) -> tuple[list[Problem], list[table_format.StackKey]]:
    """The distinct problems and stacks of `tune`'s items."""
    problems, stacks = [], []
    for item in items:
        if isinstance(item, Problem):
            problems.append(item)
        elif isinstance(item, table_format.StackKey):
            stacks.append(item)
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[0]):
            fn, args = item
            found = traced(fn, *args)
            problems += found[0]
            stacks += found[1]
        elif callable(item):
            raise TypeError("fns_or_problems: give a function with its example arguments, as "
                            f"(fn, args), got the bare callable {item!r}")
        else:
            raise TypeError(f"fns_or_problems: expected Problem, table_format.StackKey or (fn, args) "
                            f"items, got {type(item).__name__}")
    return distinct(problems), distinct_stacks(stacks)


def _timed(measure: Callable, what, candidates: Sequence[str], seconds: float,
           failures: list[str]) -> dict:
    """{candidate: seconds per call, None where it failed (noted in `failures`)}."""
    times = {}
    for candidate in candidates:
        try:
            times[candidate] = float(measure(what, candidate, seconds=seconds))
        except Exception as e:  # noqa: BLE001  (one failure costs one candidate)
            times[candidate] = None
            failures.append(f"{what} on {candidate}: {type(e).__name__}: {e}")
    return times


def _us(seconds: Optional[float]) -> str:
    return "failed" if seconds is None else f"{seconds * 1e6:.1f} us"


def _stack_candidates(key: table_format.StackKey, fp8) -> tuple[str, ...]:
    """What `tune(fp8=...)` times of `key`: "fused" and "plain" (not with fp8="only"), and
    "fp8" where asked for and `fp8_measurable`."""
    bf16 = () if fp8 == "only" else table_format.STACK_CANDIDATES
    return (*bf16, table_format.FP8) if fp8 and fp8_measurable(key) else bf16


def _stack_line(entry: table_format.StackEntry, candidates: Sequence[str]) -> str:
    """A progress line: the candidates' times and what they decide."""
    times = ", ".join(f"{c} {_us(entry.seconds[c])}" for c in candidates)
    verdicts = []
    if entry.choice is not None:
        gemms = entry.seconds.get(table_format.FUSED_CUBLASLT_GEMMS)
        verdicts.append(entry.choice + (" (fused runs no cuBLASLt GEMM)" if gemms == 0 else ""))
    fp8 = table_format.decide_fp8_from_times(entry.seconds)
    if fp8 is not None:
        verdicts.append(f"{'fp8' if fp8 == 'fp8' else 'no fp8'} "
                        f"({entry.seconds[table_format.FP8_SCALING]} scaling)")
    return f"{entry.key}: {times}" + (f" -> {'; '.join(verdicts)}" if verdicts else "")


def tune(fns_or_problems: Iterable, *, output: Optional[Path] = None,
         seconds: float = SECONDS_PER_CANDIDATE, measure: Optional[Callable] = None,
         measure_stack: Optional[Callable] = None, progress: bool = True,
         write: bool = True, fp8=False, max_seconds: Optional[float] = None) -> table_format.Table:
    """Time every distinct problem of `fns_or_problems` on both backends, then every distinct
    stack as "fused" and "plain" (and "fp8"), and merge the decisions into `output` (default:
    `settings.decisions_path()`).

    Args:
      fns_or_problems: `Problem`s, `table_format.StackKey`s and/or `(fn, args)` pairs (args: a
        tuple of pytrees of arrays or `jax.ShapeDtypeStruct`s), traced with `traced`.
      output: the table file; None: the user's table.
      seconds: GPU time per candidate and problem or stack (rounds of back-to-back calls).
      measure: `measure(problem, backend, seconds=...) -> seconds per call`; `time_problem` by
        default (tests inject their own).
      measure_stack: `measure_stack(stack_key, candidate, seconds=...) -> seconds per call`;
        `time_stack` by default. It runs in `context.measuring`'s context, with this run's GEMM
        entries.
      progress: show a progress bar (plain lines without tqdm).
      write: merge the results into the file (False: only return them).
      fp8: False; True: also time each training-step stack whose widths are multiples of 16
        in FP8 (`FP8_CANDIDATE`), which then decides `Fp8(layers="auto")` for it; "only":
        time only that (no GEMM, no "fused" or "plain": the table's earlier times of those
        stay).
      max_seconds: start no new problem or stack after this many seconds (None: no limit);
        what was measured is written.

    Returns:
      The `table_format.Table` of this run's measurements (device, cuBLASLt version, entries,
      stack entries).
    """
    if fp8 not in FP8_CHOICES:
        raise ValueError(f"fp8: expected one of {FP8_CHOICES}, got {fp8!r}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds: expected a positive number of seconds or None, got "
                         f"{max_seconds!r}")
    if not has_cuda_gpu():
        raise RuntimeError("jax_epilog.tune needs a CUDA GPU: JAX sees none on this machine")
    device, version = decisions.device_identity()
    problems, stacks = _collect(fns_or_problems)
    if fp8 == "only":
        problems, stacks = [], [key for key in stacks if fp8_measurable(key)]
    measure, measure_stack = measure or time_problem, measure_stack or time_stack
    started = time.perf_counter()
    path = Path(output) if output is not None else settings.decisions_path()
    bar = _Progress(len(problems) + len(stacks), progress)
    entries, stack_entries, failures = [], [], []
    saved = [0, 0]  # entries and stack entries written so far

    def save() -> None:
        if write and path is not None and (entries[saved[0]:] or stack_entries[saved[1]:]):
            decisions.merge_into(path, device, version, entries[saved[0]:],
                                stack_entries[saved[1]:])
        saved[:] = len(entries), len(stack_entries)

    def out_of_time() -> bool:
        return max_seconds is not None and time.perf_counter() - started > max_seconds

    try:
        for p in problems:
            if out_of_time():
                break
            times = _timed(measure, p, table_format.CANDIDATES, seconds, failures)
            entry = table_format.make_entry(p.epilog, p.dtype, p.transpose_a, p.transpose_b,
                                        p.batch * p.m, p.n, p.k, times)
            entries.append(entry)
            bar.report(f"{p}: cublaslt {_us(times['cublaslt'])}, xla {_us(times['xla'])} "
                       f"-> {entry.choice}")
        _operand_sets.cache_clear()
        save()
        measured = table_format.Table(device, version, tuple(entries))
        decisions.clear_cache()  # decisions cached while this run measured the GEMMs
        with context.planning(context.measuring(measured)):
            for key in stacks:
                if out_of_time():
                    break
                candidates = _stack_candidates(key, fp8)
                times = _timed(measure_stack, key, candidates, seconds, failures)
                if "fused" in candidates:
                    # Stored with the times: with 0, "plain" is chosen (`decisions`, module doc).
                    times[table_format.FUSED_CUBLASLT_GEMMS] = fused_gemm_backends(key).count(
                        "cublaslt")
                if table_format.FP8 in candidates:
                    times[table_format.FP8_SCALING] = ("delayed" if fp8_keeps_state(measurement.FP8_CANDIDATE)
                                                   else "current")
                stack_entries.append(table_format.make_stack_entry(key, times))
                bar.report(_stack_line(stack_entries[-1], candidates))
                save()
    finally:
        bar.close()
        _operand_sets.cache_clear()
        _stack_operand_sets.cache_clear()
        save()  # whatever was measured is kept, also when a later problem stopped the run
    for failure in failures:
        print(f"failed: {failure}", file=sys.stderr)
    left = len(problems) - len(entries) + len(stacks) - len(stack_entries)
    if left:
        print(f"stopped after {max_seconds:g} s (max_seconds): {left} problems and stacks not "
              f"timed", file=sys.stderr)
    wins = sum(e.choice == "cublaslt" for e in entries)
    fused = sum(e.choice == "fused" for e in stack_entries)
    plain = sum(e.choice == "plain" for e in stack_entries)
    fp8_verdicts = [table_format.decide_fp8_from_times(e.seconds) for e in stack_entries
                    if table_format.FP8 in e.seconds]
    fp8_note = (f"; fp8 timed {len(fp8_verdicts)}, won {fp8_verdicts.count('fp8')}"
                if fp8 else "")
    where = f" into {path}" if write and path is not None else ""
    print(f"tuned {len(entries)} problems and {len(stack_entries)} stacks in "
          f"{time.perf_counter() - started:.1f} s: cublaslt {wins}, xla {len(entries) - wins}; "
          f"fused {fused}, plain {plain}{fp8_note}{where}", flush=True)
    return table_format.Table(device, version, tuple(entries), tuple(stack_entries))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jax_epilog.tune",
        description="Measure cuBLASLt against XLA for the epilog matmuls of a function (or of "
                    "the benchmark grid) on this GPU and store the choices for backend='auto'.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--grid", action="store_true",
                      help="the benchmark grid G1-G7 and networks M1-M3 (forward and step); "
                           "the transformer MLPs T1, T2 where --rows names them")
    what.add_argument("--fn", metavar="MODULE:CALLABLE", help="a function to trace")
    what.add_argument("--serving", action="store_true",
                      help="the ways of a layer with a stored FP8 weight (weight-only, XLA's "
                           "FP8 dot, the Pallas kernel, our FP8 GEMM) at each of "
                           "--serving-rows: the served layers take the fastest on this GPU")
    parser.add_argument("--serving-shapes", metavar="KxN[,KxN...]",
                        help="with --serving: the layers' shapes (default "
                             f"{','.join(f'{k}x{n}' for k, n in serving_tune.SHAPES)})")
    parser.add_argument("--serving-rows", metavar="R[,R...]",
                        help="with --serving: the row counts (default "
                             f"{','.join(map(str, serving_tune.ROWS))})")
    parser.add_argument("--attention", metavar="Q/KV/D",
                        help="with --serving: the decode attention's query heads / key-value "
                             "heads / head_dim, or none (default "
                             f"{'/'.join(map(str, attention_tune.SHAPE))})")
    parser.add_argument("--attention-batches", metavar="B[,B...]",
                        help="with --serving: the decode batches (default "
                             f"{','.join(map(str, attention_tune.BATCHES))})")
    parser.add_argument("--attention-contexts", metavar="L[,L...]",
                        help="with --serving: the cache lengths (default "
                             f"{','.join(map(str, attention_tune.CONTEXTS))})")
    parser.add_argument("--args", nargs="*", default=[], metavar="DTYPE[SHAPE]",
                        help='example inputs of --fn, e.g. "bf16[256,784]" "bf16[784,100]"')
    parser.add_argument("--rows", help="with --grid: comma-separated ids (e.g. G1,G7,M3,T1)")
    parser.add_argument("--output", type=Path,
                        help="the table to merge into (default: $JAX_EPILOG_DECISIONS or "
                             "~/.cache/jax_epilog/decisions.json)")
    parser.add_argument("--seconds", type=float, default=SECONDS_PER_CANDIDATE,
                        help="GPU time per candidate and problem or stack (default "
                             "%(default)s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the problems and stacks without timing them (works without "
                             "a GPU)")
    parser.add_argument("--no-progress", action="store_true", help="plain lines, no bar")
    fp8 = parser.add_mutually_exclusive_group()
    fp8.add_argument("--fp8", action="store_true",
                     help="also time each training step whose widths are multiples of 16 with "
                          "FP8 in every layer; that decides fp8=Fp8(layers='auto') for it")
    fp8.add_argument("--fp8-only", action="store_true",
                     help="time only the FP8 training steps (no GEMMs, no bf16 stacks: the "
                          "table's earlier times of those stay)")
    parser.add_argument("--max-seconds", type=float, metavar="S",
                        help="start no new problem or stack after S seconds; what was "
                             "measured is written")
    args = parser.parse_args(argv)
    fp8_mode = "only" if args.fp8_only else args.fp8
    if args.args and not args.fn:
        parser.error("--args goes with --fn")
    if args.rows and not args.grid:
        parser.error("--rows goes with --grid")
    if args.max_seconds is not None and not args.max_seconds > 0:
        parser.error("--max-seconds: expected a positive number of seconds")
    if (args.serving_shapes or args.serving_rows or args.attention or args.attention_batches
            or args.attention_contexts) and not args.serving:
        parser.error("--serving-shapes, --serving-rows and --attention* go with --serving")
    if args.serving:
        return _serving_main(parser, args)

    if args.grid:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
        try:
            targets = [(fn, example) for _, fn, example in grid_functions(rows)]
        except ValueError as e:
            parser.error(str(e))
    else:
        try:
            fn = load_callable(args.fn)
            example = tuple(parse_arg_spec(spec) for spec in args.args)
        except (ValueError, TypeError, ImportError, AttributeError) as e:
            parser.error(str(e))
        targets = [(fn, example)]

    if not args.dry_run and not has_cuda_gpu():
        print("jax_epilog.tune: no CUDA GPU visible to JAX here; timing needs one (use --dry-run "
              "to list the problems)", file=sys.stderr)
        return 2
    problems, stacks = _collect(targets)
    if args.dry_run:
        if fp8_mode == "only":
            problems, stacks = [], [key for key in stacks if fp8_measurable(key)]
        print(DRY_RUN_HEADER)
        for item in problems:
            print(item)
        for key in stacks:
            timed = f"  ({', '.join(_stack_candidates(key, fp8_mode))})" if fp8_mode else ""
            print(f"{key}{timed}")
        print(f"{len(problems)} distinct problems, {len(stacks)} stacks", flush=True)
        return 0
    tune([*problems, *stacks], output=args.output, seconds=args.seconds,
         progress=not args.no_progress, fp8=fp8_mode, max_seconds=args.max_seconds)
    return 0


def _serving_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """`main` for --serving."""
    if args.fp8 or args.fp8_only or args.max_seconds is not None:
        parser.error("--fp8, --fp8-only and --max-seconds go with --grid or --fn")
    try:
        shapes = (serving_tune.parse_shapes(args.serving_shapes) if args.serving_shapes
                  else serving_tune.SHAPES)
        rows = serving_tune.check_rows(args.serving_rows.split(",") if args.serving_rows
                                       else serving_tune.ROWS)
    except ValueError as e:
        parser.error(str(e) if args.serving_shapes and "shapes" in str(e) else
                     f"--serving-rows: expected comma-separated positive row counts, got "
                     f"{args.serving_rows!r}")
    try:
        attention = attention_tune.parse_cells(args.attention, args.attention_batches,
                                               args.attention_contexts)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        print(f"served ways {', '.join(serving_tune.WAYS)} at rows "
              f"{', '.join(map(str, rows))} on layers (K x N) "
              f"{', '.join(f'{k} x {n}' for k, n in shapes)}", flush=True)
        if attention is not None:
            (q, kv, d), batches, contexts = attention
            print(f"decode attention, {q} query / {kv} key-value heads of {d}: FP8 cache reads "
                  f"and layouts at batches {', '.join(map(str, batches))} and contexts "
                  f"{', '.join(map(str, contexts))}", flush=True)
        return 0
    if not has_cuda_gpu():
        print("jax_epilog.tune: no CUDA GPU visible to JAX here; timing needs one (use --dry-run "
              "to list what would be timed)", file=sys.stderr)
        return 2
    serving_tune.tune_serving(shapes, rows, output=args.output, seconds=args.seconds)
    if attention is not None:
        attention_tune.tune_attention(
            *attention, device=decisions.device_identity()[0],
            output=attention_plan.user_table_path(args.output) if args.output else None)
    return 0



if __name__ == "__main__":
    sys.exit(main())
