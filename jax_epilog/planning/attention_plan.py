"""How a decode step reads an FP8 KV cache, and how that cache is laid out: `decode_plan`.

Two read forms compute the same attention of a few queries over an FP8 cache:

- "reduce": multiply-reduces that read the FP8 bytes as they are (a dot would want a 16-bit
  copy of the cache first), the key scales multiplying the scores and the value scales the
  probabilities; it reads one query per sequence (a multi-token call reads by "dots");
- "dots": two batched dots over the cache converted where the dot reads it (a convert XLA's
  GPU GEMM fusion can take into the GEMM), the scales applied as there.

Which wins depends on the architecture, the batch and the context (with groups of query
heads per key head, a group is one dot's rows, where the multiply-reduces broadcast each key
over the group), and on the GPU. So the choice is made from measurements
(`benchmarks/decode_matrix.py`, its H100 run in `benchmarks/results/decode_matrix/`) kept in
`tables/attention/decode.json`: per GPU model, cells of (query heads per key head, batch,
context) with the fastest FP8 read and layout and each one's time. The nearest cell decides:
first the nearest group size, then the nearest batch and context (the largest |log ratio|).
A GPU with no section of its own uses the first section (the reference card). Off a GPU (or
with no table) a constant rule decides: "dots" over "heads_major", the read that was at
least as fast as "reduce" in every cell of the measured matrix where the step was not
launch-bound. `decode_attention(read=...)` and `init_kv_cache(layout=...)` override it.

Before the shipped table, the user's own (`user_table_path()`: next to the user's decision
table, `JAX_EPILOG_DECISIONS`), which `python -m jax_epilog.tune --serving` writes with cells
of the user's own attention measured on their GPU (`tools.attention_tune`): its section of
this GPU decides where it has a cell of the same group size with batch and context each
within a factor of `USER_NEAR`.

Imports only JAX, the standard library and `runtime.settings`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from pathlib import Path
from typing import NamedTuple, Optional

import jax

from jax_epilog.runtime import settings

#: An FP8 cache's layouts (`layers.kv_cache`).
LAYOUTS = ("positions_major", "heads_major", "heads_major_rows")
#: How a decode step reads an FP8 cache.
READS = ("reduce", "dots")
#: The shipped table.
TABLE_PATH = Path(__file__).with_name("tables") / "attention" / "decode.json"
TABLE_FORMAT = 1
#: A user's cell decides for a batch and a context each within this factor of its own.
USER_NEAR = 2
#: What makes two entries the same cell.
CELL_KEYS = ("query_heads", "kv_heads", "head_dim", "batch", "context")


class DecodePlan(NamedTuple):
    """An FP8 cache's read form and layout, and what decided them."""

    read: str
    layout: str
    why: str


def variant_name(read: str, layout: str) -> str:
    """The name of an FP8 read in a table entry's and the benchmark's times: "fp8 dots
    heads_major"."""
    return f"fp8 {read} {layout}"


def constant_plan(query_heads: int, kv_heads: int) -> DecodePlan:
    """The rule without a measurement: "dots" over a heads-major cache, for every grouping of
    `query_heads` over `kv_heads` (both kept for the signature's sake: a measured table's
    cells are chosen by them)."""
    del query_heads, kv_heads
    return DecodePlan("dots", "heads_major", "the constant rule (dots over heads_major)")


@functools.cache
def cuda_device() -> Optional[str]:
    """This host's first CUDA device's model, or None."""
    try:
        return jax.devices("cuda")[0].device_kind
    except (RuntimeError, IndexError):
        return None


def user_table_path(decisions_file: Optional[Path] = None) -> Optional[Path]:
    """The user's decode-attention table: `<stem>_attention.json` next to `decisions_file`
    (default: the user's decision table, `settings.decisions_path()`); None where there is
    none."""
    path = decisions_file if decisions_file is not None else settings.decisions_path()
    return None if path is None else Path(path).with_name(Path(path).stem + "_attention.json")


@functools.cache
def read_table(path: Path = TABLE_PATH) -> tuple[dict, ...]:
    """The sections of a decode-attention table file (none where it does not exist)."""
    if not path.exists():
        return ()
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a decode-attention table ({error}); remove it or run "
                         "python -m jax_epilog.tune --serving again") from None
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: expected a decode-attention table of format {TABLE_FORMAT}")
    return tuple(data["sections"])


def _section(sections, device: str, *, fallback: bool = True) -> Optional[dict]:
    """The section of `device`, else (with `fallback`) the first."""
    for section in sections:
        if section["device"] == device:
            return section
    return sections[0] if sections and fallback else None


def _log_ratio(a: float, b: float) -> float:
    return abs(math.log(max(a, 1) / max(b, 1)))


def nearest_entry(entries, group: int, batch: int, context: int) -> Optional[dict]:
    """The entry of the nearest group size, then of the nearest batch and context (the
    larger |log ratio| of the two, ties broken by their sum: a context far from every cell
    must not make all batches equally near)."""
    def distance(e):
        ratios = (_log_ratio(e["batch"], batch), _log_ratio(e["context"], context))
        return (round(_log_ratio(e["query_heads"] / e["kv_heads"], group), 6),
                round(max(ratios), 6), sum(ratios))
    return min(entries, key=distance, default=None)


