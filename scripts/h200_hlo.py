"""Compile a program for an H200 on a machine without a GPU, and list the kernels XLA made.

XLA compiles for a GPU it is only told about (JAX's deviceless ahead-of-time compilation: a
topology from a GPU target description, arrays placed on it abstractly), so the fusions,
custom calls and temporaries of the program an H200 would run can be read on a CPU machine:
which passes a step makes over which arrays, and how many bytes each moves. Nothing runs, so
nothing here is a time; the compiled memory use matches the GPU's (the SwiGLU block's FP8 step
at 16384 x 4096 x 11008: 1182 MiB of temporaries here and on the H200).

Needs JAX's CUDA plugin (`pip install "jax[cuda13]"`, no GPU or driver needed) and, for
programs with jax-epilog's custom calls, the package built with its C++ handler
(`JAX_EPILOG_BUILD_CUDA=1 pip install --no-build-isolation .`), whose targets XLA must find.
XLA's autotuning needs a GPU, so GEMM fusions keep their default configurations.

    python scripts/h200_hlo.py decode --layout heads_major_rows --batch 64
    python scripts/h200_hlo.py swiglu --variant ours_swiglu_fp8 --rows EX --hlo /tmp/step.hlo
    python scripts/h200_hlo.py train --config llama_large --layers 1 --variant flax_fp8
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent

#: The GPU XLA compiles for: an H200 (132 SMs, compute capability 9.0, 4.8 TB/s, 50 MiB of
#: L2), with the CUDA and cuDNN versions of the H200 this project measures on.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""

#: Bytes per element of the HLO types a kernel reads or writes.
_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1, "pred": 1}
#: Entry instructions that launch nothing.
_NO_KERNEL = ("parameter", "tuple", "get-tuple-element", "bitcast", "constant")


def array_bytes(types: str) -> int:
    """The bytes of every array in an HLO type string, e.g. "(bf16[4,8]{1,0}, u8[16]{0})"."""
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", types):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _BYTES.get(dtype, 0)
    return total


def kernels(hlo: str) -> list[dict]:
    """The entry computation's instructions that launch work, in order: name, what (custom
    call target, fusion backend kind, or opcode), the output's type, bytes read (its
    operands') and written (its outputs'), and whether it is a GEMM. An in-place update
    (a dynamic-update-slice, fused or not) moves only its update: its first operand, the
    array updated, is neither read nor written whole."""
    entry = hlo[hlo.index("\nENTRY"):].split("\n}", 1)[0].splitlines()[1:]
    types: dict[str, str] = {}
    found = []
    for line in entry:
        match = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$", line)
        if not match:
            continue
        name, output, opcode, rest = match.groups()
        types[name] = output
        if opcode in _NO_KERNEL:
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kind = re.search(r'"kind":"(\w+)"', line)
        what = target.group(1) if target else kind.group(1) if kind else opcode
        read = sum(array_bytes(types.get(o, "")) for o in operands)
        written = array_bytes(output)
        if "dynamic_update_slice" in name or opcode == "dynamic-update-slice":
            read -= array_bytes(types.get(operands[0], ""))
            written = read
        found.append({"name": name, "what": what,
                      "output": re.sub(r"\{[^}]*\}", "", output), "read": read,
                      "written": written, "gemm": bool(re.search(r"matmul|gemm|cublas", what))})
    return found


def table(found: list[dict], bandwidth: float = 3.0e12) -> str:
    """`kernels` as text, with the non-GEMM bytes and what they take at `bandwidth` B/s
    (about what the H200's fusions reach, not its 4.8 TB/s peak)."""
    lines = [f"{'kernel':36s} {'what':30s} {'output':44s} {'read MiB':>9s} {'written':>9s}"]
    moved = 0
    for k in found:
        moved += 0 if k["gemm"] else k["read"] + k["written"]
        lines.append(f"{k['name'][:36]:36s} {k['what'][:30]:30s} {k['output'][:44]:44s} "
                     f"{k['read'] / 2**20:9.1f} {k['written'] / 2**20:9.1f}"
                     + ("  GEMM" if k["gemm"] else ""))
    lines.append(f"{len(found)} kernels; outside the GEMMs {moved / 2**30:.2f} GiB moved, "
                 f"{moved / bandwidth * 1e3:.2f} ms at {bandwidth / 1e12:.1f} TB/s")
    return "\n".join(lines)


def h200_sharding():
    """A sharding that places an array on one abstract H200 (no device needed). JAX's CUDA
    plugin must have started with JAX_SKIP_CUDA_CONSTRAINTS_CHECK set (`main` sets it): its
    version checks need a driver."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec
    topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                            topology="1x1x1")
    return NamedSharding(topologies.make_mesh(topology, (1,), ("gpu",)), PartitionSpec())


def compile_for_h200(fn, *args, donate_argnums=()):
    """`jax.jit(fn)` compiled for an H200, `args` (arrays or `ShapeDtypeStruct`s, in pytrees)
    placed on it abstractly."""
    import jax
    sharding = h200_sharding()
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jax.numpy.shape(a), a.dtype, sharding=sharding), args)
    return jax.jit(fn, donate_argnums=donate_argnums).lower(*abstract).compile()


def _load_handler() -> None:
    """jax-epilog's FFI targets registered (the library loads only where a driver is, by
    default); its support queries then answer "cannot ask" and the lowering trusts them."""
    from jax_epilog.runtime import library
    if library.library().handle is None:
        print(f"jax-epilog's handler is not loaded ({library.unavailable_reason()}): programs "
              "with its custom calls will not compile", file=sys.stderr)


def decode_step(args):
    """One decode step of the GPT example's epilog_fp8 over an FP8 cache."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import configs, decode, generate
    config = configs.CONFIGS[args.config].replace(n_layers=args.layers)
    weights = generate.serving_weights(config, None, jnp.bfloat16)
    cached = generate.build_variant(args.variant, config, weights, jnp.bfloat16,
                                    weight_scales=args.weight_scales)
    cache_dtype = jnp.float8_e4m3fn if args.variant == "epilog_fp8" else jnp.bfloat16
    generator = decode.Generator(cached, cache_dtype=cache_dtype, cache_layout=args.layout)
    max_len = args.max_len or min(384, config.model.seq_len)  # generate.py's 128 + 256
    cache = jax.eval_shape(lambda: generator.new_cache(args.batch, max_len))
    tokens = jax.ShapeDtypeStruct((args.batch, 1), jnp.int32)
    return compile_for_h200(generator._forward_and_sample, generator.state, cache, tokens,
                            jnp.int32(0), jax.random.key(0), donate_argnums=1)


