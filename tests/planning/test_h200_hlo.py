"""scripts/h200_hlo.py: the kernel table of a compiled program (always), and a deviceless
compile for the H200 where JAX's CUDA plugin is installed (skipped elsewhere: CI has none)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("h200_hlo", ROOT / "scripts" / "h200_hlo.py")
h200_hlo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(h200_hlo)

# A compiled entry computation, as XLA prints it (cut down): a fusion, an in-place update of
# a cache, a custom-call GEMM with its workspace, and what launches nothing.
HLO = """
HloModule jit_step

%fused_computation (p: bf16[64,4096]) -> f8e4m3fn[64,4096] {
  ROOT %c = f8e4m3fn[64,4096]{1,0} convert(%p)
}

ENTRY %main (x: bf16[64,4096], cache: f8e4m3fn[1,64,32,384,128], w: f8e4m3fn[4096,4096]) -> bf16[64,4096] {
  %x = bf16[64,4096]{1,0} parameter(0)
  %cache = f8e4m3fn[1,64,32,384,128]{4,3,2,1,0} parameter(1)
  %w = f8e4m3fn[4096,4096]{1,0} parameter(2)
  %loop_convert_fusion = f8e4m3fn[64,4096]{1,0} fusion(%x), kind=kLoop, calls=%fused_computation
  %loop_dynamic_update_slice_fusion = f8e4m3fn[1,64,32,384,128]{4,3,2,1,0} fusion(%cache, %loop_convert_fusion), kind=kLoop, calls=%fused_computation
  %ffi_call.1 = (bf16[64,4096]{1,0}, u8[1024]{0}) custom-call(%loop_convert_fusion, %w), custom_call_target="jax_epilog_matmul"
  ROOT %get-tuple-element.1 = bf16[64,4096]{1,0} get-tuple-element(%ffi_call.1), index=0
}
"""


def test_kernels_lists_what_launches_with_its_bytes():
    found = h200_hlo.kernels(HLO)
    assert [k["name"] for k in found] == ["loop_convert_fusion",
                                          "loop_dynamic_update_slice_fusion", "ffi_call.1"]
    convert, update, gemm = found
    assert (convert["read"], convert["written"], convert["gemm"]) == (64 * 4096 * 2,
                                                                      64 * 4096, False)
    assert convert["output"] == "f8e4m3fn[64,4096]"
    # an in-place update moves its update, not the whole cache
    assert (update["read"], update["written"]) == (64 * 4096, 64 * 4096)
    assert gemm["what"] == "jax_epilog_matmul" and gemm["gemm"]
    assert gemm["read"] == 64 * 4096 + 4096 * 4096 and gemm["written"] == 64 * 4096 * 2 + 1024
    text = h200_hlo.table(found, bandwidth=1e12)
    moved = 3 * 64 * 4096 + 2 * 64 * 4096
    assert text.splitlines()[-1] == (f"3 kernels; outside the GEMMs {moved / 2**30:.2f} GiB "
                                     f"moved, {moved / 1e12 * 1e3:.2f} ms at 1.0 TB/s")


def test_array_bytes_of_tuples_and_scalars():
    assert h200_hlo.array_bytes("(bf16[2,3]{1,0}, f32[]{}, pred[5]{0})") == 12 + 4 + 5


@pytest.mark.slow
def test_a_decode_step_compiles_for_the_h200_without_a_gpu():
    pytest.importorskip("jax_plugins.xla_cuda13")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "h200_hlo.py"), "decode",
                           "--config", "tiny", "--variant", "stock", "--batch", "4"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dynamic_update_slice" in done.stdout and "kernels; outside the GEMMs" in done.stdout
