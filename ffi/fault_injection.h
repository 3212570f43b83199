// Test-only fault injection: jax_epilog_inject_failures(count) makes the next `count`
// executions fail as if cublasLtMatmul had returned CUBLAS_STATUS_EXECUTION_FAILED,
// so tests can check that a failure inside the handler becomes a Python exception
// naming the status and that the next call still works.
#ifndef JAX_EPILOG_FFI_FAULT_INJECTION_H_
#define JAX_EPILOG_FFI_FAULT_INJECTION_H_

#include <atomic>

namespace jax_epilog {

inline std::atomic<int> injected_failures{0};

// True (and one fewer failure pending) while failures are pending. Lock-free: it runs
// on every execution.
inline bool TakeInjectedFailure() {
  int pending = injected_failures.load(std::memory_order_relaxed);
  while (pending > 0)
    if (injected_failures.compare_exchange_weak(pending, pending - 1,
                                                std::memory_order_relaxed))
      return true;
  return false;
}

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_FAULT_INJECTION_H_
