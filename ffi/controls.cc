// C entry points that change the library's behaviour at run time (ctypes, from
// jax_epilog.cuda_library): the autotuning switch, the plan cache, and test-only
// fault injection. None touches a GPU; all are safe to call from any thread.
#include "algo_store.h"
#include "autotune.h"
#include "fault_injection.h"
#include "plan_cache.h"
#include "status.h"

// Autotuning on (non-zero) or off for plans not yet tuned; overrides
// JAX_EPILOG_AUTOTUNE.
JAX_EPILOG_EXPORT void jax_epilog_set_autotune(int enabled) {
  jax_epilog::SetAutotune(enabled != 0);
}

// 1 when autotuning is on, else 0.
JAX_EPILOG_EXPORT int jax_epilog_autotune_enabled(void) {
  return jax_epilog::AutotuneEnabled() ? 1 : 0;
}

// The number of plans (problems) cached in this process.
JAX_EPILOG_EXPORT int jax_epilog_plan_cache_size(void) { return jax_epilog::PlanCount(); }

// Forgets every plan and the in-memory copy of the autotune file (whose path is read
// again): the next call of each problem plans, and with autotuning on tunes, anew.
// For tests and benchmarks; safe while other calls run.
JAX_EPILOG_EXPORT void jax_epilog_clear_plan_cache(void) {
  try {
    jax_epilog::ClearPlans();
    jax_epilog::ForgetStoredAlgos();
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
