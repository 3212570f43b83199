// C entry points that change the library's behaviour at run time (ctypes, from
// jax_epilog.cuda_library): the settings (the library reads no environment variable:
// Python parses them, jax_epilog.config, and sets them here right after loading), the
// plan cache, and test-only fault injection. None touches a GPU; all are safe to call
// from any thread.
#include <cstdint>
#include <exception>
#include <string>

#include "algo_store.h"
#include "autotune.h"
#include "fault_injection.h"
#include "plan_cache.h"
#include "status.h"

// Autotuning on (non-zero) or off for plans not yet tuned. On until set.
JAX_EPILOG_EXPORT void jax_epilog_set_autotune(int enabled) {
  jax_epilog::SetAutotune(enabled != 0);
}

// Each tuning logged to stderr (non-zero) or not. Off until set.
JAX_EPILOG_EXPORT void jax_epilog_set_autotune_log(int enabled) {
  jax_epilog::SetAutotuneLog(enabled != 0);
}

// The file of tuned algorithms; "" (or NULL), the default, means no file. The
// in-memory copy is forgotten: the next lookup reads the new file.
JAX_EPILOG_EXPORT void jax_epilog_set_autotune_cache_path(const char* path) {
  try {
    jax_epilog::ProcessAlgoStore().SetPath(path != nullptr ? path : "");
  } catch (const std::exception&) {  // std::bad_alloc must not cross into C
  }
}

// 1 when autotuning is on, else 0.
JAX_EPILOG_EXPORT int jax_epilog_autotune_enabled(void) {
  return jax_epilog::AutotuneEnabled() ? 1 : 0;
}

// The most plans kept cached (at least 1; default 4096): beyond it the least recently
// used are dropped. A call using a dropped plan finishes with it.
JAX_EPILOG_EXPORT void jax_epilog_set_plan_cache_capacity(int64_t capacity) {
  try {
    jax_epilog::SetPlanCapacity(capacity);
  } catch (const std::exception&) {  // std::bad_alloc must not cross into C
  }
}

// The number of plans (problems) cached in this process.
JAX_EPILOG_EXPORT int jax_epilog_plan_cache_size(void) { return jax_epilog::PlanCount(); }

// Forgets every plan and the in-memory copy of the autotune file: the next call of each
// problem plans, and with autotuning on tunes (or reads the file), anew.
// For tests and benchmarks; safe while other calls run.
JAX_EPILOG_EXPORT void jax_epilog_clear_plan_cache(void) {
  try {
    jax_epilog::ClearPlans();
    jax_epilog::ProcessAlgoStore().Forget();
  } catch (...) {  // std::bad_alloc must not cross into C; the cache stays usable
  }
}

// Test only: the next `count` executions fail as if cublasLtMatmul had returned
// CUBLAS_STATUS_EXECUTION_FAILED (0 cancels pending failures).
JAX_EPILOG_EXPORT void jax_epilog_inject_failures(int count) {
  jax_epilog::injected_failures.store(count > 0 ? count : 0);
}

// How many executions so far were recorded into a CUDA graph (an XLA command buffer).
JAX_EPILOG_EXPORT int64_t jax_epilog_captured_executions(void) {
  return jax_epilog::captured_executions.load(std::memory_order_relaxed);
}

// Test only, no GPU needed: stores under `key`, in the file at `path` (bounded to
// `max_entries`), a dummy algorithm whose 8 words are 8 * seed + 0..7, as a process's
// store would; 1 when the file has it, else 0.
JAX_EPILOG_EXPORT int jax_epilog_algo_store_put_for_test(const char* path, const char* key,
                                                         uint64_t seed, int64_t max_entries) {
  try {
    jax_epilog::AlgoStore store(max_entries > 0 ? static_cast<size_t>(max_entries) : 1);
    store.SetPath(path != nullptr ? path : "");
    cublasLtMatmulAlgo_t algo{};
    for (size_t i = 0; i < sizeof(algo.data) / sizeof(algo.data[0]); ++i)
      algo.data[i] = 8 * seed + i;
    return store.Put(key != nullptr ? key : "", algo) ? 1 : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// Test only: the number of entries a process reads from the file at `path` (-1: error).
JAX_EPILOG_EXPORT int64_t jax_epilog_algo_store_count_for_test(const char* path) {
  try {
    jax_epilog::AlgoStore store;
    store.SetPath(path != nullptr ? path : "");
    return static_cast<int64_t>(store.Size());
  } catch (const std::exception&) {
    return -1;
  }
}
