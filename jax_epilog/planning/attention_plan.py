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

Imports only JAX and the standard library.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import NamedTuple, Optional

import jax

#: An FP8 cache's layouts (`layers.kv_cache`).
LAYOUTS = ("positions_major", "heads_major", "heads_major_rows")
#: How a decode step reads an FP8 cache.
READS = ("reduce", "dots")
#: The shipped table.
TABLE_PATH = Path(__file__).with_name("tables") / "attention" / "decode.json"
TABLE_FORMAT = 1


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
def _device() -> Optional[str]:
    """This host's first CUDA device's model, or None."""
    try:
        return jax.devices("cuda")[0].device_kind
    except (RuntimeError, IndexError):
        return None


@functools.cache
def read_table(path: Path = TABLE_PATH) -> tuple[dict, ...]:
    """The sections of a decode-attention table file (none where it does not exist)."""
    if not path.exists():
        return ()
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
        raise ValueError(f"{path}: expected a decode-attention table of format {TABLE_FORMAT}")
    return tuple(data["sections"])


def _section(sections, device: str) -> Optional[dict]:
    for section in sections:
        if section["device"] == device:
            return section
    return sections[0] if sections else None


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


def decode_plan(query_heads: int, kv_heads: int, batch: int, context: int, *,
                layout: Optional[str] = None, device: Optional[str] = "auto",
                path: Path = TABLE_PATH) -> DecodePlan:
    """The read form and layout for an FP8 cache of `kv_heads` read by `query_heads` at
    `batch` sequences of `context` positions. `layout`: the cache's, where it is made already
    (then the fastest read measured in that layout). `device`: a GPU model as JAX names it,
    "auto" (this host's) or None (off a GPU: the constant rule)."""
    device = _device() if device == "auto" else device
    constant = constant_plan(query_heads, kv_heads)
    section = _section(read_table(path), device) if device is not None else None
    entry = nearest_entry(section["entries"], query_heads // kv_heads, batch, context) \
        if section else None
    if entry is None:
        return constant if layout is None else constant._replace(layout=layout)
    where = (f"{section['device']}'s {'measured' if section.get('measured') else 'seeded'} "
             f"cell {entry['query_heads']}/{entry['kv_heads']} heads, batch {entry['batch']}, "
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


def section_from_report(report: dict) -> dict:
    """A table section from `benchmarks/decode_matrix.py`'s report: one entry per measured
    cell with its fastest FP8 read and layout and every variant's seconds per step."""
    entries = []
    for cell in report["cells"]:
        seconds = {name: timed["seconds"] for name, timed in cell["variants"].items()
                   if timed.get("seconds") is not None}
        best = best_fp8(seconds)
        if best is None:
            continue
        entries.append({key: cell[key] for key in ("query_heads", "kv_heads", "head_dim",
                                                   "batch", "context")} |
                       {"read": best[0], "layout": best[1], "seconds": seconds})
    meta = report["meta"]
    return {"device": meta["device"], "measured": True,
            "source": f"benchmarks/decode_matrix.py at {meta.get('commit')}, jax "
                      f"{meta.get('jax')}, {meta.get('date')}: {meta.get('command')}",
            "entries": entries}


def write_section(section: dict, path: Path = TABLE_PATH) -> None:
    """`path` with `section` in place of the section of its device (first if new)."""
    sections = [s for s in (read_table.__wrapped__(path) if path.exists() else ())
                if s["device"] != section["device"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": TABLE_FORMAT, "sections": [section] + sections},
                               indent=1) + "\n")
    read_table.cache_clear()
