"""The decision tables' contents and files: a table of one GPU model and cuBLASLt version
holds GEMM entries (a problem, each candidate's seconds, the choice re-derived from them),
stack entries (a `dense`/`mlp` stack as a training step or inference forward) and serving
entries (the ways of a layer with a stored FP8 weight over some rows); files hold
several tables as JSON, one entry per line and sorted so that a table's changes read well in
a diff. How the tables decide is `decisions`.
"""


from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax.numpy as jnp


from jax_epilog.op.epilogs import as_epilog

CANDIDATES = ("cublaslt", "xla")
MARGIN = 0.02
# cuBLASLt must also win by more than its custom call's own cost per call, which tune's timing
# (copies of small problems per jitted call) amortises away: a small forward that tune timed
# faster than XLA's ran slower in a real call (benchmarks/results/overhead.md).
CALL_COST_S = 8e-6
NEAREST_WITHIN = 2.0
REFERENCE_DEVICE = "NVIDIA H200"
TABLES_DIR = Path(__file__).with_name("tables")
FORMAT = "jax_epilog.decisions/2"  # 2: sections may hold stack (and serving) entries
READABLE_FORMATS = ("jax_epilog.decisions/1", FORMAT)
STACK_CANDIDATES = ("fused", "plain")
#: In a stack entry's "seconds": how many of the fused candidate's GEMMs ran cuBLASLt when tune
#: timed it. 0: the fused stack was our own backward around XLA's GEMMs, and "plain" (XLA's own
#: program of the user's expression) is chosen whatever the times.
FUSED_CUBLASLT_GEMMS = "fused_cublaslt_gemms"
STACK_MODES = ("step", "forward")
#: In a training-step entry's "seconds": the stack trained with FP8 in every layer.
FP8 = "fp8"
#: Beside it: the scaling that time was measured with ("current" or "delayed").
FP8_SCALING = "fp8_scaling"


class Entry(NamedTuple):
    """One measured problem: seconds per call of each candidate (None: it failed) and the choice."""

    epilog: str
    dtype: str
    transpose_a: bool
    transpose_b: bool
    m: int  # rows: batch · M of the normalised problem
    n: int
    k: int
    seconds: dict
    choice: str

    @property
    def key(self) -> tuple:
        return (self.epilog, self.dtype, self.transpose_a, self.transpose_b, self.m, self.n, self.k)

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()


class StackKey(NamedTuple):
    """One `dense`/`mlp` stack as the layers run it: rows = the leading dims' product."""

    dtype: str
    rows: int
    widths: tuple[int, ...]  # K of the first layer, then each layer's N
    activations: tuple[Optional[str], ...]
    biases: tuple[bool, ...]
    mode: str  # "step": forward + backward (jax.vjp); "forward": inference

    @property
    def kind(self) -> tuple:
        """Everything but the rows: what must match for an entry to decide."""
        return (self.dtype, self.widths, self.activations, self.biases, self.mode)

    @property
    def order(self) -> tuple:
        """A sort key (None cannot be compared with a string)."""
        return (self.dtype, self.widths, tuple(a or "" for a in self.activations), self.biases,
                self.mode, self.rows)

    def __str__(self) -> str:
        layers = "".join(f" →{n}{'+b' if bias else ''}{' ' + act if act else ''}"
                         for n, act, bias in zip(self.widths[1:], self.activations, self.biases))
        return f"stack {self.mode} {self.dtype} M×K {self.rows}×{self.widths[0]}{layers}"


def make_stack_key(dtype, rows: int, widths, activations, biases, mode: str) -> StackKey:
    if mode not in STACK_MODES:
        raise ValueError(f"mode: expected one of {STACK_MODES}, got {mode!r}")
    widths, activations, biases = tuple(widths), tuple(activations), tuple(biases)
    if not len(widths) - 1 == len(activations) == len(biases) > 0:
        raise ValueError(f"widths, activations, biases: expected L + 1, L and L items, got "
                         f"{len(widths)}, {len(activations)} and {len(biases)}")
    return StackKey(jnp.dtype(dtype).name, int(rows), tuple(int(w) for w in widths),
                    activations, tuple(bool(b) for b in biases), mode)


