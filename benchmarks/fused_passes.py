"""The fused FP8 passes (issue 63; docs/fp8.md, "Fused passes"): each CUDA kernel of the library
against XLA's fusion of what the layers run today, one process, one timer
(`timing.time_interleaved`, the two engines' rounds interleaved, inputs rotated past L2).

Passes, per row of tensors:

- `quantize_transpose`: a 16-bit gradient `(M, N)` to e5m2 with its transposed copy, on current
  scaling (the FP8 stack's dZ, SwiGLU's dy): XLA's `quantize_scaled` then the transpose the
  weight gradient reads, against an amax reduction then `cast_transpose`.
- `swiglu_forward`: `[g u]` `(M, 2F)` to h8, g8, u8 (e4m3, each on its own amax), as
  `swiglu._fp8_forward` does with XLA's fusions, against `fused_swiglu.swiglu_forward`.
- `swiglu_backward`: dh `(M, F)` with the saved g8, u8 to `[dg du]` in e5m2 and its transposed
  copy, as `swiglu._fp8_block_bwd` does, against `fused_swiglu.swiglu_gradient`.
- `swiglu_step`: the FP8 SwiGLU block's whole training step (`jax_epilog.swiglu`, current
  scaling, value and gradients), traced with each engine: what the passes add up to.

Rows: the SwiGLU block's S1 (8192 tokens, D 2048, F 8192) and S2 (16384, 4096, 14336),
`llama_large`'s EX (16384, 4096, 11008), and M1's stack gradient (65536 x 4096). Reported per
pass and row: each engine's time, the bytes the pass must move at least (each input read once
per pass it needs, each output written once), the bandwidth that achieves, as a fraction of a
copy's measured bandwidth on this GPU (one read, one write), and XLA's time over the kernels'.

    python benchmarks/fused_passes.py --out benchmarks/results/fused_passes   # GPU
    python benchmarks/fused_passes.py --smoke --out /tmp/fused_smoke          # CPU: XLA only
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import jax
import jax.numpy as jnp

import timing
from jax_epilog import Fp8
from jax_epilog.float8 import fused
from jax_epilog.float8.scaling import quantize_scaled, reduced_amaxes
from jax_epilog.layers import fused_swiglu, gating, swiglu

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
DTYPE = jnp.bfloat16
#: name -> (tokens, D, F); M1 has no SwiGLU (F None): its stack's gradient only.
ROWS = {"S1": (8192, 2048, 8192), "S2": (16384, 4096, 14336), "EX": (16384, 4096, 11008),
        "M1": (65536, 4096, None)}
SMOKE_ROWS = {"T1": (129, 48, 80), "T2": (64, 32, None)}
PASSES = ("quantize_transpose", "swiglu_forward", "swiglu_backward", "swiglu_step")
#: The cards' HBM bandwidth as NVIDIA states it (bytes/s), by a part of JAX's device kind.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12,
                  "H100 PCIe": 2.0e12}


def peak_bandwidth() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in PEAK_BANDWIDTH.items() if k in kind), None)


# --- the passes: (XLA's way, the kernels' way, operands, least bytes moved) -----------------

def _quantize_transpose(m: int, n: int, key):
    dz = jax.random.normal(key, (m, n), DTYPE)

    def xla(dz):  # as the layers make dZ8 and, for the weight gradient, dZ8ᵀ
        dz8, scale, dz_amax = quantize_scaled(dz, E5M2, 0)
        return dz8, dz8.T, scale, dz_amax

    def kernels(dz):
        return fused.quantize_transpose(dz, E5M2, 0)

    # an amax pass and the cast-transpose: dZ read twice, two FP8 copies written
    return xla, kernels, (dz,), 2 * (2 * m * n) + 2 * m * n


def _swiglu_forward(m: int, f: int, key):
    gu = jax.random.normal(key, (m, 2 * f), DTYPE)

    def xla(gu):  # swiglu._fp8_forward's fusions (keep=True)
        h = gating.hidden(gu, f)
        halves = (gu[:, :f], gu[:, f:])
        h_amax, *half_amaxes = reduced_amaxes([h, *halves], None, one_pass=True)
        outs = [quantize_scaled(h, E4M3, 0, x_amax=h_amax)]
        outs += [quantize_scaled(v, E4M3, 0, x_amax=a) for v, a in zip(halves, half_amaxes)]
        return outs

    def kernels(gu):
        return fused_swiglu.swiglu_forward(gu, E4M3, 0)

    # [g u] read by the amax pass and the quantize pass; h8, g8, u8 written
    return xla, kernels, (gu,), 2 * (2 * m * 2 * f) + 3 * m * f


def _swiglu_backward(m: int, f: int, key):
    keys = jax.random.split(key, 3)
    dh = jax.random.normal(keys[0], (m, f), DTYPE)
    g8, u8 = (jax.random.normal(k, (m, f), jnp.float32).astype(E4M3) for k in keys[1:])
    g_scale, u_scale = jnp.float32(0.02), jnp.float32(0.03)

    def xla(dh, g8, u8, g_scale, u_scale):  # swiglu._fp8_block_bwd's fusions
        g, u = g8.astype(jnp.float32) * g_scale, u8.astype(jnp.float32) * u_scale
        saved = SimpleNamespace(g8=g8, g_scale=g_scale, u8=u8, u_scale=u_scale)
        dgu8, scale, dgu_amax = quantize_scaled(
            gating.hidden_gradient(dh, g, u, dh.dtype), E5M2, 0,
            x_amax=reduced_amaxes([swiglu._gradient_bound(dh, saved)], None)[0])
        return dgu8, dgu8.T, scale, dgu_amax

    def kernels(dh, g8, u8, g_scale, u_scale):
        return fused_swiglu.swiglu_gradient(dh, g8, g_scale, u8, u_scale, E5M2, 0)

    # dh, g8, u8 read by both passes; [dg du]8 and its transposed copy written
    return xla, kernels, (dh, g8, u8, g_scale, u_scale), 2 * (4 * m * f) + 4 * m * f


def _swiglu_step(m: int, d: int, f: int, key):
    """The FP8 SwiGLU block's training step (`jax_epilog.swiglu`, current scaling), whole:
    what the passes are for. No least bytes (its GEMMs dominate)."""
    keys = jax.random.split(key, 3)
    x = jax.random.normal(keys[0], (m, d), DTYPE)
    gate_up = (jax.random.normal(keys[1], (d, 2 * f), jnp.float32) * d ** -0.5).astype(DTYPE)
    down = (jax.random.normal(keys[2], (f, d), jnp.float32) * f ** -0.5).astype(DTYPE)
    fp8 = Fp8(layers="all", scaling="current")

    def step(x, gate_up, down):
        loss = lambda *a: jnp.mean(swiglu.swiglu(*a, fp8=fp8).astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, gate_up, down)

    return step, step, (x, gate_up, down), None


def _cases(rows: dict) -> list[tuple[str, str, Callable]]:
    """(pass, row, maker) for every pass a row has, the whole steps last."""
    cases, steps = [], []
    for name, (tokens, d, f) in rows.items():
        cases.append(("quantize_transpose", name,
                      lambda k, t=tokens, d=d: _quantize_transpose(t, d, k)))
        if f is not None:
            cases.append(("swiglu_forward", name,
                          lambda k, t=tokens, f=f: _swiglu_forward(t, f, k)))
            cases.append(("swiglu_backward", name,
                          lambda k, t=tokens, f=f: _swiglu_backward(t, f, k)))
            steps.append(("swiglu_step", name,
                          lambda k, t=tokens, d=d, f=f: _swiglu_step(t, d, f, k)))
    return cases + steps


def _compiled(fn, args, engine: str):
    """fn jitted and compiled with JAX_EPILOG_FUSED_PASSES=engine (read while tracing)."""
    before = os.environ.get("JAX_EPILOG_FUSED_PASSES")
    os.environ["JAX_EPILOG_FUSED_PASSES"] = engine
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        if before is None:
            os.environ.pop("JAX_EPILOG_FUSED_PASSES", None)
        else:
            os.environ["JAX_EPILOG_FUSED_PASSES"] = before


def copy_bandwidth(megabytes: int) -> float:
    """Bytes per second of `a * 2` over a float32 array (one read, one write)."""
    x = jax.block_until_ready(jnp.ones((megabytes * 2**20 // 4,), jnp.float32))
    t = timing.time_calls(jax.jit(lambda a: a * 2), [(x,)], rounds=5)
    return 2 * x.nbytes / t.seconds


def run(rows: dict, passes, rounds: int, copy_megabytes: int, out: Path) -> dict[str, Any]:
    """Every case of `rows` among `passes`, the report rewritten into `out` after each (so a
    run cut short keeps what it measured)."""
    reason = fused.unavailable_reason()
    bandwidth, peak = copy_bandwidth(copy_megabytes), peak_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, the card's "
          f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}; kernels: "
          f"{'available' if reason is None else 'unavailable (' + reason + ')'}", flush=True)
    results, errors = [], []
    report = {"metadata": timing.run_metadata(), "copy_bandwidth": bandwidth,
              "peak_bandwidth": peak, "kernels_unavailable": reason, "results": results,
              "errors": errors}
    for i, (name, row, make) in enumerate(_cases(rows)):
        if name not in passes:
            continue
        try:
            xla, kernels, args, least = make(jax.random.key(i))
            args = jax.block_until_ready(args)
            per_call = sum(getattr(a, "nbytes", 0) for a in args)
            copies = [jax.tree.map(jnp.copy, args) for _ in
                      range(timing.input_copies(max(1, per_call)))]
            calls = {"xla": (_compiled(xla, args, "xla"), copies)}
            if reason is None:
                calls["cuda"] = (_compiled(kernels, args, "cuda"), copies)
            start = time.perf_counter()
            measured = timing.time_interleaved(calls, rounds=rounds)
            entry = {"pass": name, "row": row, "shapes": [list(a.shape) for a in args],
                     "least_bytes": least, "seconds": time.perf_counter() - start}
            for engine, t in measured.items():
                rate = None if least is None else least / t.seconds
                entry[engine] = {**t.as_dict(), "ms": t.seconds * 1e3, "bandwidth": rate,
                                 "of_copy": None if rate is None else rate / bandwidth,
                                 "of_peak": None if rate is None or peak is None else rate / peak}
            if "cuda" in entry:
                entry["speedup"] = entry["xla"]["ms"] / entry["cuda"]["ms"]
            results.append(entry)
            print(_line(entry), flush=True)
        except Exception as e:  # noqa: BLE001 - one failing case costs its row only
            errors.append(f"{name} {row}: {type(e).__name__}: {e}")
            print("ERROR", errors[-1], flush=True)
        timing.write_report(report, out, "fused_passes", render)
    return report


def _line(e: dict) -> str:
    def engine(k):
        if k not in e:
            return f"{k} n/a"
        if e[k]["bandwidth"] is None:
            return f"{k} {e[k]['ms']:.3f} ms"
        peak = "" if e[k]["of_peak"] is None else f", {100 * e[k]['of_peak']:.0f}% of peak"
        return f"{k} {e[k]['ms']:.3f} ms {e[k]['bandwidth'] / 1e9:.0f} GB/s " \
               f"({100 * e[k]['of_copy']:.0f}% of copy{peak})"
    speedup = f" xla/cuda {e['speedup']:.2f}x" if "speedup" in e else ""
    least = "n/a" if e["least_bytes"] is None else f"{e['least_bytes'] / 1e6:.1f}"
    return f"{e['pass']:<20} {e['row']:<3} {least:>9} MB  " \
           f"{engine('xla')}  {engine('cuda')}{speedup}"


def render(report: dict) -> str:
    peak = report["peak_bandwidth"]
    lines = ["# Fused FP8 passes: the library's CUDA kernels against XLA's fusions", "",
             timing.provenance(report["metadata"],
                               f"copy {report['copy_bandwidth'] / 1e9:.0f} GB/s",
                               "peak " + ("unknown" if peak is None else
                                          f"{peak / 1e9:.0f} GB/s")), ""]
    if report["kernels_unavailable"]:
        lines += [f"The kernels did not run: {report['kernels_unavailable']}.", ""]
    lines += ["| pass | row | least MB | XLA ms | XLA GB/s (of copy, of peak) | kernels ms | "
              "kernels GB/s (of copy, of peak) | XLA / kernels |",
              "|---|---|---|---|---|---|---|---|"]
    for e in report["results"]:
        def cells(k):
            if k not in e:
                return ["n/a", "n/a"]
            if e[k]["bandwidth"] is None:
                return [f"{e[k]['ms']:.3f}", "n/a"]
            peak = "" if e[k]["of_peak"] is None else f", {100 * e[k]['of_peak']:.0f}%"
            return [f"{e[k]['ms']:.3f}",
                    f"{e[k]['bandwidth'] / 1e9:.0f} ({100 * e[k]['of_copy']:.0f}%{peak})"]
        least = "n/a" if e["least_bytes"] is None else f"{e['least_bytes'] / 1e6:.1f}"
        lines.append("| " + " | ".join([e["pass"], e["row"], least,
                                        *cells("xla"), *cells("cuda"),
                                        f"{e['speedup']:.2f}" if "speedup" in e else "n/a"])
                     + " |")
    lines += ["", "Least bytes: each input read once per pass that needs it (the amax pass and "
              "the quantizing pass), each output written once; bandwidth = least bytes / time."]
    if report["errors"]:
        lines += ["", "Errors:", *[f"- {e}" for e in report["errors"]]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fused_passes"))
    parser.add_argument("--rows", help="comma-separated, of: " + ", ".join(ROWS))
    parser.add_argument("--passes", help="comma-separated, of: " + ", ".join(PASSES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    args = parser.parse_args(argv)
    table = SMOKE_ROWS if args.smoke else ROWS
    rows = _pick(parser, "rows", args.rows, table)
    passes = _pick(parser, "passes", args.passes, dict.fromkeys(PASSES))
    return run({n: table[n] for n in rows}, passes, args.rounds, 16 if args.smoke else 1024,
               args.out)


def _pick(parser, name: str, value, known) -> list[str]:
    if not value:
        return list(known)
    picked = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in picked if v not in known]
    if unknown:
        parser.error(f"--{name}: unknown {unknown}; expected some of {', '.join(known)}")
    return picked


if __name__ == "__main__":
    main()