def _user_entry(path: Optional[Path], device: str, group: int, batch: int, context: int,
                head_dim: Optional[int]) -> tuple[Optional[dict], Optional[dict]]:
    """(the user's section of `device`, its entry deciding here) or Nones: a cell of the same
    group size (and `head_dim`, where given), batch and context each within `USER_NEAR`."""
    section = _section(read_table(path), device, fallback=False) if path is not None else None
    entries = [e for e in section["entries"] if head_dim in (None, e["head_dim"])] \
        if section else ()
    entry = nearest_entry(entries, group, batch, context)
    near = math.log(USER_NEAR) + 1e-9
    if entry is None or entry["query_heads"] // entry["kv_heads"] != group or \
            _log_ratio(entry["batch"], batch) > near or \
            _log_ratio(entry["context"], context) > near:
        return None, None
    return section, entry


def decode_plan(query_heads: int, kv_heads: int, batch: int, context: int, *,
                layout: Optional[str] = None, device: Optional[str] = "auto",
                path: Path = TABLE_PATH, user_path: Optional[Path] = "auto",
                head_dim: Optional[int] = None) -> DecodePlan:
    """The read form and layout for an FP8 cache of `kv_heads` read by `query_heads` at
    `batch` sequences of `context` positions. `layout`: the cache's, where it is made already
    (then the fastest read measured in that layout). `device`: a GPU model as JAX names it,
    "auto" (this host's) or None (off a GPU: the constant rule). `user_path`: the user's
    table ("auto": `user_table_path()`; None: none), read before the shipped `path`; its
    cells decide only for their own `head_dim` where it is given."""
    device = cuda_device() if device == "auto" else device
    constant = constant_plan(query_heads, kv_heads)
    if device is None:
        return constant if layout is None else constant._replace(layout=layout)
    group = query_heads // kv_heads
    user_path = user_table_path() if user_path == "auto" else user_path
    section, entry = _user_entry(user_path, device, group, batch, context, head_dim)
    owner = "your"
    if entry is None:
        section = _section(read_table(path), device)
        entry = nearest_entry(section["entries"], group, batch, context) if section else None
        owner = f"{section['device']}'s" if section else None
    if entry is None:
        return constant if layout is None else constant._replace(layout=layout)
    kind = "measured" if section.get("measured") else "seeded"
    where = (f"{owner} {kind} cell "
             f"{entry['query_heads']}/{entry['kv_heads']} heads, batch {entry['batch']}, "
             f"context {entry['context']}")
    if layout is None or layout == entry["layout"]:
        return DecodePlan(entry["read"], entry["layout"], where)
    seconds = entry.get("seconds") or {}
    timed = [(seconds[variant_name(read, layout)], read) for read in READS
             if variant_name(read, layout) in seconds]
    read = min(timed)[1] if timed else entry["read"]
    return DecodePlan(read, layout, where + f" ({layout} cache)")


# --- making the table from the benchmark's report ----------------------------------------

def best_fp8(seconds: dict) -> Optional[tuple[str, str]]:
    """(read, layout) of the fastest FP8 variant timed in `seconds`, or None."""
    timed = [(s, read, layout) for read in READS for layout in LAYOUTS
             if (s := seconds.get(variant_name(read, layout))) is not None]
    return min(timed)[1:] if timed else None


def entry_from_cell(cell: dict) -> Optional[dict]:
    """A table entry from a measured cell (`benchmarks/decode_matrix.py`'s report, or
    `tools.attention_tune.time_cell`'s): its sizes, its fastest FP8 read and layout and every
    variant's seconds per step; None where no FP8 variant ran."""
    seconds = {name: timed["seconds"] for name, timed in cell["variants"].items()
               if timed.get("seconds") is not None}
    best = best_fp8(seconds)
    if best is None:
        return None
    return {key: cell[key] for key in CELL_KEYS} | \
        {"read": best[0], "layout": best[1], "seconds": seconds}


def section_from_report(report: dict) -> dict:
    """A table section from `benchmarks/decode_matrix.py`'s report: one entry per measured
    cell (`entry_from_cell`)."""
    entries = [e for e in map(entry_from_cell, report["cells"]) if e is not None]
    meta = report["meta"]
    return {"device": meta["device"], "measured": True,
            "source": f"benchmarks/decode_matrix.py at {meta.get('commit')}, jax "
                      f"{meta.get('jax')}, {meta.get('date')}: {meta.get('command')}",
            "entries": entries}


def _sections_in(path: Path) -> tuple[dict, ...]:
    return read_table.__wrapped__(path) if path.exists() else ()


def write_section(section: dict, path: Path = TABLE_PATH) -> None:
    """`path` with `section` in place of the section of its device (first if new), written
    atomically (a temporary file renamed), so that a reader never sees half of it."""
    sections = [s for s in _sections_in(path) if s["device"] != section["device"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"format": TABLE_FORMAT, "sections": [section] + sections},
                               indent=1) + "\n")
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    read_table.cache_clear()


def merge_entries(path: Path, device: str, entries, source: str) -> dict:
    """`path`'s section of `device` with `entries` added, each replacing an entry of the same
    cell (`CELL_KEYS`), the others kept; written (`write_section`) and returned."""
    old = _section(_sections_in(Path(path)), device, fallback=False)
    key = lambda e: tuple(e[k] for k in CELL_KEYS)
    merged = {key(e): e for e in (old["entries"] if old else ())}
    merged.update((key(e), e) for e in entries)
    section = {"device": device, "measured": True, "source": source,
               "entries": list(merged.values())}
    write_section(section, Path(path))
    return section
