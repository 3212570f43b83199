"""The plan-cache soak (benchmarks/soak.py, ffi/soak.cc): its verdict on the CPU, a small soak
on the GPU (every problem distinct, the cache never above its capacity)."""


import pytest


import soak  # noqa: E402
from conftest import HAS_CUDA  # noqa: E402

MIB = soak.MIB


def samples(rss_mib, device_mib, cached):
    return [{"rss_bytes": r * MIB, "device_bytes": d * MIB, "plan_cache_size": c}
            for r, d, c in zip(rss_mib, device_mib, cached)]


def test_chunks_cover_every_shape_once():
    bounds = soak.chunk_bounds(20_000, 40)
    assert bounds[0] == (0, 500) and len(bounds) == 40
    assert [first for first, _ in bounds] == [sum(n for _, n in bounds[:i]) for i in range(40)]
    assert sum(n for _, n in bounds) == 20_000
    assert sum(n for _, n in soak.chunk_bounds(7, 3)) == 7
    with pytest.raises(ValueError, match="chunks <= shapes"):
        soak.chunk_bounds(3, 4)


def test_warmup_lasts_until_the_cache_is_full():
    eight = samples([0] * 8, [0] * 8, [100, 200, 256, 256, 256, 256, 256, 256])
    assert soak.warmup_chunks(eight, 0.25, capacity=256) == 3  # full after chunk 3
    assert soak.warmup_chunks(eight, 0.5, capacity=256) == 4   # the fraction is longer
    assert soak.warmup_chunks(eight, 0.25, capacity=512) == 8  # never full: all warm-up
    with pytest.raises(ValueError, match="fraction"):
        soak.warmup_chunks(eight, 1.0, capacity=256)


def test_growth_after_the_warmup_is_not_flat():
    # Growth while warming up is allowed; after it, only below the bound.
    flat = soak.judge_flat(samples([100, 400, 401, 402, 401], [10, 90, 90, 91, 90], [0] * 5),
                           warmup=2)
    assert flat["flat"] is True and flat["rss_bytes"]["growth"] == 2 * MIB
    leak = soak.judge_flat(samples([100, 400, 420, 440, 460], [10, 90, 90, 91, 90], [0] * 5),
                           warmup=2)
    assert leak["flat"] is False
    assert leak["rss_bytes"]["flat"] is False and leak["device_bytes"]["flat"] is True
    assert leak["rss_bytes"]["growth"] == 60 * MIB
    device = soak.judge_flat(samples([1] * 4, [10, 10, 10, 10 + soak.FLAT_BOUND_MIB], [0] * 4),
                             warmup=1)
    assert device["flat"] is False and device["device_bytes"]["flat"] is False
    assert soak.judge_flat(samples([1] * 3, [1] * 3, [0] * 3), warmup=3)["flat"] is None


def test_report_states_settings_and_verdict():
    chunks = samples([500, 510, 510, 560], [700, 720, 720, 720], [50, 64, 64, 64])
    for i, s in enumerate(chunks):
        s.update(chunk=i, shapes_done=100 * (i + 1), ran=90, unsupported=10, most_cached=64,
                 us_per_shape=123.0)
    report = {
        "metadata": {"date": "2026-12-01", "gpu_name": "GPU", "device": "d",
                     "driver_version": "1", "jax": "0.x", "jaxlib": "0.x",
                     "cublaslt_version": 130100},
        "settings": {"shapes": 400, "max_dim": 64, "seed": 0, "plan_cache_capacity": 64,
                     "workspace_bytes": 32 * MIB, "warmup_fraction": 0.25, "budget_s": 100},
        "before": {"rss_bytes": 400 * MIB, "device_bytes": 600 * MIB},
        "samples": chunks, "seconds": 2.5, "shapes_done": 400,
        "verdict": soak.judge_flat(chunks, soak.warmup_chunks(chunks, 0.25, 64))}
    text = soak.markdown(report)
    assert "400 of 400 distinct problems" in text and "360 planned and run, 40 without" in text
    assert "| 4 | 1 | 400 | 64 (64) | 560.0 | 720.0 | 123 |" in text
    assert "(+50.0 MiB; bound 32 MiB): GROWS" in text and "Verdict: NOT flat." in text


