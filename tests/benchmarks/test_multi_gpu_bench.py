"""benchmarks/multi_gpu_bench.py: reading the schedule and the trace, the one-device error, and
a smoke run (2 host CPU devices) of every part with --profile. Timings are never asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

import multi_gpu_bench  # noqa: E402

# The shape of XLA's scheduled GPU HLO: a command buffer outlined as a `call`, an asynchronous
# all-reduce with two of our custom calls between its start and its done, a second one wrapped
# in async-start, XLA's own cuBLAS GEMM, and a synchronous all-reduce.
SCHEDULED = """HloModule jit_step, is_scheduled=true, entry_computation_layout={()->f32[]}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}

%command_buffer (p: bf16[64,64]) -> bf16[64,64] {
  %p = bf16[64,64]{1,0} parameter(0)
  ROOT %custom-call.2 = (bf16[64,64]{1,0}, u8[1024]{0}) custom-call(bf16[64,64]{1,0} %p, bf16[64,64]{1,0} %p), custom_call_target="jax_epilog_matmul"
}

%wrapped_all_reduce (q: bf16[64]) -> bf16[64] {
  %q = bf16[64]{0} parameter(0)
  ROOT %all-reduce.9 = bf16[64]{0} all-reduce(bf16[64]{0} %q), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main.1 (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %custom-call.1 = (bf16[64,64]{1,0}, u8[1024]{0}) custom-call(bf16[64,64]{1,0} %a, bf16[64,64]{1,0} %a), custom_call_target="jax_epilog_matmul"
  %all-reduce-start.1 = bf16[64,64]{1,0} all-reduce-start(bf16[64,64]{1,0} %a), replica_groups={{0,1}}, to_apply=%add
  %call.1 = bf16[64,64]{1,0} call(bf16[64,64]{1,0} %a), to_apply=%command_buffer
  %custom-call.3 = (bf16[64,64]{1,0}, u8[1024]{0}) custom-call(bf16[64,64]{1,0} %a, bf16[64,64]{1,0} %a), custom_call_target="jax_epilog_matmul"
  %all-reduce-done.1 = bf16[64,64]{1,0} all-reduce-done(bf16[64,64]{1,0} %all-reduce-start.1)
  %async-start.1 = ((bf16[64]{0}), bf16[64]{0}) async-start(bf16[64]{0} %b), calls=%wrapped_all_reduce
  %gemm.1 = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(bf16[64,64]{1,0} %a, bf16[64,64]{1,0} %a), custom_call_target="__cublas$lt$matmul"
  %async-done.1 = bf16[64]{0} async-done(((bf16[64]{0}), bf16[64]{0}) %async-start.1)
  %all-reduce.2 = bf16[64]{0} all-reduce(bf16[64]{0} %b), replica_groups={{0,1}}, to_apply=%add
  ROOT %tuple = (bf16[64,64]{1,0}) tuple(bf16[64,64]{1,0} %a)
}
"""


def test_schedule_pairs_each_async_collective_with_the_gemms_inside_it():
    summary = multi_gpu_bench.schedule_summary(SCHEDULED)
    assert summary["scheduled"] is True
    assert summary["order"] == "O <0 O O >0 <1 X >1 C"
    assert summary["our_custom_calls"] == 3 and summary["xla_gemms"] == 1
    assert summary["synchronous_collectives"] == 1
    first, second = summary["async_collectives"]
    assert first == {"index": 0, "collective": "all-reduce", "ours": 2, "xla_gemm": 0}
    assert second == {"index": 1, "collective": "all-reduce", "ours": 0, "xla_gemm": 1}
    assert summary["async_overlapping_ours"] == 1 and summary["async_overlapping_any_gemm"] == 2


def test_schedule_without_entry_says_so():
    assert "error" in multi_gpu_bench.schedule_summary("HloModule empty\n")


def test_overlap_counts_gemms_on_other_streams_only():
    collectives = [(0.0, 100.0, "Stream #2"), (200.0, 300.0, "Stream #2")]
    gemms = [(50.0, 150.0, "Stream #1"), (60.0, 120.0, "Stream #1"),  # one union: 50..100 inside
             (250.0, 260.0, "Stream #2")]  # same stream as the collective: not alongside
    assert multi_gpu_bench.overlap_ns(collectives, gemms) == 50.0


def test_one_device_fails_clearly():
    with pytest.raises(SystemExit, match="needs at least 2 devices, sees 1"):
        multi_gpu_bench.run(["dp"], multi_gpu_bench.SMOKE, multi_gpu_bench.SMOKE_TP, 1, None)


@pytest.mark.slow
def test_smoke_run_with_profile(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu_bench.py"), "--smoke",
                    "--rounds", "1", "--profile", str(tmp_path / "profile"),
                    "--out", str(tmp_path)], check=True, env=env, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "multi_gpu.json").read_text())
    for part in ("data_parallel", "tensor_parallel"):
        rows = report[part]["rows"]
        assert [(r["implementation"], r["devices"]) for r in rows] == [
            ("jax-epilog", 1), ("jax-epilog", 2), ("XLA", 1), ("XLA", 2)]
        assert all(r["ms"] > 0 for r in rows) and "speedup" in rows[1]
    assert report["data_parallel"]["rows"][1]["all_gathers"] == 0
    overlap = report["data_parallel"]["overlap"]
    assert set(overlap) == {"jax-epilog", "XLA"}
    for summary in overlap.values():
        assert summary["schedule"]["xla_gemms"] + summary["schedule"]["our_custom_calls"] > 0
        assert (Path(summary["folder"]) / "step.hlo.txt").exists()
        assert list(Path(summary["folder"]).rglob("*.xplane.pb"))
    text = (tmp_path / "multi_gpu.md").read_text()
    assert "# Tensor-parallel MLP block" in text and "### All-reduces and GEMMs" in text