class StackEntry(NamedTuple):
    """One measured stack: seconds per call of "fused" and "plain" (and of `FP8`, where
    measured; None: failed), the choice between fused and plain (None: only FP8 was timed)."""

    key: StackKey
    seconds: dict
    choice: Optional[str]

    def as_dict(self) -> dict[str, Any]:
        return {**self.key._asdict(), "seconds": self.seconds, "choice": self.choice}

    @classmethod
    def from_dict(cls, d: dict) -> StackEntry:
        key = make_stack_key(d["dtype"], d["rows"], d["widths"], d["activations"], d["biases"],
                             d["mode"])
        return cls(key, dict(d["seconds"]), decide_stack_from_times(d["seconds"]))


class ServingEntry(NamedTuple):
    """The ways of a served layer (a stored FP8 weight, `planning.serving_plan.WAYS`) timed
    over `rows` rows: seconds per call of each way (None: it failed), summed over the layer
    shapes `shapes` ((K, N) each), in `dtype`; the choice re-derived from them
    (`decide_serving_from_times`)."""

    rows: int
    dtype: str
    shapes: tuple[tuple[int, int], ...]
    seconds: dict
    choice: Optional[str]

    @property
    def key(self) -> int:
        return self.rows

    @property
    def times(self) -> str:
        """"weight_only 53.2 us, fp8 failed, ...": each way's time, as reports print it."""
        return ", ".join(f"{way} {'failed' if t is None else f'{t * 1e6:.1f} us'}"
                         for way, t in self.seconds.items())

    def as_dict(self) -> dict[str, Any]:
        return {**self._asdict(), "shapes": [list(s) for s in self.shapes]}

    @classmethod
    def from_dict(cls, d: dict) -> ServingEntry:
        return make_serving_entry(d["rows"], d["dtype"], d["shapes"], d["seconds"])


#: The served way that rounds only the weight: kept unless another beats it by `MARGIN`.
MOST_ACCURATE_WAY = "weight_only"


def decide_serving_from_times(seconds: dict) -> Optional[str]:
    """The fastest way of a serving entry, except that `MOST_ACCURATE_WAY` stays unless the
    fastest beat it by more than `MARGIN`; None where no way ran."""
    ran = {way: t for way, t in seconds.items() if t is not None}
    if not ran:
        return None
    fastest = min(ran, key=ran.get)
    accurate = ran.get(MOST_ACCURATE_WAY)
    if accurate is not None and not ran[fastest] < accurate * (1.0 - MARGIN):
        return MOST_ACCURATE_WAY
    return fastest


def make_serving_entry(rows: int, dtype, shapes, seconds: dict) -> ServingEntry:
    return ServingEntry(int(rows), jnp.dtype(dtype).name,
                        tuple((int(k), int(n)) for k, n in shapes), dict(seconds),
                        decide_serving_from_times(seconds))


class Table(NamedTuple):
    """The measurements of one GPU model with one cuBLASLt version."""

    device: str
    cublaslt_version: Optional[int]
    entries: tuple[Entry, ...]
    stacks: tuple[StackEntry, ...] = ()
    serving: tuple[ServingEntry, ...] = ()


class Decision(NamedTuple):
    """A choice and why it was made (`source`: override, measuring, user, shipped, fp8,
    reference-gpu, none) and the entry that made it (an `Entry`, or a `StackEntry` for
    `stack_decision`)."""

    choice: str
    source: str
    entry: Optional[Any] = None


def decide_from_times(seconds: dict) -> str:
    """'cublaslt' where it beat 'xla' by more than `MARGIN` and by more than `CALL_COST_S`;
    'xla' otherwise (or on failure)."""
    fused, xla = seconds.get("cublaslt"), seconds.get("xla")
    if fused is None:
        return "xla"
    if xla is None:  # XLA's lowering failed where cuBLASLt ran: nothing else to take
        return "cublaslt"
    return "cublaslt" if fused < min(xla * (1.0 - MARGIN), xla - CALL_COST_S) else "xla"


def decide_stack_from_times(seconds: dict) -> Optional[str]:
    """'fused' where the fused stack beat the plain expression by more than `MARGIN` and ran at
    least one cuBLASLt GEMM (`FUSED_CUBLASLT_GEMMS`, where recorded); 'plain' otherwise (or
    where the fused stack failed); None where neither was timed (an entry of FP8 time only)."""
    if not any(c in seconds for c in STACK_CANDIDATES):
        return None
    fused, plain = seconds.get("fused"), seconds.get("plain")
    if fused is None or seconds.get(FUSED_CUBLASLT_GEMMS) == 0:
        return "plain"
    if plain is None:
        return "fused"
    return "fused" if fused < plain * (1.0 - MARGIN) else "plain"


