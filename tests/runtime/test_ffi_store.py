"""The C++ library's bounded caches: the autotune file (ffi/algo_store.cc) on the CPU, the plan
cache's capacity on a GPU.

The file tests drive the store alone through the library's test-only entry points, which need no
GPU, only the library loaded (they skip, saying why, where it is not): each entry is a dummy
algorithm whose 8 words are 8 * seed + 0..7, so a line read back shows whose it is.
"""

import multiprocessing
import os
import re

import pytest

from jax_epilog import Epilog, config
from jax_epilog.runtime import library as cuda_library

WORKERS = 2
KEYS_PER_WORKER = 500
LINE = re.compile(r"(?P<key>.+) algo=(?P<words>[0-9a-f]{16}(?:,[0-9a-f]{16}){7})")

needs_library = pytest.mark.skipif(
    not cuda_library.available(),
    reason=f"the CUDA library is not loaded: {cuda_library.unavailable_reason()}")


def _key(worker, index):
    return f"v1 test worker={worker} index={index}"


def _seed(worker, index):
    return worker * 100_000 + index


def _put(path, worker, index, max_entries):
    return cuda_library.library().handle.jax_epilog_algo_store_put_for_test(
        os.fsencode(path), _key(worker, index).encode(), _seed(worker, index), max_entries)


def _count(path):
    return cuda_library.library().handle.jax_epilog_algo_store_count_for_test(os.fsencode(path))


def _put_many(path, worker, max_entries, start):
    """One process's share: KEYS_PER_WORKER entries, begun with the others."""
    start.wait()
    for index in range(KEYS_PER_WORKER):
        assert _put(path, worker, index, max_entries) == 1, (worker, index)


def _entries(path):
    """{key: seed} of the file, asserting that every line is a whole entry with the words of its
    key's seed."""
    entries = {}
    for line in path.read_text().splitlines():
        match = LINE.fullmatch(line)
        assert match, f"a line that does not parse: {line!r}"
        words = [int(w, 16) for w in match["words"].split(",")]
        seed = words[0] // 8
        assert words == [8 * seed + i for i in range(8)], line
        entries[match["key"]] = seed
    return entries


def _run_workers(path, max_entries):
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WORKERS)
    workers = [context.Process(target=_put_many, args=(path, w, max_entries, start))
               for w in range(WORKERS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert [w.exitcode for w in workers] == [0] * WORKERS


@needs_library
def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = tmp_path / "autotune.txt"
    _run_workers(path, max_entries=10_000)
    entries = _entries(path)
    want = {_key(w, i): _seed(w, i) for w in range(WORKERS) for i in range(KEYS_PER_WORKER)}
    assert entries == want
    assert len(path.read_text().splitlines()) == WORKERS * KEYS_PER_WORKER  # nothing twice
    assert _count(path) == WORKERS * KEYS_PER_WORKER


@needs_library
def test_two_processes_compacting_at_once_keep_whole_lines(tmp_path):
    """With a bound of 300 the file is rewritten again and again while both write."""
    path = tmp_path / "autotune.txt"
    _run_workers(path, max_entries=300)
    entries = _entries(path)
    assert len(path.read_text().splitlines()) <= 300 + 300 // 4
    assert _count(path) == len(entries)
    # Each worker's newest entry is kept.
    for worker in range(WORKERS):
        assert entries[_key(worker, KEYS_PER_WORKER - 1)] == _seed(worker, KEYS_PER_WORKER - 1)


@needs_library
def test_bounded_newest_kept(tmp_path):
    path = tmp_path / "autotune.txt"
    for index in range(300):
        assert _put(path, 0, index, max_entries=100) == 1
    entries = _entries(path)
    assert len(path.read_text().splitlines()) <= 125
    assert set(range(200, 300)) <= set(entries.values())
    assert _count(path) == len(entries)
    assert not (tmp_path / "autotune.txt.tmp").exists()


@needs_library
def test_duplicates_collapse_and_foreign_or_torn_lines_are_skipped(tmp_path):
    path = tmp_path / "autotune.txt"
    words = ",".join(f"{8 * 7 + i:016x}" for i in range(8))
    path.write_text(f"garbage\n# a comment\n{_key(0, 1)} algo=12,zz\n{_key(0, 7)} algo={words}\n"
                    f"{_key(0, 7)} algo={words}\n algo={words}\n{_key(0, 9)} algo=0000")
    assert _count(path) == 1
    assert _put(path, 0, 2, max_entries=100) == 1
    lines = path.read_text().splitlines()
    assert lines[-2:] == [f"{_key(0, 9)} algo=0000", f"{_key(0, 2)} algo="
                          + ",".join(f"{8 * 2 + i:016x}" for i in range(8))]
    assert _count(path) == 2


@needs_library
def test_unwritable_file_is_no_error(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    assert _put(blocker / "autotune.txt", 0, 0, max_entries=100) == 0
    assert _count(blocker / "autotune.txt") == 0
    assert blocker.read_text() == ""


def test_plan_cache_capacity_rejects_bad_values():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n: expected a positive int"):
            cuda_library.set_plan_cache_capacity(bad)


@pytest.mark.gpu
def test_plan_cache_capacity_bounds_the_cache():
    """Plans beyond the capacity are dropped, least recently used first."""
    if not cuda_library.available():
        pytest.skip(f"the CUDA library is not loaded: {cuda_library.unavailable_reason()}")
    before = config.plan_cache_capacity()
    try:
        cuda_library.clear_plan_cache()
        cuda_library.set_plan_cache_capacity(3)
        for n in range(16, 16 + 8 * 8, 8):
            supported, message = cuda_library.query_support(
                int(Epilog.DEFAULT), "float32", False, False, 1, 1, 1, 64, n, 64, False, 1 << 22)
            assert supported, message
            assert cuda_library.plan_cache_size() <= 3
        assert cuda_library.plan_cache_size() == 3
        cuda_library.set_plan_cache_capacity(1)
        assert cuda_library.plan_cache_size() == 1
    finally:
        cuda_library.set_plan_cache_capacity(before)
        cuda_library.clear_plan_cache()