@pytest.fixture
def restore_settings():
    """The soak turns autotuning off and may set the cache's capacity: put both back."""
    from jax_epilog import config

    autotune, capacity = config.autotune(), config.plan_cache_capacity()
    yield
    config.set_autotune(autotune)
    config.set_plan_cache_capacity(capacity)


@pytest.mark.skipif(HAS_CUDA, reason="checks the error where there is no GPU")
def test_without_a_gpu_the_soak_says_why(tmp_path, restore_settings):
    with pytest.raises((SystemExit, RuntimeError), match="soak"):
        soak.main(["--shapes", "10", "--chunks", "1", "--out", str(tmp_path)])


@pytest.mark.gpu
def test_small_soak_keeps_the_cache_bounded(restore_settings):
    # Capacity above the shapes: every problem is distinct, so each one run adds a plan.
    roomy = soak.run(shapes=600, chunks=3, max_dim=128, seed=1, device=0, warmup=0.25,
                     capacity=4096, budget_s=60)
    ran = sum(s["ran"] for s in roomy["samples"])
    assert ran + sum(s["unsupported"] for s in roomy["samples"]) == 600
    assert ran > 300  # most problems have a cuBLASLt kernel
    assert roomy["samples"][-1]["plan_cache_size"] == ran
    # Capacity far below: the cache fills, then evicts, and never holds more.
    tight = soak.run(shapes=2000, chunks=8, max_dim=256, seed=2, device=0, warmup=0.25,
                     capacity=256, budget_s=60)
    assert tight["shapes_done"] == 2000
    assert max(s["most_cached"] for s in tight["samples"]) == 256
    assert all(s["plan_cache_size"] <= 256 for s in tight["samples"])
    assert tight["verdict"]["flat"] is not None


def test_run_records_every_chunk_and_judges(monkeypatch, restore_settings):
    """run()'s flow on the CPU, with a stand-in for the library: a cache that fills to its
    capacity and a device whose memory stays put."""
    from jax_epilog.runtime import library as cuda_library

    cache = {"plans": 0}

    class FakeSoak:
        def __init__(self, device):
            assert device == 0

        def run_chunk(self, seed, first, count, max_dim, workspace_bytes):
            cache["plans"] = min(128, cache["plans"] + count)
            return {"ran": count, "unsupported": 0, "most_cached": cache["plans"]}

        def device_bytes(self):
            return 700 * MIB

    monkeypatch.setattr(soak, "Soak", FakeSoak)
    monkeypatch.setattr(cuda_library, "plan_cache_size", lambda: cache["plans"])
    monkeypatch.setattr(cuda_library, "clear_plan_cache", lambda: cache.update(plans=0))
    report = soak.run(shapes=400, chunks=8, max_dim=32, seed=0, device=0, warmup=0.25,
                      capacity=128, budget_s=60)
    assert [s["shapes_done"] for s in report["samples"]] == [50 * i for i in range(1, 9)]
    assert report["settings"]["plan_cache_capacity"] == 128
    assert report["verdict"]["warmup_chunks"] == 3  # the cache is full after chunk 3, not 2
    assert report["verdict"]["device_bytes"]["growth"] == 0
    assert report["verdict"]["flat"] in (True, False)  # RSS is this process's, whatever it is
    assert "Verdict:" in soak.markdown(report)

    firsts = []
    monkeypatch.setattr(FakeSoak, "run_chunk", lambda self, seed, first, count, *rest: (
        firsts.append(first), cache.update(plans=128),  # full after the first chunk
        {"ran": count, "unsupported": 0, "most_cached": 128})[2])
    report = soak.run(shapes=400, chunks=4, max_dim=32, seed=0, device=0, warmup=0.25,
                      capacity=128, budget_s=60, passes=3)
    assert firsts == [0, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1100]  # all new
    assert [s["pass"] for s in report["samples"]] == [1] * 4 + [2] * 4 + [3] * 4
    assert report["verdict"]["warmup_chunks"] == 4  # the whole first pass
    assert report["settings"]["shapes"] == 1200 and "and the whole first pass" in \
        soak.markdown(report)
