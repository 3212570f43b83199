// cuBLASLt and CUDA status names, and the helpers that turn a failed call into an
// FFI error. Every error message names the status (e.g. CUBLAS_STATUS_NOT_SUPPORTED)
// and what was being done, so a Python exception says what went wrong.
#ifndef JAX_EPILOG_FFI_STATUS_H_
#define JAX_EPILOG_FFI_STATUS_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "xla/ffi/api/ffi.h"

#define JAX_EPILOG_EXPORT extern "C" __attribute__((visibility("default")))

namespace jax_epilog {

namespace ffi = xla::ffi;

inline std::string StatusName(cublasStatus_t status) {
  const char* name = cublasLtGetStatusName(status);
  return name ? name : "CUBLAS_STATUS_" + std::to_string(static_cast<int>(status));
}

inline std::string StatusName(cudaError_t error) {
  const char* name = cudaGetErrorName(error);
  return name ? name : "cudaError " + std::to_string(static_cast<int>(error));
}

inline ffi::Error CublasError(cublasStatus_t status, std::string_view what) {
  // NOT_SUPPORTED is cuBLASLt declining a configuration, not a broken call: it is
  // reported as kUnimplemented so callers can tell "unsupported" from "failed".
  const ffi::ErrorCode code = status == CUBLAS_STATUS_NOT_SUPPORTED
                                  ? ffi::ErrorCode::kUnimplemented
                                  : ffi::ErrorCode::kInternal;
  return ffi::Error(code, StatusName(status) + " while " + std::string(what));
}

inline ffi::Error CudaError(cudaError_t error, std::string_view what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    StatusName(error) + " while " + std::string(what));
}

}  // namespace jax_epilog

// Evaluate a cuBLASLt / CUDA call once; on failure return the FFI error naming the
// status and `what` (a string, evaluated only on failure).
#define JAX_EPILOG_CUBLAS(call, what)                                 \
  do {                                                                \
    if (const cublasStatus_t s_ = (call); s_ != CUBLAS_STATUS_SUCCESS) \
      return ::jax_epilog::CublasError(s_, (what));                   \
  } while (0)

#define JAX_EPILOG_CUDA(call, what)                          \
  do {                                                       \
    if (const cudaError_t e_ = (call); e_ != cudaSuccess)    \
      return ::jax_epilog::CudaError(e_, (what));            \
  } while (0)

// Propagate the error of an ffi::Error-returning expression.
#define JAX_EPILOG_RETURN_IF_ERROR(expr)                      \
  do {                                                        \
    if (::xla::ffi::Error err_ = (expr); err_.failure()) return err_; \
  } while (0)

#endif  // JAX_EPILOG_FFI_STATUS_H_