def decide_fp8_from_times(seconds: dict) -> Optional[str]:
    """"fp8" where the FP8 step beat the faster of "fused" and "plain" by more than `MARGIN`,
    "bf16" where it did not (or failed); None where the entry cannot tell (no FP8 time was
    measured, or no bf16 one)."""
    if FP8 not in seconds:
        return None
    bf16 = [t for t in (seconds.get("fused"), seconds.get("plain")) if t is not None]
    if not bf16:
        return None
    fp8 = seconds[FP8]
    return "fp8" if fp8 is not None and fp8 < min(bf16) * (1.0 - MARGIN) else "bf16"


def make_stack_entry(key: StackKey, seconds: dict) -> StackEntry:
    return StackEntry(key, dict(seconds), decide_stack_from_times(seconds))


def make_entry(epilog, dtype, transpose_a: bool, transpose_b: bool, m: int, n: int, k: int,
               seconds: dict) -> Entry:
    return Entry(as_epilog(epilog).name, jnp.dtype(dtype).name, bool(transpose_a),
                 bool(transpose_b), int(m), int(n), int(k), dict(seconds),
                 decide_from_times(seconds))


def slug(device_kind: str) -> str:
    """The shipped table's file stem for a GPU model: "NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-")


# --- files ---------------------------------------------------------------------------------

def _parse(text: str, path: Path) -> tuple[Table, ...]:
    data = json.loads(text)
    found = data.get("format") if isinstance(data, dict) else type(data).__name__
    if found not in READABLE_FORMATS:
        raise ValueError(f"{path}: not a jax_epilog decisions table (expected format "
                         f"{' or '.join(map(repr, READABLE_FORMATS))}, got {found!r})")
    return tuple(Table(t["device"], t.get("cublaslt_version"),
                       tuple(Entry(**{**e, "choice": decide_from_times(e["seconds"])})
                             for e in t["entries"]),
                       tuple(StackEntry.from_dict(e) for e in t.get("stacks", ())),
                       tuple(ServingEntry.from_dict(e) for e in t.get("serving", ())))
                 for t in data["tables"])


def read_tables(path: Path) -> tuple[Table, ...]:
    """The tables in `path`: none if it does not exist or cannot be read (a warning says why)."""
    path = Path(path)
    try:
        return _parse(path.read_text(), path)
    except FileNotFoundError:
        return ()
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"jax_epilog: ignoring the decisions table {path}: {e}", RuntimeWarning,
                      stacklevel=2)
        return ()


load_tables = functools.cache(read_tables)  # what `choose` reads, once per process


def section(tables: Iterable[Table], device: str, version: Optional[int]) -> Optional[Table]:
    """This GPU's table with this cuBLASLt version, else this GPU's newest."""
    mine = [t for t in tables if t.device == device]
    exact = [t for t in mine if t.cublaslt_version == version]
    if exact:
        return exact[0]
    return max(mine, key=lambda t: t.cublaslt_version or 0, default=None)


def dump(tables: Iterable[Table]) -> str:
    """JSON with one entry per line, sorted, so that a table's changes read well in a diff."""
    def listed(entries, order) -> str:
        lines = ",\n".join("    " + json.dumps(e.as_dict()) for e in sorted(entries, key=order))
        return f"[\n{lines}\n  ]" if lines else "[]"

    sections = []
    for t in tables:
        sections.append(f'  {{"device": {json.dumps(t.device)}, "cublaslt_version": '
                        f'{json.dumps(t.cublaslt_version)}, '
                        f'"entries": {listed(t.entries, lambda e: e.key)}, '
                        f'"stacks": {listed(t.stacks, lambda e: e.key.order)}, '
                        f'"serving": {listed(t.serving, lambda e: e.key)}}}')
    return f'{{"format": {json.dumps(FORMAT)}, "tables": [\n' + ",\n".join(sections) + "\n]}\n"


@contextlib.contextmanager
def locked(folder: Path):
    """Serialises read-merge-write of the tables in `folder` between processes (a lock on the
    folder itself, so no lock file is left beside a table)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
