"""Checks the GPU wheel that scripts/build_gpu_wheel.sh builds, and says what it holds.

    python scripts/check_gpu_wheel.py WHEEL [--resolution REPORT.json]

The wheel must hold the compiled handler (`jax_epilog/libjax_epilog_ffi.so`, loaded with
ctypes, so not a CPython extension) and nothing grafted in by auditwheel (cuBLASLt and the
CUDA runtime are left out: NVIDIA's cu13 wheels provide them); be tagged
`py3-none-manylinux_2_NN_x86_64` (one wheel for every Python 3); and ask for what a GPU user
needs: jax, jaxlib and numpy, and with the `cuda` extra `jax[cuda13]`, whose CUDA plugin brings
NVIDIA's cuBLASLt and CUDA runtime wheels (`jax-cuda13-plugin[with-cuda]` requires
nvidia-cublas and nvidia-cuda-runtime). The wheel does not require those two itself: a user of
JAX with a local CUDA (`jax[cuda13-local]`) has them from the system.

`--resolution` takes pip's report of installing the wheel with that extra (`pip install
--dry-run --ignore-installed --report REPORT.json "WHEEL[cuda]"`) and checks that it brings
cuBLASLt and the CUDA runtime 13. Exit status 1, with the problems listed, if a check fails.
Needs only the standard library and `packaging`; tests/runtime/test_gpu_wheel.py runs it on a CPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

LIBRARY = "jax_epilog/libjax_epilog_ffi.so"
#: In a wheel built without the handler (build_backend/jax_epilog_build.py, REASON_FILE).
NO_HANDLER = "jax_epilog/_no_cuda_handler.txt"
TAG = re.compile(r"^py3-none-manylinux_2_(\d+)_x86_64$")
#: What the wheel requires unconditionally, and with the `cuda` extra.
REQUIRED = ("jax", "jaxlib", "numpy")
CUDA_EXTRA = ("cuda", "jax", "cuda13")
#: What a GPU user's install with the `cuda` extra must bring: the handler links their libraries.
CUDA_RUNTIME = ("nvidia-cublas", "nvidia-cuda-runtime")


def _dist_info(names: list[str], file: str) -> str | None:
    found = [n for n in names if n.count("/") == 1 and n.endswith(f".dist-info/{file}")]
    return found[0] if len(found) == 1 else None


def _headers(text: str, key: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.lower().startswith(key.lower() + ":")]


def read(wheel: Path) -> dict:
    """What the checks look at: the wheel's files, tags and requirements."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        wheel_file, metadata = _dist_info(names, "WHEEL"), _dist_info(names, "METADATA")
        wheel_text = z.read(wheel_file).decode() if wheel_file else ""
        metadata_text = z.read(metadata).decode() if metadata else ""
        library = z.getinfo(LIBRARY).file_size if LIBRARY in names else None
    return {"names": names, "tags": _headers(wheel_text, "Tag"),
            "purelib": _headers(wheel_text, "Root-Is-Purelib"),
            "requires": _headers(metadata_text, "Requires-Dist"), "library_bytes": library}


def problems(wheel: Path, resolution: dict | None = None) -> list[str]:
    """Everything wrong with `wheel` (and with pip's `resolution` report of its `cuda` extra)."""
    info, found = read(wheel), []
    if info["library_bytes"] is None:
        found.append(f"no {LIBRARY}: built without the handler")
    if NO_HANDLER in info["names"]:
        found.append(f"{NO_HANDLER} is there: the wheel says it was built without the handler")
    grafted = [n for n in info["names"] if n.split("/")[0].endswith(".libs")]
    if grafted:
        found.append(f"libraries grafted in by auditwheel (cuBLASLt and the CUDA runtime must be "
                     f"excluded, nothing else is expected): {', '.join(grafted)}")
    if len(info["tags"]) != 1 or not TAG.match(info["tags"][0]):
        found.append(f"tags {info['tags']}: expected one, py3-none-manylinux_2_NN_x86_64")
    elif not wheel.name.endswith(f"-{info['tags'][0]}.whl"):
        found.append(f"file name {wheel.name} does not end in its tag {info['tags'][0]}")
    if info["purelib"] != ["false"]:
        found.append(f"Root-Is-Purelib {info['purelib']}: expected false (a platform wheel)")
    requires = [Requirement(r) for r in info["requires"]]
    plain = {r.name for r in requires if r.marker is None}
    for name in REQUIRED:
        if name not in plain:
            found.append(f"Requires-Dist lacks {name}")
    extra, name, wanted = CUDA_EXTRA
    if not any(r.name == name and wanted in r.extras and r.marker is not None
               and r.marker.evaluate({"extra": extra}) for r in requires):
        found.append(f'Requires-Dist lacks {name}[{wanted}]; extra == "{extra}"')
    if resolution is not None:
        versions = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                    for item in resolution.get("install", [])}
        for name in CUDA_RUNTIME:
            if not versions.get(name, "").startswith("13."):
                found.append(f"installing the wheel with [{extra}] brings no {name} 13 "
                             f"(got {versions.get(name)})")
    return found


def describe(wheel: Path, resolution: dict | None = None) -> str:
    info, extra = read(wheel), CUDA_EXTRA[0]
    requires = [Requirement(r) for r in info["requires"]]
    others = sorted({m for r in requires if r.marker is not None
                     for m in re.findall(r'extra == "([^"]+)"', str(r.marker))} - {extra})
    lines = [f"{wheel} ({wheel.stat().st_size / 2**20:.2f} MiB)",
             f"  tag: {', '.join(info['tags'])}",
             f"  {LIBRARY}: {info['library_bytes']} bytes",
             "  Requires-Dist: " + ", ".join(str(r) for r in requires if r.marker is None) +
             f"; with [{extra}]: " + ", ".join(
                 str(r).split(";")[0] for r in requires
                 if r.marker is not None and r.marker.evaluate({"extra": extra})) +
             f" (and {len(others)} more extras: {', '.join(others)})"]
    if resolution is not None:
        versions = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                    for item in resolution.get("install", [])}
        lines.append(f"  [{CUDA_EXTRA[0]}] brings: " + ", ".join(
            f"{n} {versions.get(n)}" for n in ("jax", "jax-cuda13-plugin", *CUDA_RUNTIME)))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--resolution", type=Path,
                        help='pip\'s --report of installing "WHEEL[cuda]" (--dry-run)')
    args = parser.parse_args(argv)
    resolution = json.loads(args.resolution.read_text()) if args.resolution else None
    print(describe(args.wheel, resolution))
    found = problems(args.wheel, resolution)
    for problem in found:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