def swiglu_step(args):
    """A training step of `x + SwiGLU(RMSNorm(x))` as benchmarks/swiglu_bench.py times it."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8_peer
    import swiglu_bench
    tokens, d, f = swiglu_bench.ROWS[args.rows]
    model = swiglu_bench.VARIANTS[args.variant](f)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(1), jnp.zeros((2, d),
                                                                               jnp.bfloat16)))
    return compile_for_h200(fp8_peer.make_step(model), variables,
                            jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16))


def train_step(args):
    """A training step of the GPT example (examples/gpt/train.py's `Trainer`), `--layers` of
    the config's blocks."""
    import jax.numpy as jnp
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import compare, configs, train
    config = configs.CONFIGS[args.config].replace(n_layers=args.layers)
    variants = {name: (impl, fp8) for name, impl, fp8 in compare.VARIANTS}
    if args.variant not in variants:
        raise SystemExit(f"--variant: expected one of {sorted(variants)}")
    impl, fp8 = variants[args.variant]
    model = train.build_model(config, impl, fp8=bool(fp8), dtype=jnp.bfloat16,
                              fp8_scaling=fp8 or "per-tensor", attention=args.attention)
    trainer = train.Trainer(model, train.make_optimizer(config))
    shape = (config.batch_size, config.model.seq_len)
    batch = (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32))
    return compile_for_h200(trainer._step, trainer.initial, *batch, donate_argnums=0)


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hlo", type=Path, help="also write the compiled HLO text here")
    programs = parser.add_subparsers(dest="program", required=True)
    decode = programs.add_parser("decode", help=decode_step.__doc__)
    decode.add_argument("--config", default="large")
    decode.add_argument("--layers", type=int, default=1)
    decode.add_argument("--variant", default="epilog_fp8", choices=("stock", "epilog_fp8"))
    decode.add_argument("--layout", default="heads_major")
    decode.add_argument("--weight-scales", default="tensor", choices=("tensor", "channel"))
    decode.add_argument("--batch", type=int, default=64)
    decode.add_argument("--max-len", type=int, help="the cache's positions (default: 384, or "
                        "the model's seq_len where shorter)")
    swiglu = programs.add_parser("swiglu", help=swiglu_step.__doc__)
    swiglu.add_argument("--variant", default="ours_swiglu_fp8")
    swiglu.add_argument("--rows", default="EX", help="S1, S2 or EX (swiglu_bench.ROWS)")
    train = programs.add_parser("train", help=train_step.__doc__)
    train.add_argument("--config", default="llama_large")
    train.add_argument("--layers", type=int, default=1)
    train.add_argument("--variant", default="epilog_fp8",
                       help="a compare.py variant: stock, flax_fp8, epilog, epilog_fp8, ...")
    train.add_argument("--attention", default="cudnn", choices=("cudnn", "xla"),
                       help="the blocks' attention (the example's auto is cuDNN's on a GPU)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before JAX's plugin starts
    try:
        import jax_epilog  # noqa: F401  (the installed package, where its handler was built)
    except ImportError:
        sys.path.insert(0, str(ROOT))  # the checkout's sources (no handler)
    _load_handler()
    compiled = {"decode": decode_step, "swiglu": swiglu_step, "train": train_step}[
        args.program](args)
    hlo = compiled.as_text()
    if args.hlo is not None:
        args.hlo.write_text(hlo)
    memory = compiled.memory_analysis()
    text = table(kernels(hlo)) + (
        f"\ntemporaries {memory.temp_size_in_bytes / 2**20:.1f} MiB" if memory else "")
    print(text)
    return text


if __name__ == "__main__":
    main()
