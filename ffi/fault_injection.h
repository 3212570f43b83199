// Test-only fault injection: jax_epilog_inject_failures(count) makes the next `count`
// executions fail as if cublasLtMatmul had returned CUBLAS_STATUS_EXECUTION_FAILED,
// so tests can check that a failure inside the handler becomes a Python exception
// naming the status and that the next call still works.
#ifndef JAX_EPILOG_FFI_FAULT_INJECTION_H_
#define JAX_EPILOG_FFI_FAULT_INJECTION_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

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

// How many executions were recorded into a CUDA graph (an XLA command buffer) rather than
// run eagerly: lets a test prove the handler really runs inside command buffers.
inline std::atomic<int64_t> captured_executions{0};

// cudaStreamIsCapturing is the one stream query that is legal during capture.
inline void CountIfCaptured(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status == cudaStreamCaptureStatusActive)
    captured_executions.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_FAULT_INJECTION_H_
