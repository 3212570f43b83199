// Per-device cuBLASLt handles and the process-wide cache of matmul plans (plan.h).
#ifndef JAX_EPILOG_FFI_PLAN_CACHE_H_
#define JAX_EPILOG_FFI_PLAN_CACHE_H_

#include <cstdint>
#include <memory>

#include "plan.h"
#include "status.h"

namespace jax_epilog {

// The plan for `problem`, built and cached on first use. The cache keeps at most its
// capacity of plans and evicts the least recently used; the caller's reference keeps
// its plan alive meanwhile. Errors: kUnimplemented when cuBLASLt has no algorithm for
// the problem (message: why), kFailedPrecondition for a CUDA failure (no driver, bad
// device), kInternal for any other cuBLASLt failure.
ffi::Error GetPlan(const Problem& requested, std::shared_ptr<Plan>* plan);

// The most plans the cache keeps (at least 1); lowering it evicts at once.
constexpr int64_t kDefaultPlanCapacity = 4096;
void SetPlanCapacity(int64_t capacity);

// The number of cached plans, and dropping them all (tests and benchmarks: the next
// call of each problem plans, and with autotuning on tunes, again).
int PlanCount();
void ClearPlans();

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_PLAN_CACHE_H_
