#include "plan_cache.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "autotune.h"

namespace jax_epilog {
namespace {

// Handles live for the whole process, like the plans holding them; destroying them
// at exit could run after the CUDA driver has been torn down.
ffi::Error HandleFor(int device, cublasLtHandle_t* handle) {
  static std::mutex* mutex = new std::mutex;
  static auto* handles = new std::unordered_map<int, cublasLtHandle_t>;
  std::lock_guard<std::mutex> lock(*mutex);
  if (auto it = handles->find(device); it != handles->end()) {
    *handle = it->second;
    return ffi::Error::Success();
  }
  // The handle takes its device properties from the current device.
  ScopedDevice scoped;
  JAX_EPILOG_RETURN_IF_ERROR(scoped.Enter(device));
  JAX_EPILOG_CUBLAS(cublasLtCreate(handle),
                    "creating the cuBLASLt handle for CUDA device " + std::to_string(device));
  handles->emplace(device, *handle);
  return ffi::Error::Success();
}

// The plans, least recently used first out beyond the capacity. A plan handed out is
// shared: one evicted (or cleared) while a call holds it lives until that call is done.
struct PlanCache {
  using Plans = std::unordered_map<Problem, std::shared_ptr<Plan>, ProblemHash>;
  std::shared_mutex mutex;
  Plans plans;
  // Counts insertions. A lookup stamps its plan with the count, so lookups only read the
  // map (under the shared lock) and recency is known to the nearest insertion, which is
  // all eviction (on insertion) needs.
  std::atomic<uint64_t> clock{0};
  std::atomic<int64_t> capacity{kDefaultPlanCapacity};
};

// Never destroyed: plans are in use until the process ends (see HandleFor).
PlanCache& Cache() {
  static PlanCache* cache = new PlanCache;
  return *cache;
}

// Takes the least recently used plans beyond the capacity out of the cache, into
// `evicted` (destroyed by the caller after unlocking). The caller holds the lock.
void EvictLocked(PlanCache& cache, std::vector<std::shared_ptr<Plan>>* evicted) {
  const size_t capacity = static_cast<size_t>(cache.capacity.load(std::memory_order_relaxed));
  if (cache.plans.size() <= capacity) return;
  std::vector<std::pair<uint64_t, PlanCache::Plans::iterator>> by_age;
  by_age.reserve(cache.plans.size());
  for (auto it = cache.plans.begin(); it != cache.plans.end(); ++it)
    by_age.emplace_back(it->second->last_used.load(std::memory_order_relaxed), it);
  const size_t excess = by_age.size() - capacity;
  std::nth_element(by_age.begin(), by_age.begin() + (excess - 1), by_age.end(),
                   [](const auto& x, const auto& y) { return x.first < y.first; });
  for (size_t i = 0; i < excess; ++i) {
    evicted->push_back(std::move(by_age[i].second->second));
    cache.plans.erase(by_age[i].second);
  }
}

}  // namespace

ffi::Error GetPlan(const Problem& requested, std::shared_ptr<Plan>* plan) {
  // One plan serves problems that differ only in what the plan ignores: TF32 for
  // 16-bit types, fast accumulation for 16/32-bit types, the bias batch for epilogs
  // without a bias input.
  Problem problem = requested;
  problem.allow_tf32 = requested.allow_tf32 && requested.dtype == DType::kF32;
  problem.fast_accumulation = requested.fast_accumulation && IsFp8(requested.dtype);
  if (const EpilogInfo* epilog = FindEpilog(problem.epilog); epilog && !epilog->bias_in)
    problem.batch_bias = 1;
  PlanCache& cache = Cache();
  {
    std::shared_lock<std::shared_mutex> lock(cache.mutex);
    if (auto it = cache.plans.find(problem); it != cache.plans.end()) {
      // Stores only when the stamp changes, so that concurrent calls of a hot plan do
      // not contend for its cache line.
      const uint64_t now = cache.clock.load(std::memory_order_relaxed);
      if (it->second->last_used.load(std::memory_order_relaxed) != now)
        it->second->last_used.store(now, std::memory_order_relaxed);
      *plan = it->second;
      return ffi::Error::Success();
    }
  }
  JAX_EPILOG_RETURN_IF_ERROR(CheckProblem(problem));
  cublasLtHandle_t handle = nullptr;
  JAX_EPILOG_RETURN_IF_ERROR(HandleFor(problem.device, &handle));
  // Built outside the cache lock (the heuristic takes a while); if another thread
  // built the same plan meanwhile, its plan is kept and this one dropped.
  auto built = std::make_shared<Plan>();
  {
    ScopedDevice scoped;
    JAX_EPILOG_RETURN_IF_ERROR(scoped.Enter(problem.device));
    JAX_EPILOG_RETURN_IF_ERROR(BuildPlan(problem, handle, built.get()));
    // With autotuning on, an algorithm tuned earlier (on disk) replaces the heuristic's.
    if (AutotuneEnabled()) ApplyStoredAlgo(*built);
  }
  std::vector<std::shared_ptr<Plan>> evicted;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lock(cache.mutex);
  auto inserted = cache.plans.emplace(problem, std::move(built));
  *plan = inserted.first->second;
  if (inserted.second) {
    (*plan)->last_used.store(cache.clock.fetch_add(1, std::memory_order_relaxed) + 1,
                             std::memory_order_relaxed);
    EvictLocked(cache, &evicted);
  }
  return ffi::Error::Success();
}

int PlanCount() {
  PlanCache& cache = Cache();
  std::shared_lock<std::shared_mutex> lock(cache.mutex);
  return static_cast<int>(cache.plans.size());
}

void ClearPlans() {
  PlanCache& cache = Cache();
  PlanCache::Plans cleared;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lock(cache.mutex);
  cleared.swap(cache.plans);
}

void SetPlanCapacity(int64_t capacity) {
  PlanCache& cache = Cache();
  std::vector<std::shared_ptr<Plan>> evicted;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lock(cache.mutex);
  cache.capacity.store(capacity > 1 ? capacity : 1, std::memory_order_relaxed);
  EvictLocked(cache, &evicted);
}

}  // namespace jax_epilog
